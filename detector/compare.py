"""`make compare`: profile runs side by side, with what makes the slow ones slow.

By default the newest run of each ``runs/profile/<strategy>[-forward]/<time>/`` folder (one per strategy
and mode), or the run folders named. Per mode:

- a time table: regions x strategies, wall ms per step as "median [min–max]" over the active steps, and
  the speed-up against ``padded`` (padded's median / this median) only where the two [min–max] ranges do
  not overlap; "≈" where they do;
- a why table: per region and strategy, kernel launches, kernels, syncs, copies, GPU busy and idle, and
  the host's time in CUDA calls (medians; detector.analysis defines each);
- charts: stacked ms per step (linear), launches / syncs / H2D copies per region (log), and every
  strategy's representative step on one time axis (detector.timeline.draw_steps).

Everything goes to a new ``runs/compare/<time>/`` (compare.md, compare.json, the PNGs) together with
TensorBoard event files: run ``compare/<time>`` has the tables as Text and the charts as Images.
Columns: padded first, then the registry's order (detector.losses.STRATEGIES), unknown names last.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from detector.analysis import REGIONS, format_measure
from detector.errors import UserError
from detector.losses import STRATEGIES
from detector.timeline import REGION_COLORS, draw_steps

BASELINE = "padded"
MODES = ("train", "forward")
SUMMARY = "summary.json"
WHY_MEASURES = {  # measure -> column header
    "launches": "launches",
    "kernels": "kernels",
    "syncs": "syncs",
    "h2d_copies": "H2D copies",
    "h2d_bytes": "H2D bytes",
    "d2h_copies": "D2H copies",
    "gpu_busy_ms": "GPU busy ms",
    "gpu_idle_share": "GPU idle",
    "runtime_ms": "CUDA API ms",
}
COUNT_CHARTS = {"launches": "kernel launches", "syncs": "host-device syncs", "h2d_copies": "H2D copies"}


def run_compare(profile_dir="runs/profile", runs=None, out_dir=None) -> dict:
    """Compare the latest run of each strategy and mode under ``profile_dir`` (or the run folders in
    ``runs``); write tables, charts, timelines and TensorBoard events to ``out_dir`` (default: a new
    ``<profile_dir>/../compare/<time>/``). Returns what compare.json holds."""
    loaded = [run for run in map(read_run, runs) if run] if runs else latest_runs(profile_dir)
    if not loaded:
        where = "the named runs" if runs else f"{profile_dir}/<strategy>/<time>/"
        raise UserError(f"no profile runs in {where}: run `make profile STRATEGY=<name>` first")
    out = Path(out_dir) if out_dir else new_folder(Path(profile_dir).parent / "compare")
    out.mkdir(parents=True, exist_ok=True)
    groups = {mode: order_runs([r for r in loaded if r["mode"] == mode]) for mode in MODES}
    groups = {mode: group for mode, group in groups.items() if group}
    created = datetime.now().isoformat(timespec="seconds")
    markdown = [f"# Profile runs compared ({created})", "", runs_table([r for g in groups.values() for r in g])]
    report = {"created": created, "out_dir": str(out), "modes": {}}
    texts, images = {}, {}
    for mode, group in groups.items():
        report["modes"][mode] = mode_report(group)
        texts[mode] = mode_markdown(mode, group)
        images[f"ms_per_step/{mode}"] = draw_stacked(group, mode, out / f"ms-per-step-{mode}.png")
        images[f"counts/{mode}"] = draw_counts(group, mode, out / f"counts-{mode}.png")
        timeline = draw_timelines(group, mode, out / f"timeline-{mode}.png")
        if timeline:
            images[f"timeline/{mode}"] = timeline
        markdown += ["", texts[mode]]
    report["runs"] = [{k: v for k, v in r.items() if k != "summary"} for g in groups.values() for r in g]
    (out / "compare.md").write_text("\n".join(markdown) + "\n")
    report["files"] = sorted(str(p) for p in [out / "compare.md", out / "compare.json", *images.values()])
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str))
    write_compare_events(out, texts, images)
    print("\n".join(markdown))
    print(f"\ncompare.md, compare.json, {len(images)} PNGs and TensorBoard events in {out}/")
    print(f"TensorBoard (make tensorboard): run {out.parent.name}/{out.name}, dashboards Text and Images")
    return report


# ----------------------------------------------------------------------------- finding and reading runs


def latest_runs(profile_dir) -> list[dict]:
    """The newest readable run of each ``<strategy>[-forward]/`` folder (broken ones skipped, warned)."""
    root = Path(profile_dir)
    found = []
    for group in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        # newest first; a summary.json in the group itself is the old layout (one run, overwritten)
        candidates = sorted((p.parent for p in group.glob(f"*/{SUMMARY}")), key=lambda p: p.name, reverse=True)
        for folder in candidates + ([group] if (group / SUMMARY).is_file() else []):
            run = read_run(folder)
            if run:
                found.append(run)
                break
    return found


def read_run(path) -> dict | None:
    """{"strategy", "mode", "run", "dir", "summary"} of a run folder (or its summary.json); None with a
    one-line warning when its summary.json is missing, broken or not one that `make profile` writes."""
    path = Path(path)
    folder = path.parent if path.name == SUMMARY else path
    try:
        summary = json.loads((folder / SUMMARY).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return warn(folder / SUMMARY, f"cannot read it ({type(err).__name__}: {str(err)[:80]})")
    reason = foreign(summary)
    if reason:
        return warn(folder / SUMMARY, reason)
    return {"strategy": summary["strategy"], "mode": summary["mode"], "run": folder.name, "dir": folder} | {
        "summary": summary
    }


def foreign(summary) -> str | None:
    """Why a parsed summary.json is not a current `make profile` summary, or None if it is one."""
    if not isinstance(summary, dict):
        return "not a JSON object"
    missing = [key for key in ("strategy", "mode", "analysis", "per_step") if key not in summary]
    if missing:
        return f"no {', '.join(missing)}: not written by (this version of) make profile; re-run it"
    if summary["mode"] not in MODES:
        return f"mode {summary['mode']!r} is none of {', '.join(MODES)}"
    try:
        float(summary["analysis"]["regions"]["step"]["wall_ms"]["median"])
    except (KeyError, TypeError, ValueError):
        return "its analysis has no step wall time"
    return None


def warn(path, reason: str) -> None:
    print(f"warning: skipped {path}: {reason}", file=sys.stderr)


def new_folder(parent: Path) -> Path:
    """``parent/<YYYYmmdd-HHMMSS>`` that does not exist yet (older comparisons are kept)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = parent / stamp, 1
    while folder.exists():
        n += 1
        folder = parent / f"{stamp}-{n}"
    return folder


