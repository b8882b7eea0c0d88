"""``python -m detector bench <target> [overrides]``: one benchmark command, a target each (``TARGETS``).

- ``losses``: every registered strategy's loss alone, forward and forward+backward (CPU or GPU)
- ``kernels``: the custom kernels: host floors, headline times, byte floors, packed scaling, skipping (GPU)
- ``layers``: where the triton strategy's time goes, layer by layer and kernel by kernel (GPU)
- ``blocks``: the fused conv blocks' Triton kernels under each launch configuration (GPU)
- ``step``: the training step, its speed options and its pieces against the machine's floor, and the
  data pipeline's images/s
- ``startup``: what `train` pays before its work (its start-up and first step), against torch's floor, each a fresh
  process
- ``memory``: each strategy's memory: profiles with the memory measures and their comparison, the caching
  allocator under dynamic shapes with and without expandable segments, and the largest batch that trains
  (detector/bench/memory.py, which writes a folder of its own)

Each target prints medians with their interquartile range and writes ``<dir of bench.out>/<target>.json``
(detector/lab/record/bench.py ``BenchResult``) with the device, the torch version and the ``bench`` configuration,
and ``<target>.md`` with the tables it printed (`make report` includes them). Targets are imported when run, so that
importing this package loads neither triton nor the extension. Their timing and their random cases are the lab's
(detector/lab/measure/timing.py, cases.py), which the shape report times with too.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from detector.errors import UserError

if TYPE_CHECKING:  # torch, the configuration and the records are imported when a bench runs: the command line's
    # grammar reads TARGETS, and `--help` imports nothing heavier than this module
    import torch
    from omegaconf import DictConfig

TARGETS = {
    "losses": "detector.bench.losses",
    "kernels": "detector.bench.kernels",
    "layers": "detector.bench.layers",
    "step": "detector.bench.step",
    "blocks": "detector.bench.blocks",
    "memory": "detector.bench.memory",
    "startup": "detector.bench.startup",
}


class UnknownTargetError(UserError, ValueError):
    """A bench target that does not exist."""


def save(cfg: DictConfig, target: str, device, results, markdown: str) -> Path:
    """Print ``markdown`` (the target's tables); write ``results``, the device, torch and the ``bench`` config
    to ``<dir of bench.out>/<target>.json`` and the tables to ``<target>.md`` beside it."""
    from omegaconf import OmegaConf

    from detector.lab.record.bench import BenchResult
    from detector.lab.record.provenance import run_info

    print(markdown)
    path = Path(cfg.bench.out).parent / f"{target}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    BenchResult(target=target, config=OmegaConf.to_container(cfg.bench), results=results, **run_info(device)).write(
        path
    )
    path.with_suffix(".md").write_text(markdown + "\n")
    print(f"results: {path} and {path.with_suffix('.md').name}")
    return path


def run(cfg: DictConfig, target: str = "losses") -> list | dict | None:
    """Run one bench target on ``cfg`` (the merged Config): the results it wrote, or None where it cannot
    run here (a GPU-only target on the CPU says so in one line)."""
    if target not in TARGETS:
        raise UnknownTargetError(f"unknown bench target {target!r}; valid targets: {', '.join(TARGETS)}")
    return importlib.import_module(TARGETS[target]).run_bench(cfg)


def gpu_device(cfg: DictConfig, target: str, unavailable) -> torch.device | None:
    """The CUDA device of a GPU-only target, or None after one line saying why it cannot run here;
    ``unavailable(device)`` is the kernels' own reason (e.g. the extension is not built)."""
    from detector.config.device import resolve_device

    device = resolve_device(cfg)
    if device.type != "cuda":
        print(f"bench {target}: needs a CUDA device, and this run is on {device.type} (nothing to do)")
        return None
    reason = unavailable(device)
    if reason:
        raise UserError(f"bench {target}: {reason}")
    return device
