"""The lab's charts (PNG, matplotlib without pyplot): where a step's time goes, run beside run, and the counts
that explain it. Timelines of steps are detector/lab/present/timeline.py.

- ``draw_stacked``: per strategy the median step as a bar stacked by region, and on a GPU the GPU time each region
  launched beside the host's wall time, the one that is the regions' cost first (the device's where it paced the
  step); the label on a bar is the bar's own length (the sum of its
  parts), so a label always equals what the bar shows. The axis ends at 4× the median bar: a longer bar is
  cut with its length written upright.
- ``draw_counts``: per count measure, the median per region and strategy on a log axis; a region in which a
  count is 0 in every run is not drawn.
- ``draw_regions``: one run's regions, the median of its leading time (GPU ms where the device paced the step, else
  wall ms) with its quartiles, and the other beside it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from detector.lab.present.tables import significant
from detector.lab.present.timeline import CLIP, REGION_COLORS
from detector.lab.present.verdicts import device_leads
from detector.lab.record.measures import COUNTS, MEASURES, format_value, present, present_regions
from detector.lab.record.run import ProfileRecord, representative_step
from detector.regions import REGIONS, STEP


def median_step_parts(record: ProfileRecord, measure: str) -> dict[str, float]:
    """{region: ``measure``} of the run's median step (by wall time), the step itself left out: parts that add
    up to that step."""
    step = representative_step(record.per_step)
    return {r: v.get(measure) or 0.0 for r, v in step.regions.items() if r != STEP}


def draw_stacked(runs: list[tuple[str, ProfileRecord]], title: str, path: Path) -> Path:
    """Per strategy the median step as a bar stacked by region: on a GPU the GPU time each region launched and the
    host's wall time beside it. The left bar is the one that is each region's cost (``device_leads``: the device's
    where it paced every GPU run's step, else the host's); the other is hatched and paler."""
    records = [r for _, r in runs]
    gpu = any(r.analysis.gpu for r in records)
    kinds = (["gpu_ms", "wall_ms"] if device_leads(records) else ["wall_ms", "gpu_ms"]) if gpu else ["wall_ms"]
    parts = {(i, kind): median_step_parts(r, kind) for i, r in enumerate(records) for kind in kinds}
    regions = [r for r in REGIONS if any(r in p and p[r] for p in parts.values())]
    # about half an inch a bar: 13 strategies' pairs stay readable at a page's width
    fig = Figure(figsize=(max(7.0, 3.5 + 0.55 * len(runs) * len(kinds)), 5.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(kinds)
    totals = sorted(sum(p.values()) for p in parts.values())
    top = min(totals[-1], CLIP * totals[(len(totals) - 1) // 2]) * 1.12 or 1  # a 100x slower step stays readable
    for k, kind in enumerate(kinds):
        xs = np.arange(len(runs)) + (k - (len(kinds) - 1) / 2) * width
        bottom = np.zeros(len(runs))
        for region in regions:
            heights = np.array([parts[(i, kind)].get(region, 0.0) for i in range(len(runs))])
            ax.bar(
                xs,
                heights,
                width * 0.9,
                bottom=bottom,
                color=REGION_COLORS[region],
                alpha=1.0 if k == 0 else 0.55,
                label=region if k == 0 else None,
                hatch="//" if k else None,
                edgecolor="white",
                linewidth=0.3,
            )
            bottom += heights
        for x, height in zip(xs, bottom, strict=True):
            _label_bar(ax, x, height, top)
    labels = [label + (" *" if r.emulated else "") for label, r in runs]
    ax.set_xticks(np.arange(len(runs)), labels, rotation=20 if len(runs) > 5 else 0)
    ax.set_ylim(0, top)
    pair = {
        ("gpu_ms", "wall_ms"): "left: the GPU time each region launched, its cost (the device paced the step)\n"
        "right, hatched: the host's time to launch it, its waits for room in the launch queue included",
        ("wall_ms", "gpu_ms"): "left: the host's wall time, each region's cost (the host paced the step)\n"
        "right, hatched: the GPU time each region launched",
    }.get(tuple(kinds))
    ax.set_ylabel("ms in the median step, by region", fontsize=9)
    if pair:
        ax.set_xlabel(pair, fontsize=8)
    emulated = " (* its kernels emulated here)" if any(r.emulated for r in records) else ""
    ax.set_title(textwrap.fill(f"{title}{emulated}", 25 + 12 * len(runs) * len(kinds)), fontsize=10)  # the bars' width
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.savefig(path, dpi=100)
    return path


def _label_bar(ax, x: float, height: float, top: float) -> None:
    """The bar's length above it, or written upright inside its top where the axis cuts it."""
    total = f"{height:,.0f}" if height >= 1000 else significant(height)
    cut = height > top
    ax.text(
        x,
        min(height, top),
        f"{total} ↑ cut " if cut else total,
        ha="center",
        va="top" if cut else "bottom",
        rotation=90 if cut else 0,
        fontsize=7,
        fontweight="bold" if cut else None,
        bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1} if cut else None,
    )


