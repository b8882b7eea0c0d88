"""`make compare`: profile runs side by side, with what makes the slow ones slow.

By default the newest run of each ``runs/profile/<strategy>[-forward]/<time>/`` folder (one per strategy
and mode), or the run folders named. Per mode:

- verdicts: each strategy's step against ``padded``'s as training runs it (the steps timed without the
  profiler: the profiler's own cost grows with the operators a strategy dispatches, so on a CPU the
  profiled steps of per-image strategies are longer than their training steps) and as profiled, and the
  region where most of the difference lies in the verdict's direction (by GPU time alone where the device
  was busy all the step: see ``explain``), with the measures that explain it;
- a wall-time table and (on a GPU) a GPU-time table: regions x strategies, median [q1–q3] over the active
  steps, and the speed-up against padded by the rule of detector.tables (``≈`` where the interquartile
  ranges overlap). The step's verdict must also hold without the data wait: the loader's wait alone never
  decides it;
- a why table: per region and strategy, the medians of the measures of detector.measures that are not
  zero in every run (a CPU comparison says once which ones need a GPU);
- charts: stacked wall and GPU ms per step (the axis ends at 4x the median step, a longer bar is cut with
  its total written), the counts per region (log), and every strategy's representative step on one time
  axis (detector.timeline.draw_steps).

Everything goes to a new ``runs/compare/<time>/`` (compare.md, compare.json, the PNGs) together with
TensorBoard event files: run ``compare/<time>`` has the tables as Text and the charts as Images, the
first cards of TensorBoard's landing page (detector.board orders the tags).
Columns: padded first, then the registry's order (detector.losses.STRATEGIES), unknown names last.
"""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from detector.analysis import OTHER, PARTS, REGIONS, spread
from detector.board import COMPARE_GROUP, absent_gpu_measures, present, read_png, stats_cell
from detector.errors import UserError
from detector.losses import STRATEGIES
from detector.measures import COUNTS, MEASURES, WHY, format_value, gpu_note, legend
from detector.tables import Spread, markdown_table, speedup, times
from detector.timeline import CLIP, REGION_COLORS, draw_steps

BASELINE = "padded"
MODES = ("train", "forward")
SUMMARY = "summary.json"
LOSS_REGIONS = [r for r in PARTS if r not in ("data wait", OTHER)]  # where a strategy differs
DEVICE_BOUND_IDLE = 0.05  # a step whose device idles less than this share is paced by the device


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
        images[f"{COMPARE_GROUP}/1 ms per step, {mode}"] = draw_stacked(group, mode, out / f"ms-per-step-{mode}.png")
        counts = draw_counts(group, mode, out / f"counts-{mode}.png")
        if counts:
            images[f"{COMPARE_GROUP}/2 counts, {mode}"] = counts
        timeline = draw_timelines(group, mode, out / f"timeline-{mode}.png")
        if timeline:
            images[f"{COMPARE_GROUP}/3 timeline, {mode}"] = timeline
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
    groups = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [run for run in map(latest_in, groups) if run]


def latest_in(group: Path) -> dict | None:
    """The newest readable run of a ``<strategy>[-forward]/`` folder, or None."""
    # newest first; a summary.json in the group itself is the old layout (one run, overwritten)
    candidates = sorted((p.parent for p in group.glob(f"*/{SUMMARY}")), key=lambda p: p.name, reverse=True)
    for folder in candidates + ([group] if (group / SUMMARY).is_file() else []):
        run = read_run(folder)
        if run:
            return run
    return None


