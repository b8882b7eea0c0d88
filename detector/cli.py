"""Command line: ``python -m detector <command> [options] [key=value ...]`` (the Makefile's targets call this).

Each command has its own parser (``python -m detector <command> --help``) that takes only the options
and the config sections it uses; anything else is refused. A user's mistake (an unknown command or
option, a bad config value, a missing file) is one line ``error: ...`` on stderr and exit status 2;
``--debug`` or ``DETECTOR_DEBUG=1`` shows the traceback instead. Ctrl-C is one line ``interrupted`` (with
what was kept, where a command knows) and exit status 130, the shell's for SIGINT; SIGTERM, which schedulers
send before they kill, is handled the same way: one line ``terminated``, exit status 143. Nothing is printed
after that line, however many signals follow (detector/train/interrupt.py).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from detector.bench import TARGETS as BENCH_TARGETS
from detector.errors import UserError, refuse
from detector.train.distributed import FAILURES, LAUNCHED, LAUNCHER_PID, STOP_STATUS, PeerLost
from detector.train.interrupt import LAUNCHER_LOST, CommandSignals, Handlers, Terminated

TOP_LEVEL = ("preset", "device", "autocast")  # config keys outside the sections
# bench's targets, for its help and its errors (the same keys as detector.bench.TARGETS; a test checks it)
BENCH_HELP = {
    "losses": "every strategy's loss alone, forward and forward+backward (the default; CPU or GPU)",
    "kernels": "the custom kernels against their byte floors (GPU)",
    "layers": "where the triton strategy's time goes, layer by layer (GPU)",
    "blocks": "the fused conv blocks' kernels under each launch configuration and program count, and the step "
    "with the fastest (GPU)",
    "step": "the training step against the machine's floor, and the data pipeline's images/s",
    "memory": "each strategy's memory: profiles and their verdicts, the allocator under dynamic shapes with and "
    "without expandable segments, the largest batch that trains (GPU; the CPU's where it has one)",
}
# errors of the machine's files rather than of the code: a command ends on them in one line naming the file (a folder
# not writable, a full disk, a file where a folder was asked for: train.out_dir=notes.txt)
ENVIRONMENT = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST)
INTERRUPTED = 130  # the shell's exit status for a program stopped by SIGINT (Ctrl-C)
TERMINATED = 143  # and by SIGTERM (128 + 15)

# command: (one-line help, the config sections it reads and why, or None when it reads no config)
COMMANDS = {
    "profile": (
        "profile the training step with one strategy into a new runs/profile/<strategy>/<time>/",
        {
            "data": "the synthetic batches",
            "model": "the detector",
            "train": "the optimizer and speed options of the step being profiled",
            "profile": "strategy, mode, the profiler schedule and output folder",
        },
    ),
    "train": (
        "train with experiments/NAME.yaml into runs/train/NAME/ (under torchrun: DDP)",
        {
            "data": "the synthetic batches",
            "model": "the detector",
            "train": "strategy, steps, optimizer, evaluation, checkpoints, speed options",
            "profile": "the profiler schedule, only with train.profile=true",
        },
    ),
    "bench": (
        "benchmark a target: losses (default), kernels, layers, blocks or step",
        {
            "bench": "strategies, batch sizes, distributions, repeats, output folder",
            "data": "slots, and the batch of the step target",
            "model": "the detector (step target)",
            "train": "the step's speed options (step target)",
        },
    ),
    "compare": ("compare the latest profile run of each strategy (or the runs named): tables, charts", None),
    "curves": ("training runs' loss curves side by side: the first the baseline, the last of 3+ the noise", None),
    "report": (
        "run the lab's standard set here (profiles, compare, training, benches) into docs/results/<device>.md",
        {
            "report": "where it writes, which strategies it profiles and trains",
            "data": "passed to the profiles, training and benches",
            "model": "passed to the profiles, training and benches",
            "train": "passed to the profiles, training and benches",
            "profile": "passed to the profiles",
            "bench": "passed to the benches",
        },
    ),
    "shapes": (
        "the shape of a dataset's targets (SOURCE: synthetic, coco:FILE or widerface:FILE; default data.boxes): the "
        "box-count histogram, the padding at the slots, the images over them, the strategy predicted fastest",
        {
            "data": "the boxes (data.boxes), the slots and what to do with images over them, the batch",
            "bench": "where bench losses' result is (bench.out), the strategies timed where it is not",
            "profile": "where the profiles over this source are (profile.out_dir), which check the prediction",
        },
    ),
    "scaling": (
        "the scaling table: each train.shard_optimizer on 2, 4 ... processes against one (run), or the table of the "
        "runs in FOLDER (default runs/sharding)",
        {
            "report": "how many processes, which modes, the steps of each run, the work and output folders",
            "data": "passed to the training runs and the link",
            "model": "passed to the training runs and the link",
            "train": "passed to the training runs and the link",
        },
    ),
    "link": (
        "the link alone, under torchrun: each collective the ways of sharing send, timed by itself into --out",
        {
            "bench": "warmup and repeats",
            "data": "the image size (the head's shape)",
            "model": "the head's shape",
        },
    ),
    "ceiling": (
        "bench memory's child process: the allocator and the largest batch that trains, for the jobs in --jobs",
        {"data": "the batches", "model": "the detector", "train": "the training step"},
    ),
    "triton-host": ("where the eager time of the triton strategy goes, on a GPU: printed, nothing written", None),
    "tensorboard": ("TensorBoard on runs/: Scalars, Text and Images of profile runs and comparisons", None),
    "export": ("the model a run trained, as FaceDetector's state_dict in one file torch.load reads", None),
    "predict": ("a picture of the predicted boxes of a run (or an export) on images by index or of files", None),
    "strategies": ("list the registered loss strategies", None),
    "config": (
        "print the merged configuration",
        {"data": "", "model": "", "train": "", "profile": "", "bench": "", "report": ""},
    ),
}
HIDDEN = ("ceiling",)  # another command's child process (bench memory's): left out of the list of commands
# commands that load their configuration from their key=value themselves (a bench's, passed on to its children):
# no --experiment, and no check of the sections (make report passes the scaling table all of its overrides)
OWN_CONFIG = ("scaling", "link", "ceiling")


class Parser(argparse.ArgumentParser):
    """argparse that raises UserError (printed as one line by main) instead of printing usage and exiting."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}")