def order_runs(runs: list[dict]) -> list[dict]:
    """padded first, then the registry's order, unknown names last; each run gets its column ``label``
    (the strategy, plus the run folder's name where a strategy appears twice)."""
    names = list(STRATEGIES)
    rank = {name: i for i, name in enumerate(names)}
    runs = sorted(runs, key=lambda r: (r["strategy"] != BASELINE, rank.get(r["strategy"], len(names)), r["strategy"]))
    strategies = [r["strategy"] for r in runs]
    for r in runs:
        r["label"] = r["strategy"] if strategies.count(r["strategy"]) == 1 else f"{r['strategy']} {r['run']}"
    return runs


# ----------------------------------------------------------------------------- tables


def stats(run: dict, region: str, measure: str) -> dict | None:
    """The spread of a measure in a region of a run (None where the run has no such region)."""
    found = run["summary"]["analysis"]["regions"].get(region, {}).get(measure)
    return found if found and found["n"] else None


def regions_of(runs: list[dict]) -> list[str]:
    return [r for r in REGIONS if any(stats(run, r, "wall_ms") for run in runs)]


def speedup(base: dict | None, other: dict | None) -> float | None:
    """base median / other median where their [min–max] ranges do not overlap; None otherwise (≈)."""
    if not base or not other or base["median"] <= 0 or other["median"] <= 0:
        return None
    if other["max"] < base["min"] or other["min"] > base["max"]:
        return base["median"] / other["median"]
    return None


def spread_text(s: dict, measure: str = "wall_ms") -> str:
    """``12.3 [11.9–13.0]``: median [min–max]; one value where they print the same."""
    low, middle, high = (format_measure(measure, s[key]) for key in ("min", "median", "max"))
    return middle if low == high else f"{middle} [{low}–{high}]"


