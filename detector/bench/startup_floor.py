"""The floor of ``bench startup`` (detector/bench/startup.py), in a process of its own: the least that runs one training
step of a configuration, each part timed. ``python -m detector.bench.startup_floor CONFIG.yaml`` prints the parts'
seconds as one JSON line. Nothing is imported before ``import torch`` is timed: the first part runs from the process's
start (the interpreter's own start-up included, as a command's is).
"""

from __future__ import annotations

import json
import sys
import time

PARTS = ("import torch", "import the step's code", "build the step", "load the compile cache", "first step")


def floor(config: str) -> dict[str, float]:
    from detector.train.observe.wallclock import process_age  # the standard library's alone

    parts = {}
    import torch  # noqa: F401  the first part: the interpreter and torch, timed from the process's start

    parts["import torch"] = process_age()
    start = time.perf_counter()
    from omegaconf import OmegaConf

    from detector.bench.step import device_batch
    from detector.config.device import resolve_device
    from detector.losses import get_strategy
    from detector.train.run.speed_options import compile_cache_file, load_compile_cache
    from detector.train.run.step import TrainStep

    parts["import the step's code"] = time.perf_counter() - start
    cfg = OmegaConf.load(config)
    start = time.perf_counter()
    device = resolve_device(cfg)
    step = TrainStep(cfg, device)
    batch = device_batch(cfg, get_strategy(cfg.train.strategy).layout, device)
    parts["build the step"] = time.perf_counter() - start
    start = time.perf_counter()
    load_compile_cache(compile_cache_file(cfg, device, 1))
    parts["load the compile cache"] = time.perf_counter() - start
    start = time.perf_counter()
    step(batch).item()  # the host waits for the device: the step is done
    parts["first step"] = time.perf_counter() - start
    parts["total"] = sum(parts.values())
    return parts


if __name__ == "__main__":
    print(json.dumps(floor(sys.argv[1])))
