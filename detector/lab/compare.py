"""`make compare`: profile runs side by side, with what makes the slow ones slow.

By default the newest run of each ``runs/profile/<strategy>[-forward]/<time>/`` folder (one per strategy
and mode), or the run folders named. Per mode:

- verdicts (detector/lab/present/verdicts.py): each strategy against the ``padded`` run of its setting (device,
  batch, image size), the counts that differ first, then the time as training runs it and as profiled; and in train
  mode, which run train.strategy=auto would train with were they its candidates, and why (``auto_line``);
- the wall-time and (on a GPU) GPU-time tables, the why table, the runs' noise and which runs the loader paced
  (detector/lab/present/text.py);
- charts (detector/lab/present/charts.py, timeline.py): the median step stacked by region, the counts per region,
  every strategy's median step on one time axis, and the bytes each allocated over it.

Everything goes to a new ``runs/compare/<time>/``: compare.md, compare.json (detector/lab/record/comparison.py) and
the PNGs. A summary that is not a record this lab reads (detector/lab/record/run.py) is skipped with its reason, and
the rest compared.
Columns: padded first, then the registry's order (detector.losses.STRATEGIES), unknown names last.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from detector.checked import RecordError
from detector.errors import UserError
from detector.lab.folders import new_run_dir
from detector.lab.measure.extract import load
from detector.lab.present import charts, text
from detector.lab.present.tables import cell_text, speedup
from detector.lab.present.timeline import draw_memory, draw_steps
from detector.lab.present.verdicts import BASELINE, Verdict, growth, host_ratio, judge_all, setting, verdict_lines
from detector.lab.record.comparison import COMPARISON, ComparedRun, ComparisonRecord, ModeComparison, write_comparison
from detector.lab.record.run import MODES, SUMMARY, ProfileRecord, read_summary
from detector.lab.record.steps import StepModel
from detector.losses import STRATEGIES
from detector.regions import STEP
from detector.train.choice import Candidate, decide, reason

Run = tuple[str, ProfileRecord]  # (its column's label, its record)


@dataclass
class Comparison:
    """What `make compare` made: compare.json's record, the folder, each mode's markdown and the charts."""

    record: ComparisonRecord
    out: Path
    texts: dict[str, str] = field(default_factory=dict)  # mode -> markdown
    images: dict[str, Path] = field(default_factory=dict)  # "<chart>, <mode>" -> PNG


def run_compare(profile_dir="runs/profile", runs=None, out_dir=None) -> Comparison:
    """Compare the latest run of each strategy and mode under ``profile_dir`` (or the run folders in ``runs``);
    write tables, charts and timelines to ``out_dir`` (default: a new ``<profile_dir>/../compare/<time>/``)."""
    loaded = [r for r in map(read_run, runs) if r] if runs else latest_runs(profile_dir)
    if not loaded:
        where = "the named runs" if runs else f"{profile_dir}/<strategy>/<time>/"
        raise UserError(f"no profile runs in {where}: run `make profile STRATEGY=<name>` first")
    out = Path(out_dir) if out_dir else new_run_dir(Path(profile_dir).parent / "compare")
    out.mkdir(parents=True, exist_ok=True)
    groups = {mode: labelled(order_runs([r for r in loaded if r.mode == mode])) for mode in MODES}
    groups = {mode: group for mode, group in groups.items() if group}
    created = datetime.now().isoformat(timespec="seconds")
    markdown = [f"# Profile runs compared ({created})", "", text.runs_table([r for g in groups.values() for r in g])]
    result = Comparison(ComparisonRecord(created, str(out)), out)
    for mode, group in groups.items():
        base = baseline(group)
        verdicts = judge_all(group, base)
        result.record.modes[mode] = mode_report(group, base, verdicts)
        lines = verdict_lines(group, base, verdicts)
        auto = auto_line(group, base) if mode == "train" else None
        lines += ["", auto] if auto else []
        result.texts[mode] = text.mode_markdown(mode, group, base, lines, growth(group))
        markdown += ["", result.texts[mode]]
        result.images |= draw_charts(group, mode, out)
    result.record.runs = [describe(label, r) for g in groups.values() for label, r in g]
    (out / "compare.md").write_text("\n".join(markdown) + "\n")
    files = [out / "compare.md", out / COMPARISON, *result.images.values()]
    result.record.files = sorted(str(p) for p in files)
    write_comparison(out, result.record)
    print("\n".join(markdown))
    print(f"\ncompare.md, compare.json and {len(result.images)} PNGs in {out}/")
    return result


# ----------------------------------------------------------------------------- finding and reading runs


def latest_runs(profile_dir) -> list[ProfileRecord]:
    """The newest readable run of each ``<strategy>[-forward]/`` folder (broken ones skipped, warned)."""
    root = Path(profile_dir)
    groups = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [run for run in map(latest_in, groups) if run]


def latest_in(group: Path) -> ProfileRecord | None:
    """The newest readable run of a ``<strategy>[-forward]/`` folder, or None."""
    # newest first; a summary.json in the group itself is the old layout (one run, overwritten)
    candidates = sorted((p.parent for p in group.glob(f"*/{SUMMARY}")), key=lambda p: p.name, reverse=True)
    for folder in candidates + ([group] if (group / SUMMARY).is_file() else []):
        run = read_run(folder)
        if run:
            return run
    return None


def read_run(path) -> ProfileRecord | None:
    """The record of a run folder (or its summary.json, or a strategy's folder of runs: its newest); None with a
    one-line warning when it is not a record this lab reads. A path that does not exist is a UserError."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"no run folder {path}: mistyped?{nearby(path)}")
    folder = path.parent if path.name == SUMMARY else path
    if not (folder / SUMMARY).exists() and any(folder.glob(f"*/{SUMMARY}")):
        return latest_in(folder)
    try:
        record = read_summary(folder)
    except RecordError as err:
        print(f"warning: skipped {err}", file=sys.stderr)
        return None
    for warning in record.left_out:
        print(f"warning: {warning}", file=sys.stderr)
    return record


def nearby(path: Path) -> str:
    """What the deepest existing folder above ``path`` holds, to spot a typo by."""
    parent = next((p for p in path.parents if p.is_dir()), Path("."))
    names = sorted(p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f" {parent} holds {shown}" if names else f" {parent} holds no run folders"


def order_runs(records: list[ProfileRecord]) -> list[ProfileRecord]:
    """padded first, then the registry's order, unknown names last; by batch within a strategy."""
    rank = {name: i for i, name in enumerate(STRATEGIES)}
    key = lambda r: (r.strategy != BASELINE, rank.get(r.strategy, len(rank)), r.strategy, r.batch_size)  # noqa: E731
    return sorted(records, key=key)


def labelled(records: list[ProfileRecord]) -> list[Run]:
    """Each run with its column's label: its strategy, then its batch where the strategy appears at several,
    then its run folder's name where that is not enough, then what tells apart runs that still share a label (runs
    of one name copied into two folders): every table, verdict, chart and compare.json names a run by its label."""
    labels = []
    for r in records:
        same = [o for o in records if o.strategy == r.strategy]
        label = r.strategy
        if len(same) > 1 and len({o.batch_size for o in same}) > 1:
            label += f" b{r.batch_size}"
        if sum(1 for o in same if o.batch_size == r.batch_size) > 1:
            label += f" {r.run or (r.folder.name if r.folder else '?')}"
        labels.append(label)
    for label in {label for label in labels if labels.count(label) > 1}:
        shared = [i for i, other in enumerate(labels) if other == label]
        for i, suffix in zip(shared, told_apart([records[i].folder for i in shared]), strict=True):
            labels[i] += suffix
    return list(zip(labels, records, strict=True))


def told_apart(folders: list[Path | None]) -> list[str]:
    """A suffix for each of runs that share a label: `` (<name>)`` of the nearest folder above theirs whose names
    all differ, else `` #1``, `` #2`` ... (one folder named twice)."""
    above = [Path(f).absolute().parts[-2::-1] if f else () for f in folders]  # the parent first, then upward
    for depth in range(max(map(len, above))):
        names = [parts[depth] if depth < len(parts) else "" for parts in above]
        if all(names) and len(set(names)) == len(names):
            return [f" ({name})" for name in names]
    return [f" #{i}" for i in range(1, len(folders) + 1)]


def baseline(runs: list[Run]) -> ProfileRecord | None:
    """The padded run the others are judged against: of the setting most runs share (device, batch, image size)."""
    padded = [r for _, r in runs if r.strategy == BASELINE]
    if not padded:
        return None
    counts = {setting(p): sum(1 for _, r in runs if setting(r) == setting(p)) for p in padded}
    return max(padded, key=lambda p: counts[setting(p)])


def auto_line(runs: list[Run], base: ProfileRecord | None) -> str | None:
    """What train.strategy=auto would train with were these runs (of one setting: the baseline's) its candidates: its
    rule (detector/train/choice.py) over their timed steps and their step's peak memory rise, in one line; None
    where fewer than two runs have timed steps."""
    first = base or runs[0][1]
    found = [(label, r) for label, r in runs if setting(r) == setting(first) and r.timed and r.timed.wall_ms]
    if len(found) < 2:
        return None
    candidates = []
    for label, record in found:
        rise = record.stats(STEP, "peak_rise_bytes")
        candidates.append(Candidate(label, list(record.timed.wall_ms), int(rise.median) if rise else None))
    strategy, rule = decide(candidates)
    why = reason(candidates, strategy, rule, device="")  # a profile records memory on the CPU too, where asked to
    return (
        f"**train.strategy=auto** would train with {cell_text(strategy)} of these runs, by its rule over their timed "
        f"steps and their step's peak memory rise: {cell_text(why)}."
    )


# ----------------------------------------------------------------------------- compare.json and charts


def describe(label: str, record: ProfileRecord) -> ComparedRun:
    noise = record.noise
    return ComparedRun(
        label=label,
        strategy=record.strategy,
        mode=record.mode,
        run=record.run,
        dir=str(record.folder),
        noisy=record.noisy if noise else None,
        noise=record.noise_reasons() if noise else None,
        loader_paced=record.loader_paced(),
        max_boxes=record.max_boxes,
        data=record.data,
    )


def mode_report(runs: list[Run], base: ProfileRecord | None, verdicts: dict[str, Verdict]) -> ModeComparison:
    """compare.json's part for one mode: the runs' labels, every measure's spread, the verdicts (judge_all's)."""
    records = dict(runs)
    regions = text.regions_of(list(records.values()))
    return ModeComparison(
        labels=list(records),
        baseline=next((label for label, r in runs if r is base), None),
        regions={region: {label: dict(r.analysis.regions.get(region, {})) for label, r in runs} for region in regions},
        timed={label: r.timed_step() for label, r in runs},
        speedups_vs_padded={
            measure: {
                region: {
                    label: speedup(base.stats(region, measure), r.stats(region, measure))
                    if base and (measure == "gpu_ms" or host_ratio(base, r))
                    else None
                    for label, r in runs
                }
                for region in regions
            }
            for measure in ("wall_ms", "gpu_ms")
        },
        step_verdicts={label: v.profiled.x for label, v in verdicts.items()},
        timed_verdicts={label: v.trained.x if v.trained else None for label, v in verdicts.items()},
        verdicts=[v.line() for v in verdicts.values()],
        warnings={label: r.analysis.warnings for label, r in runs},
        noisy={label: r.noisy for label, r in runs},
        loader_paced={label: r.loader_paced() for label, r in runs},
    )


def draw_charts(runs: list[Run], mode: str, out: Path) -> dict[str, Path]:
    """The mode's PNGs: {"<chart>, <mode>": path}; the timeline leaves out runs whose steps cannot be read."""
    where = text.setting([r for _, r in runs])
    images = {
        f"1 ms per step, {mode}": charts.draw_stacked(
            runs, f"mode={mode}: where the median step's time goes — {where}", out / f"ms-per-step-{mode}.png"
        )
    }
    counts = charts.draw_counts(
        runs, f"mode={mode}: what the host does per region — {where}", out / f"counts-{mode}.png"
    )
    if counts:
        images[f"2 counts, {mode}"] = counts
    steps = []
    for label, record in runs:
        try:
            trace = record.folder / record.trace if record.trace else None
            found = load(record.folder, record, trace)
            for warning in found.left_out:
                print(f"warning: {warning}", file=sys.stderr)
            steps.append((label, StepModel(found)))
        except RecordError as err:
            print(f"warning: {label} left out of the timeline: {err}", file=sys.stderr)
    if steps:
        title = f"mode={mode}: the median step of each strategy — {where}"
        images[f"3 timeline, {mode}"] = draw_steps(steps, out / f"timeline-{mode}.png", title=title)
        title = f"mode={mode}: the bytes allocated over each strategy's median step — {where}"
        memory = draw_memory(steps, out / f"memory-{mode}.png", title=title)
        if memory:
            images[f"4 memory, {mode}"] = memory
    return images