def port_number(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return port


def output_file(text: str) -> str:
    """export's and predict's --out: a file in a folder that exists or can be made (a folder: the file in it); its
    first existing folder must be one, and writable."""
    path = Path(text)
    for folder in (path, *path.parents) if path.is_dir() else path.parents:  # an existing file is replaced
        if folder.exists():
            if not folder.is_dir():
                raise argparse.ArgumentTypeError(f"{text!r}: {folder} is a file, not a folder")
            if not os.access(folder, os.W_OK):
                raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder} is not writable here")
            break
    return text


def option(*names: str, **settings) -> tuple[tuple[str, ...], dict]:
    """One argument of a command, as argparse's add_argument takes it."""
    return names, settings


# each command's own arguments, beside --debug and, where it reads a configuration, key=value and --experiment
ARGUMENTS = {
    "compare": (
        option("runs", nargs="*", metavar="RUN", help="profile run folders (default: the latest of each)"),
        option("--dir", default="runs/profile", help="folder of profile runs (default: runs/profile)"),
        option("--out", help="output folder (default: a new runs/compare/<time>/)"),
    ),
    "curves": (option("runs", nargs="+", metavar="RUN", help="training run folders: runs/train/<experiment>/<run>"),),
    "tensorboard": (
        option("--logdir", default="runs", help="folder to serve (default: runs)"),
        option("--port", type=port_number, default=6006, help="port (default: 6006)"),
        option(
            "--host",
            default="127.0.0.1",
            help="the interface to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 serves the runs' "
            "traces, tables and configurations to the network)",
        ),
    ),
    "strategies": (option("--names", action="store_true", help="names only, one per line"),),
    "scaling": (
        option("--work", metavar="FOLDER", help="run: the runs' folder (default: <report.work_dir>/<device>/scaling)"),
        option("--out", metavar="FILE", help="run: the document (default: <report.out_dir>/<device>-x<N>.md)"),
    ),
    "link": (option("--out", metavar="FILE.json", help="the times, written by rank 0"),),
    "ceiling": (
        option("--out", required=True, help="the results, written after each job"),
        option("--jobs", required=True, help="the jobs: a JSON list of [source, strategy, part]"),
        option("--seconds", type=float, default=math.inf, help="the time the jobs share"),
    ),
    "export": (
        option("run", metavar="RUN", help="a training run folder: runs/train/<experiment>/<run>"),
        option("--out", type=output_file, help="the file, or a folder for model.pt (default: <run>/export/model.pt)"),
    ),
    "predict": (
        option("run", metavar="RUN", help="a training run folder, or an export of one (model.pt)"),
        option(
            "indices",
            nargs="*",
            type=int,
            metavar="INDEX",
            help="samples of the run's data by index, with their true boxes",
        ),
        option("--images", nargs="+", default=[], metavar="FILE", help="image files (PNG, JPEG) of your own"),
        option(
            "--faces",
            type=int,
            default=1,
            help="how many boxes to draw on an image file (the model predicts one a face and no score; default 1)",
        ),
        option("--out", type=output_file, help="the picture, or a folder for it (default: <run>/predictions.png)"),
    ),
}
# the usage of a command whose first key=value may be a word of its own
USAGE = {
    "bench": f"%(prog)s [-h] [--debug] [--experiment NAME] [{'|'.join(BENCH_TARGETS)}] [key=value ...]",
    "shapes": "%(prog)s [-h] [--debug] [--experiment NAME] [SOURCE] [key=value ...]",
    "scaling": "%(prog)s [-h] [--debug] [--work FOLDER] [--out FILE] [run|FOLDER] [key=value ...]",
}


