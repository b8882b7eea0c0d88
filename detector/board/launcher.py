"""`make tensorboard`: TensorBoard on a folder of runs, with the Traces tab, offline.

It listens on the loopback interface (127.0.0.1) unless told otherwise: TensorBoard serves the runs' traces,
tables and configurations to whoever can reach its port, so ``--host 0.0.0.0`` (every interface) is for a
machine whose network you trust. A port another program holds, or an interface the machine lacks, is refused in one
line before TensorBoard announces its address (``check_port``).
"""

from __future__ import annotations

import errno
import os
import socket

from detector.errors import UserError

LOOPBACK = "127.0.0.1"


def main(logdir: str = "runs", port: int = 6006, host: str = LOOPBACK) -> None:
    """TensorBoard on ``logdir`` at ``host:port``, with the Traces tab (detector/board/plugin.py) also where the
    package is not installed; blocks until stopped."""
    from absl import app
    from tensorboard import default, main_lib, program

    from detector.board.plugin import TracesPlugin

    plugins = default.get_plugins()
    if not any(getattr(p, "plugin_name", None) == TracesPlugin.plugin_name for p in plugins):
        plugins.append(TracesPlugin)  # not installed as a package: its entry point is not there
    argv = ["tensorboard", "--logdir", str(logdir), "--port", str(port), "--host", host]
    shown = "localhost" if host == LOOPBACK else host
    url = f"http://{shown}:{port}/"
    print(
        f"TensorBoard on {url}"
        + ("" if host == LOOPBACK else f" (listening on {host}: reachable from the network)")
        + f"\n  Time Series {url}#timeseries  the comparison's charts first, then each measure per step: tick runs\n"
        f"  Traces      {url}#traces      steps of several runs as lanes on one time axis: zoom, hover, click\n"
        f"  Text        {url}#text        the comparison's verdicts and tables, each run's table",
        flush=True,
    )
    main_lib.global_init()
    tensorboard = program.TensorBoard(plugins=plugins)
    app.run(tensorboard.main, argv=argv, flags_parser=tensorboard.configure)


def check_port(port: int, host: str = LOOPBACK) -> None:
    """Refuse a port another program listens on, before TensorBoard announces its address and then fails."""
    problem = port_problem(port, host)
    if problem == errno.EADDRINUSE:
        free = next((p for p in range(port + 1, min(port + 100, 65536)) if port_problem(p, host) is None), None)
        example = f', e.g. make tensorboard ARGS="--port {free}"' if free else ""
        raise UserError(f"port {port} is already in use (another TensorBoard?): choose another with --port{example}")
    if problem is not None:
        why = os.strerror(problem) if problem > 0 else "no such interface on this machine"
        raise UserError(f"{host}:{port} cannot be opened ({why}): choose another --host or --port")


def port_problem(port: int, host: str = LOOPBACK) -> int | None:
    """The errno of binding ``host:port`` as TensorBoard will, or None if it is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as err:
            return err.errno
    return None
