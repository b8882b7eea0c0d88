"""Command line: ``python -m detector <command> [key=value ...]`` (the Makefile's targets call this).

Commands:
    profile [overrides]       profile training steps of one strategy into runs/profile/<strategy>/
    bench [overrides]         time every strategy's loss alone, forward and forward+backward
    train --experiment NAME   train with experiments/NAME.yaml into runs/train/NAME/ (torchrun: DDP)
    compare [--dir D]         table and bar chart of every runs/profile/*/summary.json
    tensorboard [--logdir D]  TensorBoard with the PyTorch Profiler plugin, patched for new traces
    strategies                list the registered strategies
    config [overrides]        print the merged configuration

Overrides are OmegaConf dotlists (``data.batch_size=256 profile.strategy=concat``); ``--experiment NAME``
merges ``experiments/NAME.yaml`` first.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m detector", description=__doc__.split("\n\n")[0])
    commands = ["profile", "bench", "train", "compare", "tensorboard", "strategies", "config"]
    parser.add_argument("command", choices=commands)
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. data.batch_size=256")
    parser.add_argument("--experiment", help="name of a YAML file in experiments/ (or a path)")
    parser.add_argument("--dir", default="runs/profile", help="compare: folder of profile runs")
    parser.add_argument("--png", help="compare: where to write the bar chart (default: <dir>/compare.png)")
    parser.add_argument("--logdir", default="runs", help="tensorboard: folder to serve")
    parser.add_argument("--port", type=int, default=6006, help="tensorboard: port")
    parser.add_argument("--names", action="store_true", help="strategies: names only, one per line")
    args = parser.parse_intermixed_args(argv)  # `train --experiment NAME key=value` (the Makefile's order)

    if args.command == "compare":
        from detector.compare import run_compare

        run_compare(args.dir, args.png)
        return 0
    if args.command == "tensorboard":
        from detector.board import main as tensorboard

        tensorboard(args.logdir, args.port)
        return 0
    if args.command == "strategies":
        from detector.losses import STRATEGIES

        for s in STRATEGIES.values():
            print(s.name if args.names else f"{s.name:<18} {s.layout:<7} {s.description}")
        return 0

    from omegaconf import OmegaConf

    from detector.config import load_config

    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun, one announcement
    cfg = load_config(args.overrides, args.experiment, announce=print if main_process else None)
    if args.command == "config":
        print(OmegaConf.to_yaml(cfg))
    elif args.command == "profile":
        from detector.profiling import run_profile

        run_profile(cfg)
    elif args.command == "bench":
        from detector.bench.losses import run_bench

        run_bench(cfg)
    elif args.command == "train":
        from detector.train.loop import run_training

        run_training(cfg, args.experiment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
