"""`train.strategy=all` (experiments/strategy_sweep.yaml): one run per strategy, same seed and data,
then a table and the loss curves side by side."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from detector.checked import write_atomically
from detector.lab.present.tables import markdown_table
from detector.losses import STRATEGIES
from detector.train.observe.summary import TrainingSummary
from detector.train.run.entry import train, training_processes
from detector.train.run.folder import experiment_name
from detector.train.run.step import speed_option_refusal


def sweep_table(summaries: list[TrainingSummary], skipped: dict[str, str]) -> str:
    """A markdown table of a sweep; loss gap = largest |loss difference| from the first run's curve."""
    reference = dict(summaries[0].history) if summaries else {}
    headers = [
        "strategy",
        "final loss",
        "max loss gap",
        "eval mIoU",
        "mean-box mIoU",
        "step ms",
        "device idle ms",
        "host data wait ms",
    ]
    headers += ["images/s (wall)", "images/s (device)"]
    rows = []
    for s in summaries:
        gap = max((abs(loss - reference[k]) for k, loss in s.history if k in reference), default=math.nan)
        metrics = s.eval
        rows.append(
            [s.run, f"{s.final_loss:.4f}", f"{gap:.1e}", f"{metrics.get('mean_iou', math.nan):.3f}"]
            + [
                f"{metrics.get('trivial_mean_iou', math.nan):.3f}",
                f"{s.step_ms:.1f}",
                f"{s.device_idle_ms:.1f}",
                f"{s.data_wait_ms:.1f}",
            ]
            + [f"{s.images_per_s:.0f}", f"{s.device_images_per_s:.0f}"]
        )
    rows += [[name, f"skipped: {reason}"] + [""] * (len(headers) - 2) for name, reason in skipped.items()]
    return markdown_table(headers, rows)


def plot_losses(summaries: list[TrainingSummary], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for s in summaries:
        ax.plot([k for k, _ in s.history], [loss for _, loss in s.history], label=s.run, linewidth=1)
    ax.set(xlabel="step", ylabel="GIoU loss", title="training loss per strategy (same seed and data)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_sweep(cfg: DictConfig, experiment: str | None = None) -> list[TrainingSummary]:
    """One training run per registered strategy that can run here, the same seed and data for each; the others
    are listed with the reason. Returns the runs' summaries."""
    experiment = experiment_name(experiment)
    summaries, skipped = [], {}
    with training_processes(cfg) as (env, device):
        for name, strategy in STRATEGIES.items():
            reason = strategy.unavailable(device) or speed_option_refusal(strategy, cfg.train, env.world_size, device)
            if reason:
                skipped[name] = reason
                continue
            summaries.append(train(OmegaConf.merge(cfg, {"train": {"strategy": name}}), experiment, env, device))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next run starts from the same free memory
        if env.is_main:
            write_sweep(Path(cfg.train.out_dir) / experiment, summaries, skipped)
    return summaries


def write_sweep(out: Path, summaries: list[TrainingSummary], skipped: dict[str, str]) -> None:
    """sweep.md, sweep.json (``{"runs": [summary.json's record of each run], "skipped": {name: reason}}``, written
    whole or not at all) and loss_curves.png in ``out``, and the table printed."""
    table = sweep_table(summaries, skipped)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text(table + "\n")
    runs = [s.to_json() for s in summaries]
    write_atomically(out / "sweep.json", json.dumps({"runs": runs, "skipped": skipped}, indent=2).encode())
    if summaries:
        plot_losses(summaries, out / "loss_curves.png")
    print(f"\n{table}\n\ntable, summaries and loss_curves.png in {out}/")
