"""A training run's summary: summary.json (final loss and metrics, step times, images/s, the loss of every
step, where the wall clock went and the checkpoints' times) and the run's last line. detector/lab/record.py's
TrainingRecord is what the lab reads of it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from detector.config import device_name
from detector.train.folders import write_atomically
from detector.train.progress import TIMING_SKIP, throughput
from detector.train.wallclock import PARTS
from detector.train.wallclock import line as wall_line

if TYPE_CHECKING:
    from detector.train.loop import Run


def summary(run: Run) -> dict:
    steps, device = run.steps, run.device
    step, log, evals = steps.step, steps.log, steps.evaluation.evals
    return {
        "experiment": run.experiment,
        "run": run.run_dir.name,
        "strategy": run.step_fn.strategy.name,
        "device": device_name(device),
        "world_size": run.env.world_size,
        "global_batch": run.global_batch,
        "steps": step,
        "resumed_at": steps.resumed_at,
        "final_loss": log.window_mean(step, run.tcfg.log_every) if log.losses else math.nan,
        "eval": evals[-1][1] if evals else {},
        **throughput(log.timings, run.global_batch, skip_until=steps.resumed_at + TIMING_SKIP),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "history": log.history(run.tcfg.log_every, step),
        "losses": log.losses,  # every step's, read at log lines: per-step comparisons need no train.log_every=1
        "evals": evals,
        "checkpoint_step": steps.checkpoint_step,
        "eval_step": steps.evaluation.step,
        "wall_clock": wall_clock(run),
        "checkpoints": steps.checkpointer.record() if steps.checkpointer else None,
    }


def wall_clock(run: Run) -> dict:
    """Where this process's wall clock went (wallclock.py), its images/s over the whole run ("as lived"), and the
    same as TensorBoard scalars under goodput/."""
    steps = run.steps
    background = sum(s.written or 0.0 for s in steps.checkpointer.saves) if steps.checkpointer else 0.0
    record = run.wall.record(background)
    trained = (steps.step - steps.resumed_at) * run.global_batch
    record["images_per_s_lived"] = trained / record["total_s"] if record["total_s"] else None
    if steps.writer:
        steps.writer.add_scalar("goodput/share", record["goodput"] or 0.0, steps.step)
        for part in PARTS:
            steps.writer.add_scalar(f"goodput/{part.replace(' ', '_')}_s", record["seconds"][part], steps.step)
        steps.writer.flush()
    return record


def write(path: Path, summary: dict) -> None:
    write_atomically(path, json.dumps(summary, indent=2))


def read(path: Path) -> dict | None:
    """The summary.json at ``path``, or None: missing (killed before it), or written by a version without
    atomic writes."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def done_line(run_dir: Path, summary: dict, device: torch.device) -> str:
    """The run's last line: the final loss and the throughput (on a GPU, the device's beside the wall clock's)."""
    line = (
        f"done: {run_dir}  final loss {summary['final_loss']:.4f}  median step {summary['step_ms']:.1f} ms  "
        f"{summary['images_per_s']:.0f} img/s by the wall clock"
    )
    if device.type == "cuda":
        line += (
            f" ({summary['device_images_per_s']:.0f} by device time; device idle between steps "
            f"{summary['device_idle_ms']:.1f} ms)"
        )
    if summary.get("wall_clock"):
        line += f"\n      {wall_line(summary['wall_clock'])}"
    return line
