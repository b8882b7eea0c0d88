"""The CUDA caching allocator's own figures of a step (``torch.cuda.memory_stats``), read on the host around it.

The allocator keeps its counters on the host, as it serves each allocation: reading them needs no synchronize, so a step
read this way runs as training runs it. `make profile` reads them around each profiled step, to hold the trace's memory
events against them and to count the retries no trace shows (detector/lab/measure/analysis.py ``allocator_checks``);
`bench memory` reads them around the steps it measures (detector/bench/memory.py). The CPU has no such counters: there
``StepMeter`` records nothing.

The keys, from torch.cuda.memory_stats' documentation:

- ``allocated_bytes.all.current`` / ``.peak``: bytes allocated to tensors now / at most since the last
  ``reset_peak_memory_stats``; ``reserved_bytes.all.current``: bytes the allocator holds from the device;
- ``allocation.all.allocated``: allocations served so far;
- ``num_device_alloc`` / ``num_device_free``: the allocator's cudaMalloc and (expandable segments) cuMemMap calls /
  cudaFree and cuMemUnmap calls; a torch without them counts segments, ``segment.all.allocated`` / ``.freed``;
- ``num_alloc_retries``: cudaMalloc calls that failed, after which it freed its cache and tried again.
"""

from __future__ import annotations

import torch

EXPANDABLE = "expandable_segments:True"  # PYTORCH_CUDA_ALLOC_CONF of the allocator that grows segments in place


def snapshot(stats: dict) -> dict[str, int]:
    """The figures the lab reads out of a ``torch.cuda.memory_stats`` dict."""
    return {
        "allocated": stats.get("allocated_bytes.all.current", 0),
        "peak": stats.get("allocated_bytes.all.peak", 0),
        "reserved": stats.get("reserved_bytes.all.current", 0),
        "allocations": stats.get("allocation.all.allocated", 0),
        "device_mallocs": stats.get("num_device_alloc", stats.get("segment.all.allocated", 0)),
        "device_frees": stats.get("num_device_free", stats.get("segment.all.freed", 0)),
        "retries": stats.get("num_alloc_retries", 0),
    }


def step_figures(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """One step's figures from the snapshots at its start (its peak reset there) and its end: the bytes live at its
    start, its peak, what it allocated and asked of the device, and what the allocator held reserved but unallocated
    at its end."""
    counted = ("allocations", "device_mallocs", "device_frees", "retries")
    return {
        "live": before["allocated"],
        "peak": after["peak"],
        **{key: after[key] - before[key] for key in counted},
        "reserved_free": after["reserved"] - after["allocated"],
    }


class StepMeter:
    """``start()`` before a step and ``stop(number)`` after it: ``steps[number]`` is its ``step_figures`` (on a
    GPU; on the CPU nothing is recorded)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.steps: dict[int, dict[str, int]] = {}
        self.before: dict[str, int] | None = None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = snapshot(torch.cuda.memory_stats(self.device))

    def stop(self, number: int) -> None:
        if self.cuda and self.before is not None:
            self.steps[number] = step_figures(self.before, snapshot(torch.cuda.memory_stats(self.device)))
