"""Command line: ``python -m detector <command> [options] [key=value ...]`` (the Makefile's targets call this).

Each command has its own parser (``python -m detector <command> --help``) that takes only the options
and the config sections it uses; anything else is refused. A user's mistake (an unknown command or
option, a bad config value, a missing file) is one line ``error: ...`` on stderr and exit status 2;
``--debug`` or ``DETECTOR_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from detector.bench import TARGETS as BENCH_TARGETS
from detector.errors import UserError

TOP_LEVEL = ("preset", "device", "autocast")  # config keys outside the sections

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
        "benchmark a target: losses (default), kernels, layers or step",
        {
            "bench": "strategies, batch sizes, distributions, repeats, output folder",
            "data": "slots, and the batch of the step target",
            "model": "the detector (step target)",
            "train": "the step's speed options (step target)",
        },
    ),
    "compare": ("compare the latest profile run of each strategy (or the runs named): tables, charts", None),
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
    "tensorboard": ("TensorBoard on runs/: Scalars, Text and Images of profile runs and comparisons", None),
    "strategies": ("list the registered loss strategies", None),
    "config": (
        "print the merged configuration",
        {"data": "", "model": "", "train": "", "profile": "", "bench": "", "report": ""},
    ),
}


class Parser(argparse.ArgumentParser):
    """argparse that raises UserError (printed as one line by main) instead of printing usage and exiting."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}")


def command_parser(command: str) -> Parser:
    summary, sections = COMMANDS[command]
    description = summary + "."
    if sections is None:
        description += "\n\nReads no configuration."
    else:
        lines = [f"  {name:<8} {why}".rstrip() for name, why in sections.items()]
        description += "\n\nConfig sections it reads (override with key=value):\n" + "\n".join(lines)
        description += f"\n  and the top-level keys {', '.join(TOP_LEVEL)}."
    parser = Parser(
        prog=f"python -m detector {command}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    if sections is not None:
        if command == "bench":
            targets = "|".join(BENCH_TARGETS)
            parser.usage = f"%(prog)s [-h] [--debug] [--experiment NAME] [{targets}] [key=value ...]"
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (OmegaConf dotlist)")
        parser.add_argument("--experiment", metavar="NAME", help="merge experiments/NAME.yaml (or a path) first")
    if command == "compare":
        parser.add_argument("runs", nargs="*", metavar="RUN", help="profile run folders (default: the latest of each)")
        parser.add_argument("--dir", default="runs/profile", help="folder of profile runs (default: runs/profile)")
        parser.add_argument("--out", help="output folder (default: a new runs/compare/<time>/)")
    elif command == "tensorboard":
        parser.add_argument("--logdir", default="runs", help="folder to serve (default: runs)")
        parser.add_argument("--port", type=int, default=6006, help="port (default: 6006)")
    elif command == "strategies":
        parser.add_argument("--names", action="store_true", help="names only, one per line")
    return parser


def top_parser() -> Parser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (summary, _) in COMMANDS.items())
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
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("DETECTOR_DEBUG", "") not in ("", "0") or "--debug" in argv
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))  # the command
    try:
        top = top_parser().parse_args(argv[: at + 1])
        # intermixed: `train --experiment NAME key=value` and `profile key=value --experiment NAME` alike
        args = command_parser(top.command).parse_intermixed_args(argv[at + 1 :])
        run(top.command, args)
    except (UserError, FileNotFoundError) as err:
        if debug:
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


def run(command: str, args: argparse.Namespace) -> None:
    if command == "compare":
        load_strategies()  # the registry's order of columns, with the interpreter switched on first
        from detector.compare import run_compare

        run_compare(args.dir, args.runs or None, args.out)
    elif command == "tensorboard":
        from detector.board import main as tensorboard

        tensorboard(args.logdir, args.port)
    elif command == "strategies":
        for s in load_strategies().values():
            print(s.name if args.names else f"{s.name:<18} {s.layout:<7} {s.description}")
    else:
        run_with_config(command, args)


def run_with_config(command: str, args: argparse.Namespace) -> None:
    from omegaconf import OmegaConf

    from detector.config import load_config

    target = "losses"
    if command == "bench" and args.overrides and args.overrides[0] in BENCH_TARGETS:
        target = args.overrides.pop(0)
    check_sections(command, args.overrides)
    strategies = load_strategies()
    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun, one announcement
    cfg = load_config(args.overrides, args.experiment, announce=print if main_process else None, strategies=strategies)
    if command == "config":
        print(OmegaConf.to_yaml(cfg))
    elif command == "profile":
        from detector.profiling import run_profile

        run_profile(cfg)
    elif command == "train":
        from detector.train.loop import run_training

        run_training(cfg, args.experiment)
    elif command == "bench":
        from detector.bench import run as run_bench

        run_bench(cfg, target)
    elif command == "report":
        from detector.report import run_report

        sections = {name: set(spec[1] or ()) | set(TOP_LEVEL) for name, spec in COMMANDS.items()}
        run_report(cfg, args.overrides, sections)


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
    """The strategy registry, imported with the Triton interpreter switched on where there is no GPU."""
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # before detector.kernels.triton_giou is imported: it reads the variable once
        os.environ["TRITON_INTERPRET"] = "1"
        if os.environ.get("RANK", "0") == "0":
            print("note: no CUDA device, Triton kernels run in the interpreter (TRITON_INTERPRET=1)", file=sys.stderr)
    from detector.losses import STRATEGIES

    return STRATEGIES