def command_parser(command: str) -> Parser:
    summary, sections = COMMANDS[command]
    description = summary + "." + ("\n\nReads no configuration." if sections is None else "")
    if command == "bench":
        width = max(map(len, BENCH_HELP))
        description += "\n\nTargets:\n" + "\n".join(f"  {name:<{width}}  {why}" for name, why in BENCH_HELP.items())
    if sections is not None:
        lines = [f"  {name:<8} {why}".rstrip() for name, why in sections.items()]
        description += "\n\nConfig sections it reads (override with key=value):\n" + "\n".join(lines)
        description += f"\n  and the top-level keys {', '.join(TOP_LEVEL)}."
    parser = Parser(
        prog=f"python -m detector {command}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=USAGE.get(command),
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    if sections is not None:
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (OmegaConf dotlist)")
        if command not in OWN_CONFIG:
            parser.add_argument("--experiment", metavar="NAME", help="merge experiments/NAME.yaml (or a path) first")
    for names, settings in ARGUMENTS.get(command, ()):
        parser.add_argument(*names, **settings)
    return parser


def top_parser() -> Parser:
    shown = {name: summary for name, (summary, _) in COMMANDS.items() if name not in HIDDEN}
    width = max(map(len, shown))
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, summary in shown.items())
    parser = Parser(
        prog="python -m detector",
        description=__doc__.split("\n\n")[0] + "\n\ncommands:\n" + listing,
        epilog="`python -m detector <command> --help` describes a command and the config it reads.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("command", choices=list(COMMANDS), metavar="<command>")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line's entry; ``argv`` given (a test, a script): the signal handlers are restored after it."""
    command_line = argv is None  # then the interpreter exits after us: the handlers stay, ignoring late signals
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("DETECTOR_DEBUG", "") not in ("", "0") or "--debug" in argv
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))  # the command
    with CommandSignals(keep=command_line):
        if os.environ.get(LAUNCHED):
            tie_to_launcher()  # once the handlers are in place: LAUNCHER_LOST's default action is death
        try:
            top = top_parser().parse_args(argv[: at + 1])
            # intermixed: `train --experiment NAME key=value` and `profile key=value --experiment NAME` alike
            args = command_parser(top.command).parse_intermixed_args(argv[at + 1 :])
            status = run(top.command, args)
        except PeerLost as err:  # under detector.launch, the launcher names the process that stopped
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
    """Whether a checkpoint's writer thread is still at work (train/checkpointer.py): a save a stop abandoned."""
    return any(t.name == "checkpoint-writer" and t.is_alive() for t in threading.enumerate())


