"""torchrun, with the project's one-line endings: ``python -m detector.cli.launch <torchrun's arguments>`` (make train
and make profile with NPROC or NNODES).

torchrun (``torch.distributed.run``) starts one process per rank and, when one fails, stops the others (SIGTERM,
then SIGKILL after its 30 s grace) and raises a ``ChildFailedError`` whose traceback runs to some 40 lines. Here the
same launch ends as the project's commands end:

- a rank that fails on its own (an error, a user's mistake or a bug) ends at once and leaves its error's line in a
  folder of the launcher's; the launcher prints one line: which rank, its error, the run's last checkpoint and the
  command that continues it (``error: rank 1 of 2 (pid ...) failed: ...``, exit status 2, or 1 for a bug);
- a rank that dies (a signal, a crash) gets one line: which rank, how it ended, the run's last checkpoint and the
  command that continues it (``failed: ...``, exit status 1);
- a stop every rank agreed on (SIGTERM or Ctrl-C to the launcher reaches every rank, which checkpoint) ends with rank
  0's own line (``terminated``, ``interrupted``: 143, 130).

The other ranks learn of a failed rank at their next collective (``distributed.Control``, a step's gloo collective)
and stop without a line of their own (``LAUNCHED``); none outlives torchrun's grace of 30 s (an NCCL
collective the host waits on, which only that SIGKILL ends). A rank never outlives the launcher: killed (even by
kill -9), every rank stops as on SIGTERM (Linux's parent-death signal), checkpoints and ends.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path

# the launcher's contract with its ranks (detector/cli/main.py reads them in each rank)
LAUNCHED = "DETECTOR_LAUNCHED"  # set for the ranks: the launcher names a process that died, not they
FAILURES = "DETECTOR_FAILURES"  # the folder where a rank that fails on its own leaves its error's line
STOP_STATUS = "stop-status"  # and where rank 0 leaves the exit status of the word its stop's line said
LAUNCHER_PID = "DETECTOR_LAUNCHER_PID"  # the launcher's pid: a rank that finds another parent has lost it
OWN_LINE = (2, 130, 143)  # exit statuses of a rank that printed its own line (detector/cli/main.py)
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")  # torchrun's: each raises its SignalException


def stop_once(handler):
    """torchrun's signal handler, for the first stop signal only, after which the launcher ignores the others. The
    ranks had that signal too (Ctrl-C and a scheduler's SIGTERM reach the process group) and are stopping: torchrun then
    waits for them, up to its grace. A second Ctrl-C raised torchrun's exception again inside that wait, which broke
    it off: the ranks were stopped before rank 0 said its line, and the launch ended in silence."""

    def first(signum, frame):
        for name in STOP_SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
        handler(signum, frame)

    return first


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import api as elastic
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    for name in list(logging.root.manager.loggerDict):  # torchrun's own warnings as it stops ranks: our line says it
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED], os.environ[LAUNCHER_PID] = "1", str(os.getpid())
    # torchrun gives each rank this where it is unset, with a banner of five lines saying so: the same, unsaid
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="detector-launch-") as failures:
        # where a rank that fails on its own leaves its error's line (detector/cli/main.py)
        os.environ[FAILURES] = failures
        if args.log_dir is None and args.redirects == args.tee == "0":
            # torchrun makes a log folder in /tmp at every launch even where it logs nothing, and leaves it: this one
            # goes with the launcher's (a user who redirects the ranks' output keeps torchrun's, or names --log-dir)
            args.log_dir = os.path.join(failures, "torchrun")
        elastic._terminate_process_handler = stop_once(elastic._terminate_process_handler)  # registered by run
        try:
            run(args)
        except ChildFailedError as err:
            return failed(err, args, argv, Path(failures))
        except SignalException as err:  # the ranks had it too, and each said how it stopped: the status of the word
            # rank 0's line said (its first signal's, where a second of another kind came: torchrun's is its last)
            return stop_status(Path(failures), 128 + int(err.sigval))
    return 0


def failed(err, args, argv: list[str], failures: Path) -> int:
    """The one line of a launch whose rank failed, and its exit status: a rank's own error (its line, left in
    ``failures``: exit 2 for a user's mistake, 1 for a bug, whose traceback it printed), a rank's death (1), or a stop
    each rank said itself (130, 143: nothing to add)."""
    ordered = sorted(err.failures.items(), key=lambda item: item[1].timestamp)
    killed = [rank for rank, f in ordered if f.exitcode < 0]  # a death is the cause of what the others said
    said = [
        (rank, f, (failures / f"rank{rank}").read_text()) for rank, f in ordered if (failures / f"rank{rank}").exists()
    ]
    if said and not killed:
        rank, failure, message = said[0]
        world = f" of {args.nproc_per_node}" if one_node(args) else ""
        line = f"rank {rank}{world} (pid {failure.pid}) failed: {message}; torchrun stopped the others"
        print(f"error: {line}; {continuation(args, argv)}", file=sys.stderr)
        return failure.exitcode if failure.exitcode in (1, 2) else 2
    died = [(rank, f) for rank, f in ordered if f.exitcode not in OWN_LINE]
    if not died:
        return stop_status(failures, ordered[0][1].exitcode)
    rank, failure = died[0]
    print(f"failed: {how(rank, failure, args)}; {continuation(args, argv)}", file=sys.stderr)
    return 1


def stop_status(failures: Path, otherwise: int) -> int:
    """The exit status of the word rank 0's stop line said (130 interrupted, 143 terminated: its first signal's, where
    a second of another kind came), else ``otherwise``."""
    said = failures / STOP_STATUS
    return int(said.read_text()) if said.is_file() else otherwise


def how(rank: int, failure, args) -> str:
    """Which rank ended how: ``rank 1 of 2 (pid 1234) was killed by SIGKILL``."""
    world = f" of {args.nproc_per_node}" if one_node(args) else ""
    if failure.exitcode < 0:
        try:
            ended = f"was killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            ended = f"was killed by signal {-failure.exitcode}"
    else:
        ended = f"exited with status {failure.exitcode}"
    return f"rank {rank}{world} (pid {failure.pid}) {ended}, and torchrun stopped the others"


def one_node(args) -> bool:
    return str(args.nnodes) in ("1", "1:1")


def continuation(args, argv: list[str]) -> str:
    """The run's last checkpoint and the command that continues it, for a training run: make's where make ran it,
    else this launch's own."""
    command = [args.training_script, *args.training_script_args]
    if not (args.module and command[:2] == ["detector", "train"]):
        return "run the command again"
    try:
        run_dir, experiment, overrides = training_run(command[2:])
        from detector.train import checkpoints

        step = checkpoints.committed_step(run_dir)
    except Exception as err:  # noqa: BLE001 - a hint, never a second failure
        return f"its last checkpoint could not be read ({err})"
    if not step:
        return f"{run_dir} holds no checkpoint to continue from (train.checkpoint_every)"
    again = [o for o in overrides if not o.startswith("train.resume=")] + ["train.resume=true"]
    if os.environ.get("MAKELEVEL") and experiment:
        nodes = "" if one_node(args) else f" NNODES={args.nnodes} (on every node)"
        command = (
            f"make train EXPERIMENT={experiment} NPROC={args.nproc_per_node}{nodes} ARGS={shlex.quote(' '.join(again))}"
        )
    else:
        command = shlex.join([sys.executable, "-m", "detector.cli.launch", *argv, "train.resume=true"])
    return f"its last checkpoint is step {step} in {checkpoints.manifest_path(run_dir)}: continue with {command}"


def training_run(argv: list[str]) -> tuple[Path, str, list[str]]:
    """The run folder, experiment and overrides of ``python -m detector train <argv>`` (imported here, on a failure
    only: the launcher itself starts in a moment)."""
    from detector.cli.arguments import command_parser
    from detector.config.schema import load_config
    from detector.train.run.folder import run_path

    parsed = command_parser("train").parse_intermixed_args(argv)
    cfg = load_config(parsed.overrides, parsed.experiment, announce=None)
    return run_path(cfg, parsed.experiment), parsed.experiment or "", parsed.overrides


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