def setting(runs: list[dict]) -> str:
    """``batch 1024, NVIDIA H200, torch 2.11.0`` (each distinct setting, joined, when runs differ)."""
    found = dict.fromkeys(
        f"batch {r['summary'].get('batch_size', '?')}, {r['summary'].get('device', '?')}, "
        f"torch {r['summary'].get('torch', '?')}"
        for r in runs
    )
    return "; ".join(found)


def runs_table(runs: list[dict]) -> str:
    lines = ["| strategy | mode | device | torch | batch | image px | steps | run folder |", "|---" * 8 + "|"]
    for r in runs:
        s = r["summary"]
        cells = [r["strategy"], r["mode"], s.get("device"), s.get("torch"), s.get("batch_size"), s.get("image_size")]
        cells += [s["analysis"].get("steps"), f"`{r['dir']}`"]
        lines.append("| " + " | ".join("?" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def time_table(runs: list[dict]) -> str:
    """Regions x strategies: wall ms "median [min–max]", then the speed-up vs padded or ≈."""
    base = runs[0] if runs[0]["strategy"] == BASELINE else None
    lines = ["| region | " + " | ".join(r["label"] for r in runs) + " |", "|---" + "|---:" * len(runs) + "|"]
    for region in regions_of(runs):
        cells = []
        for run in runs:
            s = stats(run, region, "wall_ms")
            cell = spread_text(s) if s else "–"
            if s and base and run is not base and stats(base, region, "wall_ms"):
                x = speedup(stats(base, region, "wall_ms"), s)
                cell += f" · {x:.3g}×" if x else " · ≈"
            cells.append(cell)
        name = f"**{region}**" if region == "step" else region
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def why_table(runs: list[dict]) -> str:
    """Per region and strategy: the medians of launches, syncs, copies, GPU busy and idle, CUDA API ms."""
    lines = ["| region | strategy | " + " | ".join(WHY_MEASURES.values()) + " |"]
    lines.append("|---|---" + "|---:" * len(WHY_MEASURES) + "|")
    for region in regions_of(runs):
        for run in runs:
            if not stats(run, region, "wall_ms"):
                continue
            cells = [format_measure(m, (stats(run, region, m) or {}).get("median")) for m in WHY_MEASURES]
            lines.append(f"| {region} | {run['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mode_markdown(mode: str, runs: list[dict]) -> str:
    steps = sorted({r["summary"]["analysis"].get("steps") for r in runs}, key=str)
    baseline = f"{BASELINE}'s median / this median" if runs[0]["strategy"] == BASELINE else "(no padded run)"
    return "\n".join(
        [
            f"## mode={mode} — {setting(runs)}",
            "",
            f"Wall ms per step: median [min–max] over the active steps ({', '.join(map(str, steps))} per run). "
            f"`· 2×` = speed-up, {baseline}, shown only where the two [min–max] ranges do not overlap; "
            "`· ≈` where they do.",
            "",
            time_table(runs),
            "",
            f"### Why (mode={mode}): medians per step",
            "",
            "Launches: kernel launch calls (grow with the batch when the loss loops over images). Syncs: host "
            "waits for the GPU (data-dependent shapes, `.item()`; the lab's region-ending synchronize not "
            "counted). H2D copies: per-image copies show here. GPU idle: share of the region the GPU waits "
            "on the host. CUDA API ms: host time in CUDA calls.",
            "",
            why_table(runs),
        ]
    )


def mode_report(runs: list[dict]) -> dict:
    """compare.json's part for one mode: the runs' labels, every measure's spread, the speed-ups."""
    base = runs[0] if runs[0]["strategy"] == BASELINE else None
    regions = {
        region: {r["label"]: r["summary"]["analysis"]["regions"].get(region) for r in runs}
        for region in regions_of(runs)
    }
    speedups = {
        region: {
            r["label"]: speedup(stats(base, region, "wall_ms"), stats(r, region, "wall_ms")) if base else None
            for r in runs
        }
        for region in regions
    }
    labels = [r["label"] for r in runs]
    return {"labels": labels, "baseline": base and base["label"], "regions": regions, "speedups_vs_padded": speedups}


# ----------------------------------------------------------------------------- charts


def draw_stacked(runs: list[dict], mode: str, path: Path) -> Path:
    """One bar per strategy, its regions' median ms stacked (linear), the median step total on top."""
    parts = [r for r in regions_of(runs) if r != "step"]
    fig = Figure(figsize=(max(7.0, 3.5 + 1.1 * len(runs)), 5.5), layout="constrained")
    ax = fig.add_subplot()
    xs = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for region in parts + ["other"]:
        if region == "other":  # the step's time outside the regions (profiler.step, Python between them)
            heights = [max(0.0, median(r, "step") - b) for r, b in zip(runs, bottom, strict=True)]
        else:
            heights = [median(r, region) for r in runs]
        ax.bar(xs, heights, 0.6, bottom=bottom, color=REGION_COLORS.get(region, "#e0e0e0"), label=region)
        bottom += heights
    for x, run, top in zip(xs, runs, bottom, strict=True):
        ax.text(x, top, f"{median(run, 'step'):.3g} ms", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs, [r["label"] for r in runs], rotation=20 if len(runs) > 5 else 0)
    ax.set_ylim(0, bottom.max() * 1.1)
    ax.set_ylabel("ms per step (median over the active steps)")
    ax.set_title(f"mode={mode}: where a step's time goes — {setting(runs)}", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.savefig(path, dpi=100)
    return path


def median(run: dict, region: str, measure: str = "wall_ms") -> float:
    s = stats(run, region, measure)
    return s["median"] if s and s["median"] is not None else 0.0


def draw_counts(runs: list[dict], mode: str, path: Path) -> Path:
    """Launches, syncs and H2D copies per region (groups) and strategy (bars), log scale: 1 vs 10⁵."""
    regions = regions_of(runs)
    fig = Figure(figsize=(max(10.0, 0.4 * len(regions) * len(runs)), 8), layout="constrained")
    axes = fig.subplots(len(COUNT_CHARTS), 1, sharex=True)
    width = 0.8 / len(runs)
    xs = np.arange(len(regions))
    for ax, (measure, name) in zip(axes, COUNT_CHARTS.items(), strict=True):
        for i, run in enumerate(runs):
            values = [median(run, region, measure) for region in regions]
            heights = [v if v > 0 else np.nan for v in values]  # 0 has no place on a log axis
            bars = ax.bar(xs + (i - (len(runs) - 1) / 2) * width, heights, width, label=run["label"])
            ax.bar_label(bars, [f"{v:g}" if v > 0 else "" for v in values], fontsize=6)
        if any(median(run, region, measure) > 0 for run in runs for region in regions):
            ax.set_yscale("log")
            ax.set_ylim(0.5, None)  # a count of 1 still shows as a bar
        ax.set_ylabel(f"{name} per step\n(median, log scale; 0 not drawn)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    axes[0].set_title(f"mode={mode}: what the host does per region — {setting(runs)}", fontsize=10)
    axes[-1].set_xticks(xs, regions)
    fig.savefig(path, dpi=100)
    return path


def draw_timelines(runs: list[dict], mode: str, path: Path) -> Path | None:
    """Every run's representative step on one time axis; runs whose trace is missing are left out."""
    traces = []
    for run in runs:
        trace = run["dir"] / run["summary"].get("trace", "")
        if run["summary"].get("trace") and trace.is_file():
            traces.append((run["label"], trace))
        else:
            warn(trace, "no trace file: left out of the timeline")
    if not traces:
        return None
    try:
        return draw_steps(traces, path, title=f"mode={mode}: representative step of each strategy — {setting(runs)}")
    except ValueError as err:  # an unreadable trace: the tables still stand
        warn(path, f"no timeline ({err})")
        return None


# ----------------------------------------------------------------------------- TensorBoard


def write_compare_events(out: Path, texts: dict[str, str], images: dict[str, Path]) -> None:
    """Text ``compare/<mode>`` (the tables) and Images ``<chart>/<mode>`` in the ``compare/<time>`` run."""
    from torch.utils.tensorboard import SummaryWriter

    from detector.board import read_png

    with SummaryWriter(log_dir=str(out)) as writer:
        for mode, text in texts.items():
            writer.add_text(f"compare/{mode}", text)
        for tag, png in images.items():
            writer.add_image(tag, read_png(png), dataformats="HWC")