def read_run(path) -> dict | None:
    """{"strategy", "mode", "run", "dir", "summary"} of a run folder (or its summary.json, or a strategy's folder
    of runs: its newest); None with a one-line warning when its summary.json is missing, broken or not one that
    `make profile` writes. A path that does not exist is a UserError naming it. Values that no measure can
    take (not finite, negative, beyond 10^15) are left out, with one warning naming them."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"no run folder {path}: mistyped?{nearby(path)}")
    folder = path.parent if path.name == SUMMARY else path
    if not (folder / SUMMARY).exists() and any(folder.glob(f"*/{SUMMARY}")):
        return latest_in(folder)
    try:
        summary = json.loads((folder / SUMMARY).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return warn(folder / SUMMARY, f"cannot read it ({type(err).__name__}: {str(err)[:80]})")
    reason = foreign(summary)
    if reason:
        return warn(folder / SUMMARY, reason)
    left_out = drop_unusable(summary)
    if not summary["analysis"]["regions"]["step"]["wall_ms"]["n"]:
        return warn(folder / SUMMARY, f"its step wall time is not usable: {left_out[0]}")
    if left_out:
        shown = ", ".join(left_out[:3]) + (f" and {len(left_out) - 3} more" if len(left_out) > 3 else "")
        print(f"warning: {folder / SUMMARY}: left out {shown}: not finite, negative or beyond 10^15", file=sys.stderr)
    return {"strategy": summary["strategy"], "mode": summary["mode"], "run": folder.name, "dir": folder} | {
        "summary": summary
    }


def nearby(path: Path) -> str:
    """What the deepest existing folder above ``path`` holds, to spot a typo by."""
    parent = next((p for p in path.parents if p.is_dir()), Path("."))
    names = sorted(p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f" {parent} holds {shown}" if names else f" {parent} holds no run folders"


LIMIT = 1e15  # beyond any measure of a step (10^15 ms is 30,000 years; bytes: a petabyte); charts overflow near 1e308
STAT_KEYS = ("median", "q1", "q3", "min", "max")


def unusable(value) -> bool:
    """Whether a measured value cannot be one: None is an absent measure; NaN fails every comparison."""
    if value is None:
        return False
    return isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= LIMIT


def drop_unusable(summary: dict) -> list[str]:
    """Make every spread with an unusable value absent (n 0), and drop the steps with one; returns their keys."""
    left_out = []
    sections = [(f"analysis.regions.{name}", measures) for name, measures in summary["analysis"]["regions"].items()]
    sections.append(("timed", summary.get("timed") or {}))
    for prefix, measures in sections:
        for measure, stats in measures.items() if isinstance(measures, dict) else ():
            bad = [key for key in STAT_KEYS if isinstance(stats, dict) and unusable(stats.get(key))]
            if bad:
                left_out.append(f"{prefix}.{measure}.{bad[0]} ({stats[bad[0]]!r})")
                measures[measure] = dict.fromkeys(STAT_KEYS) | {"n": 0}
    kept = []
    for i, step in enumerate(summary["per_step"]):
        bad = step_problems(step, f"per_step[{i}]")
        left_out += bad
        kept += [] if bad else [step]
    summary["per_step"] = kept
    return left_out


def step_problems(step, key: str) -> list[str]:
    """The unusable values of one entry of per_step, or why it is no step (it needs the step's wall time)."""
    regions = step.get("regions") if isinstance(step, dict) else None
    if not isinstance(regions, dict) or not isinstance(regions.get("step"), dict) or "wall_ms" not in regions["step"]:
        return [f"{key} (no step wall time)"]
    return [
        f"{key}.regions.{name}.{measure} ({value!r})"
        for name, measures in regions.items()
        for measure, value in (measures.items() if isinstance(measures, dict) else [("", "not a region")])
        if unusable(value)
    ]


def foreign(summary) -> str | None:
    """Why a parsed summary.json is not a current `make profile` summary, or None if it is one."""
    if not isinstance(summary, dict):
        return "not a JSON object"
    missing = [key for key in ("strategy", "mode", "analysis", "per_step") if key not in summary]
    if missing:
        return f"no {', '.join(missing)}: not written by (this version of) make profile; re-run it"
    if not isinstance(summary["per_step"], list):
        return "its per_step is not a list of steps"
    if not isinstance(summary["strategy"], str) or not summary["strategy"]:
        return f"its strategy {summary['strategy']!r} is not a name"
    if summary["mode"] not in MODES:
        return f"mode {summary['mode']!r} is none of {', '.join(MODES)}"
    try:
        regions = summary["analysis"]["regions"]
        step = float(regions["step"]["wall_ms"]["median"])
        if "gpu_ms" not in regions["step"]:
            return "its analysis predates GPU time by launch (gpu_ms): re-run make profile"
    except (KeyError, TypeError, ValueError):
        return "its analysis has no step wall time"
    if not math.isfinite(step) or step <= 0 or step > 1e7:
        return f"its step wall time {step!r} ms is not a duration (expected finite, > 0, < 10^7)"
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


# ----------------------------------------------------------------------------- numbers and verdicts


def stats(run: dict, region: str, measure: str = "wall_ms") -> dict | None:
    """The spread of a measure in a region of a run (None where the run has no values there)."""
    found = run["summary"]["analysis"]["regions"].get(region, {}).get(measure)
    return found if found and found.get("n") else None


def median(run: dict, region: str, measure: str = "wall_ms") -> float:
    s = stats(run, region, measure)
    return s["median"] if s and s["median"] is not None else 0.0


def timed(run: dict) -> dict | None:
    """The spread of the steps timed without the profiler (as training runs them), if the run has them."""
    found = (run["summary"].get("timed") or {}).get("step_ms")
    return found if found and found.get("n") else None


def without_data_wait(run: dict) -> Spread | None:
    """The spread over the active steps of the step's wall time less its data wait."""
    values = [
        s["regions"]["step"]["wall_ms"] - s["regions"].get("data wait", {}).get("wall_ms", 0.0)
        for s in run["summary"]["per_step"]
    ]
    return Spread.of(spread(values))


def step_verdict(base: dict, run: dict) -> tuple[float | None, str]:
    """(the profiled step's speed-up against ``base``, or None for ≈; a note): on a GPU by the step as the
    device runs it (the host, running ahead, paces its steps by the launch queue), else ``host_step_verdict``."""
    device = Spread.of(stats(base, "step", "device_step_ms")), Spread.of(stats(run, "step", "device_step_ms"))
    if all(device):
        return speedup(*device), ""
    return host_step_verdict(base, run)


def host_step_verdict(base: dict, run: dict) -> tuple[float | None, str]:
    """(the step's host wall speed-up against ``base``, or None for ≈; a note). A difference the data wait
    alone makes (none without it, or the other way) is ≈ with the note "data wait": the loader is not the
    strategy."""
    x = speedup(Spread.of(stats(base, "step")), Spread.of(stats(run, "step")))
    if x is None:
        return None, ""
    y = speedup(without_data_wait(base), without_data_wait(run))
    if y is None or (x > 1) != (y > 1):
        return None, "data wait"
    return x, ""


def time_cell(run: dict, base: dict | None, region: str, measure: str) -> str:
    """``12.3 [12.1–12.6] · 2×``: the median [q1–q3], then the speed-up against the baseline."""
    s = stats(run, region, measure)
    cell = stats_cell(measure, s)
    if not s or base is None or base is run or not stats(base, region, measure):
        return cell
    if region == "step" and measure == "wall_ms":
        x, note = host_step_verdict(base, run)
        return f"{cell} · {times(x)}" + (f" ({note})" if note else "")
    return f"{cell} · {times(speedup(Spread.of(stats(base, region, measure)), Spread.of(s)))}"


def baseline(runs: list[dict]) -> dict | None:
    return runs[0] if runs[0]["strategy"] == BASELINE else None


def regions_of(runs: list[dict]) -> list[str]:
    return [r for r in REGIONS if any(stats(run, r) for run in runs)]


# ----------------------------------------------------------------------------- tables


def setting(runs: list[dict]) -> str:
    """``batch 1024, NVIDIA H200, torch 2.11.0`` (each distinct setting, joined, when runs differ)."""
    found = dict.fromkeys(
        f"batch {r['summary'].get('batch_size', '?')}, {r['summary'].get('device', '?')}, "
        f"torch {r['summary'].get('torch', '?')}"
        for r in runs
    )
    return "; ".join(found)


def runs_table(runs: list[dict]) -> str:
    headers = ["strategy", "mode", "device", "torch", "batch", "image px", "regions", "steps", "run folder"]
    rows = []
    for r in runs:
        s = r["summary"]
        protocol = "synchronised" if s.get("sync_regions") else "as training"
        rows.append([r["strategy"], r["mode"], s.get("device"), s.get("torch"), s.get("batch_size")])
        rows[-1] += [s.get("image_size"), protocol, s["analysis"].get("steps"), f"`{r['dir']}`"]
    return markdown_table(headers, [["?" if c is None else c for c in row] for row in rows], "lllllrlrl")


def time_table(runs: list[dict], measure: str) -> str:
    """Regions x strategies: ``measure`` (wall_ms or gpu_ms) "median [q1–q3] · speed-up vs padded"; the wall
    table ends with the step as training runs it."""
    base = baseline(runs)
    rows = []
    for region in regions_of(runs):
        if measure == "gpu_ms" and region == "data wait":
            continue  # the loader's copies: not the strategy's work
        name = f"**{region}**" if region == "step" else region
        rows.append([name] + [time_cell(run, base, region, measure) for run in runs])
    if measure == "gpu_ms":
        rows.append(["**step, on the device**"] + [time_cell(run, base, "step", "device_step_ms") for run in runs])
    if measure == "wall_ms":
        rows.append(["**step, as training runs it**"] + [timed_cell(run, base) for run in runs])
    return markdown_table(["region"] + [r["label"] for r in runs], rows)


def timed_cell(run: dict, base: dict | None) -> str:
    s = timed(run)
    cell = stats_cell("wall_ms", s)
    if s and base and base is not run and timed(base):
        cell += f" · {times(speedup(Spread.of(timed(base)), Spread.of(s)))}"
    return cell


def why_table(runs: list[dict], names: list[str]) -> str:
    """Per region and strategy: the medians of the why measures ``names``."""
    rows = []
    for region in regions_of(runs):
        for run in runs:
            if stats(run, region):
                rows.append([region, run["label"]] + [format_value(m, median(run, region, m)) for m in names])
    return markdown_table(["region", "strategy"] + [MEASURES[m].header for m in names], rows, "ll" + "r" * len(names))


def verdicts(runs: list[dict]) -> list[str]:
    """One line per strategy against padded: the step as training runs it (timed without the profiler),
    the profiled step, and where the difference lies with the measures that explain it."""
    base = baseline(runs)
    if base is None:
        return ["(no padded run in this mode: no verdicts)"]
    lines = []
    for run in runs[1:]:
        x, note = step_verdict(base, run)
        profiled = f"profiled {relation(x)}" + (
            " (the data wait differs, the rest of the step does not)" if note else ""
        )
        if timed(base) and timed(run):
            trained = speedup(Spread.of(timed(base)), Spread.of(timed(run)))
            line = f"- **{run['label']}**: {relation(trained)} as training runs it; {profiled}."
        else:
            trained, line = None, f"- **{run['label']}**: {profiled} (not timed without the profiler)."
        emulated = run["summary"].get("emulated")
        line += f" Its times are not its kernels': {emulated} here." if emulated else ""
        directions = {v > 1 for v in (x, trained) if v is not None}
        # one direction to explain: the profile's regions cannot say why training went the other way
        lines.append(line + (f" {explain(base, run, directions.pop())}" if len(directions) == 1 else ""))
    return lines


def relation(x: float | None) -> str:
    if x is None:
        return "≈ padded"
    return f"{times(x)} faster than padded" if x > 1 else f"{times(1 / x)} slower than padded"


def device_bound(run: dict) -> bool:
    """Whether the device was busy nearly all of the run's step (GPU idle under DEVICE_BOUND_IDLE)."""
    idle = stats(run, "step", "gpu_idle_share")
    return idle is not None and idle["median"] is not None and idle["median"] < DEVICE_BOUND_IDLE


def explain(base: dict, run: dict, faster: bool) -> str:
    """Where a step differs most from padded's in the verdict's direction (``faster``: the region that gained
    most; else the one that lost most), and why. A region costs the larger of its wall and GPU ms, or its GPU
    ms alone where both steps kept the device busy: a host running ahead then waits wherever the launch queue
    is full, so its regions' wall times say where it waited, not what the region cost."""
    gpu_only = device_bound(base) and device_bound(run)

    def cost(r, region):
        return median(r, region, "gpu_ms") if gpu_only else max(median(r, region), median(r, region, "gpu_ms"))

    deltas = {r: cost(run, r) - cost(base, r) for r in LOSS_REGIONS if stats(run, r) and stats(base, r)}
    deltas = {r: d for r, d in deltas.items() if (d < 0) == faster and d != 0}
    if not deltas:
        return ""
    region = max(deltas, key=lambda r: abs(deltas[r]))
    delta = deltas[region]
    reasons = []
    for m in WHY:
        a, b = median(base, region, m), median(run, region, m)
        if MEASURES[m].unit == "count" and b > max(2 * a, a + 1):
            reasons.append((b / max(a, 1), f"{format_value(m, b)} {MEASURES[m].header} against {format_value(m, a)}"))
    why = "; ".join(text for _, text in sorted(reasons, reverse=True)[:3])
    return f"Most of it in {region} ({delta:+.3g} ms)" + (f": {why}." if why else ".")


def mode_markdown(mode: str, runs: list[dict]) -> str:
    gpu = any(r["summary"]["analysis"].get("gpu") for r in runs)
    why = present([r["summary"] for r in runs], WHY)
    lines = [
        f"## mode={mode} — {setting(runs)}",
        "",
        "### Verdicts",
        "",
        *verdicts(runs),
        "",
        "### Wall ms per step (host)",
        "",
        "Median [q1–q3] over the active steps; `· 2×` = padded's median / this median where the interquartile "
        "ranges do not overlap, `· ≈` where they do. The step's verdict must also hold without the data wait "
        "(the loader's, shown on its own line). The last row: the steps timed without the profiler.",
        "",
        time_table(runs, "wall_ms"),
    ]
    if gpu:
        lines += [
            "",
            "### GPU ms per step (device)",
            "",
            "The kernels, copies and memsets each region launched, whenever they ran; the same rule. The last "
            "row: each step from the start of its first GPU work to the next step's, the profiled step's verdict.",
            "",
            time_table(runs, "gpu_ms"),
        ]
    lines += ["", f"### Why (mode={mode}): medians per step", "", why_table(runs, why)]
    missing = gpu_note(absent_gpu_measures([r["summary"] for r in runs], WHY + ("gpu_ms",)))
    lines += ["", missing] if missing else []
    lines += ["", legend(why)]
    for run in runs:
        lines += [f"\n**warning** ({run['label']}): {w}" for w in run["summary"]["analysis"].get("warnings", [])]
    return "\n".join(lines)


def mode_report(runs: list[dict]) -> dict:
    """compare.json's part for one mode: the runs' labels, every measure's spread, the verdicts."""
    base = baseline(runs)
    regions = {
        region: {r["label"]: r["summary"]["analysis"]["regions"].get(region) for r in runs}
        for region in regions_of(runs)
    }
    speedups = {
        measure: {
            region: {
                r["label"]: speedup(Spread.of(stats(base, region, measure)), Spread.of(stats(r, region, measure)))
                if base
                else None
                for r in runs
            }
            for region in regions
        }
        for measure in ("wall_ms", "gpu_ms")
    }
    steps = {r["label"]: step_verdict(base, r)[0] if base else None for r in runs}
    trained = {r["label"]: speedup(Spread.of(timed(base)), Spread.of(timed(r))) if base else None for r in runs}
    return {
        "labels": [r["label"] for r in runs],
        "baseline": base and base["label"],
        "regions": regions,
        "timed": {r["label"]: timed(r) for r in runs},
        "speedups_vs_padded": speedups,
        "step_verdicts": steps,
        "timed_verdicts": trained,
        "verdicts": verdicts(runs),
        "warnings": {r["label"]: r["summary"]["analysis"].get("warnings", []) for r in runs},
    }


# ----------------------------------------------------------------------------- charts


def draw_stacked(runs: list[dict], mode: str, path: Path) -> Path:
    """Per strategy a wall bar (and on a GPU a GPU bar beside it), each stacked by region (median ms)."""
    kinds = ["wall_ms"] + (["gpu_ms"] if any(r["summary"]["analysis"].get("gpu") for r in runs) else [])
    parts = [r for r in regions_of(runs) if r != "step"]
    # about half an inch a bar: 13 strategies' pairs stay readable at a page's width
    fig = Figure(figsize=(max(7.0, 3.5 + 0.55 * len(runs) * len(kinds)), 5.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(kinds)
    totals = sorted(median(r, "step", kind) for r in runs for kind in kinds)
    top = min(totals[-1], CLIP * totals[(len(totals) - 1) // 2]) * 1.12 or 1  # a 100x slower step stays readable
    for k, kind in enumerate(kinds):
        xs = np.arange(len(runs)) + (k - (len(kinds) - 1) / 2) * width
        bottom = np.zeros(len(runs))
        for region in parts:
            heights = np.array([median(r, region, kind) for r in runs])
            label = region if k == 0 else None
            ax.bar(
                xs,
                heights,
                width * 0.9,
                bottom=bottom,
                color=REGION_COLORS[region],
                label=label,
                hatch="//" if kind == "gpu_ms" else None,
                edgecolor="white",
                linewidth=0.3,
            )
            bottom += heights
        for x, run, height in zip(xs, runs, bottom, strict=True):
            ms = median(run, "step", kind)
            total = f"{ms:,.0f}" if ms >= 1000 else f"{ms:.3g}"
            cut = height > top  # its length written upright inside the bar's top: no room beside it
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
    labels = [r["label"] + (" *" if r["summary"].get("emulated") else "") for r in runs]
    ax.set_xticks(np.arange(len(runs)), labels, rotation=20 if len(runs) > 5 else 0)
    ax.set_ylim(0, top)
    pair = "\n(left: wall on the host; right, hatched: GPU time each region launched)" if len(kinds) == 2 else ""
    ax.set_ylabel(f"ms per step, median over the active steps{pair}", fontsize=9)
    emulated = " (* its kernels emulated here)" if any(r["summary"].get("emulated") for r in runs) else ""
    ax.set_title(f"mode={mode}: where a step's time goes — {setting(runs)}{emulated}", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.savefig(path, dpi=100)
    return path


def draw_counts(runs: list[dict], mode: str, path: Path) -> Path | None:
    """The counts of detector.measures.COUNTS that some run has, per region (groups) and strategy (bars),
    log scale (1 against 10⁵); None when every count is 0."""
    names = present([r["summary"] for r in runs], COUNTS)
    if not names:
        return None
    regions = [r for r in regions_of(runs) if r != "step"]
    fig = Figure(figsize=(max(10.0, 0.4 * len(regions) * len(runs)), 1.5 + 2.4 * len(names)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(names), 1, sharex=True))
    width = 0.8 / len(runs)
    xs = np.arange(len(regions))
    for ax, measure in zip(axes, names, strict=True):
        for i, run in enumerate(runs):
            values = [median(run, region, measure) for region in regions]
            heights = [v if v > 0 else np.nan for v in values]  # 0 has no place on a log axis
            bars = ax.bar(xs + (i - (len(runs) - 1) / 2) * width, heights, width, label=run["label"])
            ax.bar_label(bars, [f"{v:g}" if v > 0 else "" for v in values], fontsize=6)
        ax.set_yscale("log")
        ax.set_ylim(0.5, None)  # a count of 1 still shows as a bar
        ax.set_ylabel(f"{MEASURES[measure].header} per step\n(median, log; 0 not drawn)", fontsize=9)
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
    """Text ``compare/<mode>`` (the tables) and Images ``1 compare/<n> <chart>, <mode>`` in the ``compare/<time>``
    run."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(out)) as writer:
        for mode, text in texts.items():
            writer.add_text(f"compare/{mode}", text)
        for tag, png in images.items():
            writer.add_image(tag, read_png(png), dataformats="HWC")
