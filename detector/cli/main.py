"""The command line's entry, ``main`` (``python -m detector``): a command parsed (its grammar:
detector/cli/arguments.py), run, and its process ended.

A user's mistake (an unknown command or option, a bad config value, a missing file) is one line ``error: ...`` on
stderr and exit status 2; ``--debug`` or ``DETECTOR_DEBUG=1`` shows the traceback instead. Ctrl-C is one line
``interrupted`` (with what was kept, where a command knows) and exit status 130, the shell's for SIGINT; SIGTERM, which
schedulers send before they kill, is handled the same way: one line ``terminated``, exit status 143. Nothing is printed
after that line, however many signals follow (detector/train/run/interrupt.py). One process of several (torchrun's
ranks) that fails on its own ends at once, leaving its line to the launcher (detector/cli/launch.py). A thread that
raises (ours, DCP's writers, TensorBoard's) prints no traceback: what waited on it says it in the command's line, and a
failure nothing said is one ``warning:`` line as the command ends (detector/errors.py ``ThreadFailures``; ``--debug``
prints the tracebacks too).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from detector.bench import TARGETS as BENCH_TARGETS
from detector.cli.arguments import COMMANDS, TOP_LEVEL, check_sections, command_parser, top_parser
from detector.cli.launch import FAILURES, LAUNCHED, LAUNCHER_PID, STOP_STATUS
from detector.errors import ENVIRONMENT, PeerLost, ThreadFailures, UserError, refuse, said
from detector.train.run.interrupt import LAUNCHER_LOST, CommandSignals, Handlers, Terminated

INTERRUPTED = 130  # the shell's exit status for a program stopped by SIGINT (Ctrl-C)
TERMINATED = 143  # and by SIGTERM (128 + 15)


def main(argv: list[str] | None = None) -> int:
    """The command line's entry; ``argv`` given (a test, a script): the signal handlers are restored after it."""
    command_line = argv is None  # then the interpreter exits after us: the handlers stay, ignoring late signals
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("DETECTOR_DEBUG", "") not in ("", "0") or "--debug" in argv
    with CommandSignals(keep=command_line), ThreadFailures(debug, keep=command_line):
        if os.environ.get(LAUNCHED):
            tie_to_launcher()  # once the handlers are in place: LAUNCHER_LOST's default action is death
        status = command(argv, debug)
        for line in ThreadFailures.unsaid() if status == 0 else []:  # a failed command's line is the one line
            print(line, file=sys.stderr)
    return status


def command(argv: list[str], debug: bool) -> int:
    """Parse and run the command of ``argv``; its exit status, a user's error, a stop or a full disk said in one line
    (``--debug``: raised)."""
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))  # the command
    try:
        top = top_parser().parse_args(argv[: at + 1])
        # intermixed: `train --experiment NAME key=value` and `profile key=value --experiment NAME` alike
        args = command_parser(top.command).parse_intermixed_args(argv[at + 1 :])
        status = run(top.command, args)
    except PeerLost as err:  # under detector.cli.launch, the launcher names the process that stopped
        if debug:
            raise
        Handlers.stopping = True  # torchrun's SIGTERM follows: nothing is printed after this
        return alone(2 if os.environ.get(LAUNCHED) else refuse(err))
    except (UserError, FileNotFoundError) as err:
        if debug:
            raise
        return alone(2, err) if in_group() else refuse(err)
    except OSError as err:  # a folder made read-only, a full disk: the machine's state, said in one line
        if debug or err.errno not in ENVIRONMENT:
            raise
        return alone(2, err) if in_group() else refuse(err)
    except KeyboardInterrupt as err:  # the command's state is valid: checkpoints and run folders are atomic
        if debug:
            raise
        word, status = ("terminated", TERMINATED) if isinstance(err, Terminated) else ("interrupted", INTERRUPTED)
        if os.environ.get("RANK", "0") == "0":  # one line for the run, whatever its number of processes
            print(f"{word}{': ' if str(err) else ''}{' '.join(str(err).split())}", file=sys.stderr)
            folder = os.environ.get(FAILURES)
            if folder and Path(folder).is_dir():  # the launcher's status is this word's, not its last signal's
                Path(folder, STOP_STATUS).write_text(str(status))
        if writing():  # a save the second signal abandoned: its threads must not meet the interpreter's exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return alone(status)
    except Exception as err:  # a bug: its traceback; one of several processes ends at once all the same
        if not in_group():
            raise
        traceback.print_exc()
        return alone(1, err)
    return status


def writing() -> bool:
    """Whether a checkpoint's writer thread is still at work (train/checkpoints/writer.py): a save a stop abandoned."""
    return any(t.name == "checkpoint-writer" and t.is_alive() for t in threading.enumerate())


