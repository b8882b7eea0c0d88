"""`make tensorboard`: TensorBoard on a folder of runs, with the Traces tab, offline.

It listens on the loopback interface (127.0.0.1) unless told otherwise: TensorBoard serves the runs' traces,
tables and configurations to whoever can reach its port, so ``--host 0.0.0.0`` (every interface) is for a
machine whose network you trust.
"""

from __future__ import annotations

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
