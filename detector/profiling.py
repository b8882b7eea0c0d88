"""`make profile`: training (or forward) steps of the detector under torch.profiler, one trace per strategy.

Each step runs in named regions ("copy data", "forward", "calc loss", and in MODE=train "backward" and
"optimizer step"), each ended by a device synchronize so that its wall time is its own. The trace goes
to ``runs/profile/<strategy>/`` (``<strategy>-forward/`` in MODE=forward) for TensorBoard; the average
time per region per active step is printed and written to ``summary.json`` beside the trace.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.profiler import ProfilerActivity, record_function, schedule, tensorboard_trace_handler

from detector.bench.timing import synchronize
from detector.config import resolve_device
from detector.data import build_loader, to_device
from detector.losses import get_strategy
from detector.model import build_model

FORWARD_REGIONS = ("copy data", "forward", "calc loss")
TRAIN_REGIONS = FORWARD_REGIONS + ("backward", "optimizer step")
MODES = {"train": TRAIN_REGIONS, "forward": FORWARD_REGIONS}


class RegionTimer:
    """Named regions: a profiler label, a synchronize at the end, and the wall time of each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, list[float]] = {}
        self.recording = False

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        with record_function(name):
            yield
            synchronize(self.device)
        if self.recording:
            self.times.setdefault(name, []).append((time.perf_counter() - start) * 1e3)

    def averages(self) -> dict[str, float]:
        return {name: sum(t) / len(t) for name, t in self.times.items()}


def make_profiler(pcfg: DictConfig, out: Path, device: torch.device, worker_name: str):
    """torch.profiler on the ``pcfg`` schedule, writing one gzipped TensorBoard trace into ``out``."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return torch.profiler.profile(
        activities=activities,
        schedule=schedule(wait=pcfg.wait, warmup=pcfg.warmup, active=pcfg.active, repeat=1),
        # gzip: the loop strategy's GPU trace is ~750 MB as plain JSON; TensorBoard reads .gz directly
        on_trace_ready=tensorboard_trace_handler(str(out), worker_name=worker_name, use_gzip=True),
        profile_memory=pcfg.profile_memory,
        record_shapes=pcfg.record_shapes,
    )


def trace_dir(cfg: DictConfig) -> Path:
    name = cfg.profile.strategy if cfg.profile.mode == "train" else f"{cfg.profile.strategy}-forward"
    return Path(cfg.profile.out_dir) / name


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_profile(cfg: DictConfig) -> dict:
    pcfg = cfg.profile
    if pcfg.mode not in MODES:
        raise ValueError(f"profile.mode must be one of {', '.join(MODES)}, got {pcfg.mode!r}")
    device = resolve_device(cfg)
    strategy = get_strategy(pcfg.strategy)
    reason = strategy.unavailable(device)
    if reason:
        raise RuntimeError(f"strategy {strategy.name!r} cannot run on {device}: {reason}")
    train = pcfg.mode == "train"
    out = trace_dir(cfg)
    if out.exists():
        shutil.rmtree(out)  # a re-run must not mix its trace with older ones
    out.mkdir(parents=True)

    torch.manual_seed(cfg.data.seed)
    loader = build_loader(cfg.data, strategy.layout, device)
    model = build_model(cfg.model, cfg.data).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=pcfg.lr) if train else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(cfg.autocast))
    region = RegionTimer(device)
    first_active = pcfg.wait + pcfg.warmup
    steps = first_active + pcfg.active
    print(
        f"profiling {strategy.name} ({strategy.description}), mode={pcfg.mode}, device={device_name(device)}, "
        f"batch {cfg.data.batch_size} x {cfg.data.image_size}px, {cfg.data.max_boxes} slots, {steps} steps"
    )
    with make_profiler(pcfg, out, device, strategy.name) as prof:
        batches = iter(loader)
        for step in range(steps):
            region.recording = step >= first_active
            start = time.perf_counter()
            batch = next(batches)
            with region("copy data"):
                images, targets = to_device(batch, device)
            with region("forward"), autocast, torch.set_grad_enabled(train):
                pred = model(images)  # [B, M, 4] xyxy
            with region("calc loss"):
                loss = strategy(pred, targets)
            if train:
                with region("backward"):
                    loss.backward()
                with region("optimizer step"):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            prof.step()
            phase = "wait" if step < pcfg.wait else "warmup" if step < first_active else "active"
            print(
                f"  step {step + 1:3d}/{steps} [{phase:6s}] loss {loss.item():.4f}  "
                f"{(time.perf_counter() - start) * 1e3:9.1f} ms",
                flush=True,
            )
    del batches

    averages = region.averages()
    summary = {
        "strategy": strategy.name,
        "mode": pcfg.mode,
        "device": device_name(device),
        "torch": torch.__version__,
        "preset": cfg.preset,
        "batch_size": cfg.data.batch_size,
        "active_steps": pcfg.active,
        "regions_ms": {name: averages[name] for name in MODES[pcfg.mode]},
        "step_ms": sum(averages.values()),
        "traces": sorted(p.name for p in out.glob("*.pt.trace.json*")),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    print(f"trace and summary.json in {out}/ (view: make tensorboard)")
    return summary


def print_summary(summary: dict) -> None:
    print(f"\naverage per step over {summary['active_steps']} active steps ({summary['strategy']}, {summary['mode']})")
    print(f"  {'region':<16}{'ms':>12}")
    for name, ms in summary["regions_ms"].items():
        print(f"  {name:<16}{ms:12.3f}")
    print(f"  {'total':<16}{summary['step_ms']:12.3f}")