def in_group() -> bool:
    """Whether this process is one of several whose process group is still up: one that failed on its own."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def alone(status: int, err: BaseException | None = None) -> int:
    """End one process of several that failed on its own: the others may be waiting for it inside a step's collective,
    so the process group's teardown (a barrier), and the interpreter's exit with gloo's threads alive, would wait or
    abort; the process ends at once instead, and they learn of it at their next collective (``PeerLost``). Its line
    (``err``) goes to the launcher, which names the rank (detector.launch), or to stderr with the rank's name."""
    if not in_group():
        return status
    if err is not None:
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        message = " ".join(str(err).split()) if isinstance(err, (UserError, OSError)) else last_line(err)
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
    """A rank of detector.launch ends with it: SIGTERM's stop (a checkpoint, then ``terminated``) when the launcher
    dies, even by kill -9, which leaves it no way to stop us (Linux's parent-death signal, LAUNCHER_LOST, which may
    come more than once: detector/train/interrupt.py; elsewhere torchrun's own)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, LAUNCHER_LOST)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.environ.get(LAUNCHER_PID) and os.getppid() != int(os.environ[LAUNCHER_PID]):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before the signal was set: it will not come


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Refuse a port another program listens on, before TensorBoard announces its address and then fails."""
    problem = port_problem(port, host)
    if problem == errno.EADDRINUSE:
        free = next((p for p in range(port + 1, min(port + 100, 65536)) if port_problem(p, host) is None), None)
        example = f', e.g. make tensorboard ARGS="--port {free}"' if free else ""
        raise UserError(f"port {port} is already in use (another TensorBoard?): choose another with --port{example}")
    if problem is not None:
        why = os.strerror(problem) if problem > 0 else "no such interface on this machine"
        raise UserError(f"{host}:{port} cannot be opened ({why}): choose another --host or --port")


def port_problem(port: int, host: str = "127.0.0.1") -> int | None:
    """The errno of binding ``host:port`` as TensorBoard will, or None if it is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as err:
            return err.errno
    return None


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
        from detector.board.launcher import main as tensorboard

        check_port(args.port, args.host)
        tensorboard(args.logdir, args.port, args.host)
    elif command == "strategies":
        for s in load_strategies().values():
            print(s.name if args.names else f"{s.name:<18} {s.layout:<7} {s.description}")
    elif command == "export":
        from detector.train.export import export

        path = export(Path(args.run), Path(args.out) if args.out else None)
        print(
            f"wrote {path}: torch.load(path, weights_only=True), then FaceDetector(**saved['arguments']) and "
            "load_state_dict(saved['state_dict']) (README: Using what a run trained)"
        )
    elif command == "predict":
        from detector.train.predict import run_predict

        print(f"wrote {run_predict(Path(args.run), args.indices, args.images, args.faces, args.out)}")
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

    from detector.config import load_config

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
    cfg = load_config(args.overrides, args.experiment, announce=announce, strategies=strategies)
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
            from detector.train.run_folder import early_check

            # the checkpoint this command will likely continue is read and checked while the compiler is imported
            with early_check(cfg, args.experiment) as checks:
                from detector.train.entry import run_training

                run_training(cfg, args.experiment, checks)
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
    """`make profile`: the run (detector/lab/profile.py), then its TensorBoard events; returns (folder, record)."""
    from detector.board.events import write_profile_events
    from detector.lab.profile import run_profile

    profiled = run_profile(cfg)
    write_profile_events(*profiled)
    print(f"\ntrace, summary.json and TensorBoard events in {profiled.run_dir}/")
    print("compare: make compare; view: make tensorboard")
    return profiled.run_dir, profiled.record


def check_sections(command: str, overrides: list[str]) -> None:
    """Refuse an override of a config section that ``command`` does not read (it would be ignored)."""
    sections = COMMANDS[command][1]
    for item in overrides:
        key = item.partition("=")[0].split(".")[0]
        if key and key not in sections and key not in TOP_LEVEL:
            raise UserError(
                f"python -m detector {command} does not read {item!r}: its config sections are "
                f"{', '.join(sections)} (and {', '.join(TOP_LEVEL)})"
            )


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
