"""Command line: ``python -m detector <command> [options] [key=value ...]`` (the Makefile's targets call this).

The command line's grammar: the commands (``COMMANDS``: what each does, the config sections it reads), the
arguments each takes, and its parser (``python -m detector <command> --help``), which takes only the options and the
config sections the command uses: anything else is a ``UserError``, one line. Which code a command runs, and how its
process ends, is detector/cli/main.py's.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from detector.bench import TARGETS as BENCH_TARGETS
from detector.errors import UserError

TOP_LEVEL = ("preset", "device", "autocast")  # config keys outside the sections
# bench's targets, for its help and its errors (the same keys as detector.bench.TARGETS; a test checks it)
BENCH_HELP = {
    "losses": "every strategy's loss alone, forward and forward+backward (the default; CPU or GPU)",
    "kernels": "the custom kernels against their byte floors (GPU)",
    "layers": "where the triton strategy's time goes, layer by layer (GPU)",
    "blocks": "the fused conv blocks' kernels under each launch configuration and program count, and the step "
    "with the fastest (GPU)",
    "step": "the training step against the machine's floor, and the data pipeline's images/s",
    "startup": "what train pays before its work (start-up and first step, fresh processes, warm caches) against "
    "torch's floor: one step of the same configuration, torch alone",
    "memory": "each strategy's memory: profiles and their verdicts, the allocator under dynamic shapes with and "
    "without expandable segments, the largest batch that trains (GPU; the CPU's where it has one)",
}

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
            "bench": "train.strategy=auto's ranking (make shapes'): where bench losses' result is, else what it times",
        },
    ),
    "bench": (
        "benchmark a target: losses (default), kernels, layers, blocks, step, startup or memory",
        {
            "bench": "strategies, batch sizes, distributions, repeats, output folder",
            "data": "slots, and the batch of the step target",
            "model": "the detector (step and startup targets)",
            "train": "the step's speed options (step target); the run startup times",
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
    """argparse that raises UserError (printed as one line by detector.cli.main.main) instead of printing usage and
    exiting."""

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
        description=__doc__.split("\n\n")[0] + "\n\ncommands:\n" + listing,  # the module's first line
        epilog="`python -m detector <command> --help` describes a command and the config it reads.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("command", choices=list(COMMANDS), metavar="<command>")
    return parser


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