def draw_counts(runs: list[tuple[str, ProfileRecord]], title: str, path: Path) -> Path | None:
    """The counts of detector/lab/record/measures.py COUNTS that some run has, per region (groups) and strategy (bars),
    log scale (1 against 10⁵); each count only in the regions where some run has it; None when every count is
    0."""
    records = [r for _, r in runs]
    names = [n for n in present(records, COUNTS) if n != "wall_ms"]
    if not names:
        return None
    shown = {n: [r for r in REGIONS if r != STEP and r in present_regions(records, n)] for n in names}
    most = max(len(regions) for regions in shown.values())
    fig = Figure(figsize=(max(10.0, 0.4 * most * len(runs)), 1.5 + 2.4 * len(names)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(names), 1))
    width = 0.8 / len(runs)
    for ax, measure in zip(axes, names, strict=True):
        xs = np.arange(len(shown[measure]))
        for i, (label, record) in enumerate(runs):
            values = [record.median(region, measure) for region in shown[measure]]
            heights = [v if v > 0 else np.nan for v in values]  # 0 has no place on a log axis
            bars = ax.bar(xs + (i - (len(runs) - 1) / 2) * width, heights, width, label=label)
            ax.bar_label(bars, [f"{v:g}" if v > 0 else "" for v in values], fontsize=6)
        ax.set_yscale("log")
        ax.set_ylim(0.5, None)  # a count of 1 still shows as a bar
        ax.set_ylabel(f"{MEASURES[measure].header} per step\n(median, log; 0 not drawn)", fontsize=9)
        ax.set_xticks(xs, shown[measure])
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    axes[0].set_title(title, fontsize=10)
    fig.savefig(path, dpi=100)
    return path


def draw_regions(record: ProfileRecord, path) -> Path:
    """Horizontal bars per region: the median of the run's leading time (``leading_time``: the GPU time the region
    launched where the device paced the step, else the wall time) with its [q1–q3], the other time as a thin bar
    (on a GPU), and beside each bar the counts that explain it (launches and syncs on a GPU, operators on the CPU)."""
    regions = [r for r in REGIONS if record.stats(r)]
    counts = ("launches", "syncs") if record.analysis.gpu else ("ops", "host_reads")
    lead = record.leading_time()
    other = "wall_ms" if lead == "gpu_ms" else "gpu_ms"
    fig = Figure(figsize=(10, 1.2 + 0.45 * len(regions)), layout="constrained")
    ax = fig.add_subplot()
    ys = np.arange(len(regions))[::-1]
    right = 0.0
    for y, region in zip(ys, regions, strict=True):
        main, thin = record.stats(region, lead), record.stats(region, other)
        color = REGION_COLORS.get(region, "#7f7f7f")
        end = thin.median if thin else 0.0
        if main:
            ax.barh(y, main.median, color=color, alpha=0.45)
            ax.errorbar(main.median, y, xerr=[[main.median - main.q1], [main.q3 - main.median]], color="k")
            end = max(end, main.q3)
        if thin and thin.median:
            ax.barh(y, thin.median, height=0.35, color=color)
        right = max(right, end)
        text = ", ".join(f"{format_value(c, record.median(region, c))} {MEASURES[c].header}" for c in counts)
        ax.text(end, y, f"  {significant(main.median if main else 0.0)} ms, {text}", va="center", fontsize=8)
    ax.set_yticks(ys, regions)
    ax.set_xlim(0, right * 1.5 or 1)  # room for the text
    if lead == "gpu_ms":
        what = "GPU ms each region launched (median; whisker: q1–q3): the device paced the step; thin bar: the host's "
        what += "time to launch it"
    else:
        what = "wall ms per step (median; whisker: q1–q3 over the active steps"
        what += "; thin bar: the GPU time it launched)" if record.analysis.gpu else ")"
    ax.set_xlabel(what)
    ax.set_title(record.title(), fontsize=10)
    fig.savefig(path, dpi=100)
    return Path(path)