def in_group() -> bool:
    """Whether this process is one of several whose process group is still up: one that failed on its own."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def alone(status: int, err: BaseException | None = None) -> int:
    """End one process of several that failed on its own: the others may be waiting for it inside a step's collective,
    so the process group's teardown (a barrier), and the interpreter's exit with gloo's threads alive, would wait or
    abort; the process ends at once instead, and they learn of it at their next collective (``PeerLost``). Its line
    (``err``) goes to the launcher, which names the rank (detector.cli.launch), or to stderr with the rank's name."""
    if not in_group():
        return status
    if err is not None:
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        message = said(err) if isinstance(err, (UserError, OSError)) else last_line(err)
        folder = os.environ.get(FAILURES)
        if folder and Path(folder).is_dir():
            Path(folder, f"rank{rank}").write_text(message)
        else:
            print(f"error: rank {rank} of {world}: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def last_line(err: BaseException) -> str:
    """An exception's last line, as its traceback ends: ``RuntimeError: boom``."""
    return "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()[-1]


def tie_to_launcher() -> None:
    """A rank of detector.cli.launch ends with it: SIGTERM's stop (a checkpoint, then ``terminated``) when the launcher
    dies, even by kill -9, which leaves it no way to stop us (Linux's parent-death signal, LAUNCHER_LOST, which may
    come more than once: detector/train/run/interrupt.py; elsewhere torchrun's own)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, LAUNCHER_LOST)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.environ.get(LAUNCHER_PID) and os.getppid() != int(os.environ[LAUNCHER_PID]):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before the signal was set: it will not come


def run(command: str, args: argparse.Namespace) -> int:
    """Run ``command``; its exit status (0, or 1 where the scaling table has runs that failed)."""
    if command == "scaling":
        return scaling(args)
    if command == "compare":
        load_strategies()  # the registry's order of columns, with the interpreter switched on first
        from detector.board.events import write_compare_events
        from detector.lab.compare import run_compare

        comparison = run_compare(args.dir, args.runs or None, args.out)
        write_compare_events(comparison.out, comparison.texts, comparison.images)
        run = f"{comparison.out.parent.name}/{comparison.out.name}"
        print(f"TensorBoard (make tensorboard): run {run}, dashboards Text and Images; the Traces tab draws the steps")
    elif command == "curves":
        from detector.lab.curves import run_curves

        run_curves(args.runs)
    elif command == "tensorboard":
        from detector.board.launcher import check_port
        from detector.board.launcher import main as tensorboard

        check_port(args.port, args.host)
        tensorboard(args.logdir, args.port, args.host)
    elif command == "strategies":
        for s in load_strategies().values():
            print(s.name if args.names else f"{s.name:<18} {s.layout:<7} {s.description}")
    elif command == "export":
        from detector.train.evaluate.export import export

        path, read = export(Path(args.run), Path(args.out) if args.out else None)
        print(
            f"wrote {path} ({read}): torch.load(path, weights_only=True), then FaceDetector(**saved['arguments']) "
            "and load_state_dict(saved['state_dict']) (README: Using what a run trained)"
        )
    elif command == "predict":
        from detector.train.evaluate.predict import run_predict

        path, read = run_predict(Path(args.run), args.indices, args.images, args.faces, args.out)
        print(f"wrote {path} ({read})")
    elif command == "link":
        from detector.bench.link import run_link

        if args.out is None:
            raise UserError("python -m detector link: give --out=<file.json> for the times")
        run_link(args.overrides, Path(args.out))
    elif command == "ceiling":
        from detector.bench.ceiling import run_file

        run_file(args.overrides, Path(args.jobs), Path(args.out), args.seconds)
    elif command == "triton-host":
        from detector.bench.triton_host import run_diagnostic

        run_diagnostic()
    else:
        run_with_config(command, args)
    return 0


def scaling(args: argparse.Namespace) -> int:
    """``scaling run``: the runs and the document (exit status 1 where some of its runs failed); ``scaling FOLDER``:
    the table of the runs in it."""
    from detector.bench.sharding import run_table, show_table

    if args.overrides[:1] == ["run"]:
        work, out = (Path(path) if path else None for path in (args.work, args.out))
        return 1 if run_table(args.overrides[1:], work, out) else 0
    if args.work or args.out or len(args.overrides) > 1:
        raise UserError(
            "python -m detector scaling FOLDER takes no options and no key=value: they are run's "
            "(python -m detector scaling run [key=value ...])"
        )
    show_table(Path(args.overrides[0] if args.overrides else "runs/sharding"))
    return 0


def run_with_config(command: str, args: argparse.Namespace) -> None:
    from omegaconf import OmegaConf

    from detector.config.schema import load_config

    target = "losses"
    if command == "bench" and args.overrides and "=" not in args.overrides[0]:  # a target, not an override
        target = args.overrides.pop(0)
        if target not in BENCH_TARGETS:
            raise UserError(
                f"unknown bench target {target!r}: the targets are {', '.join(BENCH_TARGETS)} "
                "(python -m detector bench --help says what each measures)"
            )
    if command == "shapes" and args.overrides and "=" not in args.overrides[0]:  # a source, not an override
        args.overrides[0] = f"data.boxes={args.overrides[0]}"
    check_sections(command, args.overrides)
    strategies = load_strategies()
    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun, one announcement
    announce = None
    if main_process:  # `config > my.yaml` gets pure YAML: its announcement goes to stderr
        announce = (lambda line: print(line, file=sys.stderr)) if command == "config" else print
    from detector.train.observe.wallclock import early

    with early("configuration"):
        cfg = load_config(args.overrides, args.experiment, announce=announce, strategies=strategies)
    if command in ("train", "profile"):
        from detector.config.device import begin_context

        # the GPU's context is made in a thread while this process imports the run's code (the driver's work, which
        # leaves the interpreter free); the run waits for what is left of it before its first use of the device
        context = begin_context(cfg)
    if main_process:
        emulation_note(strategies, run_strategies(command, cfg, target, strategies))
    if command == "config":
        print(OmegaConf.to_yaml(cfg))
    elif command == "profile":
        profile(cfg)
    elif command == "train":
        if cfg.train.strategy == "all":
            from detector.lab.sweep import run_sweep

            run_sweep(cfg, args.experiment)
        else:
            from detector.train.run.folder import early_check

            # the checkpoint this command will likely continue is read and checked while the compiler is imported
            with early_check(cfg, args.experiment) as checks:
                from detector.train.run.entry import run_training

                rank = None
                if cfg.train.strategy == "auto":  # the library ranks nothing: make shapes' prediction ranks for it
                    from detector.lab.shapes import auto_ranking as rank
                run_training(cfg, args.experiment, checks, rank, context)
    elif command == "bench":
        from detector.bench import run as run_bench

        run_bench(cfg, target)
    elif command == "shapes":
        from detector.lab.shapes import run_shapes

        run_shapes(cfg)
    elif command == "report":
        from detector.lab.report import run_report

        sections = {name: set(spec[1] or ()) | set(TOP_LEVEL) for name, spec in COMMANDS.items()}
        run_report(cfg, args.overrides, sections)


def profile(cfg):
    """`make profile`: the run (detector/lab/profile.py), then its TensorBoard events, then where its time went;
    returns (folder, record)."""
    import time

    from detector.board.events import write_profile_events
    from detector.lab.profile import run_profile

    started = time.perf_counter()
    profiled = run_profile(cfg)
    events = time.perf_counter()
    write_profile_events(*profiled)
    ended = time.perf_counter()
    parts = f"{profiled.record.times.describe()}, TensorBoard events {ended - events:.1f} s"
    print(f"\nprofile {ended - started:.1f} s: {parts}")
    print(f"trace, summary.json and TensorBoard events in {profiled.run_dir}/")
    print("compare: make compare; view: make tensorboard")
    return profiled.run_dir, profiled.record


def load_strategies():
    """The strategies a name can pick (the registry's, the installed packages', and any ``my_module:my_loss``,
    imported when named), with the Triton interpreter switched on first where there is no GPU."""
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # before detector.kernels.triton_giou is imported: it reads the variable once
        os.environ["TRITON_INTERPRET"] = "1"
    from detector.losses import KnownStrategies

    return KnownStrategies()


def run_strategies(command: str, cfg, target: str, strategies) -> list[str]:
    """The strategies ``command`` runs with ``cfg`` (its loss, or every one)."""
    every = list(strategies)
    if command == "profile":
        return [cfg.profile.strategy]
    if command == "train":
        if cfg.train.strategy == "auto":
            return list(cfg.train.auto_candidates)
        return every if cfg.train.strategy == "all" else [cfg.train.strategy]
    if command == "bench":
        return {"losses": list(cfg.bench.strategies) or every, "layers": ["triton"]}.get(target, [])
    if command == "shapes":
        return list(cfg.bench.strategies)
    if command == "report":
        return list(cfg.report.strategies) or every
    return []


def emulation_note(strategies, names: list[str]) -> None:
    """One line on stderr for each strategy to run whose times here are an emulator's (triton without a GPU)."""
    import torch

    if torch.cuda.is_available():
        return
    for name in names:
        reason = strategies[name].emulated(torch.device("cpu")) if name in strategies else None
        if reason:
            print(f"note: {name}: {reason} here (no CUDA device: TRITON_INTERPRET=1)", file=sys.stderr)
