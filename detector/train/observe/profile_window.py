"""The torch.profiler window of `make profile` and of `make train` with train.profile=true.

Both commands record the same step (detector/train/run/step.py) on the same schedule; this module sits below
both, so that training needs nothing of the profile command.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler


def make_profiler(pcfg: DictConfig, out: Path, device: torch.device, worker_name: str):
    """torch.profiler on the ``pcfg`` schedule, writing one gzipped trace into ``out``."""
    # Kineto's own log lines (USDT profiler_start/stop, stage notes) would mix into our progress lines; it
    # reads this when the first profiler starts, and a user who set it keeps theirs
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return torch.profiler.profile(
        activities=activities,
        schedule=schedule(wait=pcfg.wait, warmup=pcfg.warmup, active=pcfg.active, repeat=1),
        # gzip: the loop strategy's GPU trace is ~750 MB as plain JSON; readers take .gz directly
        on_trace_ready=tensorboard_trace_handler(str(out), worker_name=worker_name, use_gzip=True),
        profile_memory=pcfg.profile_memory,
        record_shapes=pcfg.record_shapes,
    )
