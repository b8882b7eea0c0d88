"""The lab's markdown: a profile run's card (what `make profile` prints and TensorBoard's Text tab shows) and
a comparison's tables (`make compare`). Every cell is a measure of detector/lab/record/measures.py, formatted in
its unit, "median [q1–q3]" over the active steps; a measure that is zero in every region of every run shown
is not written, and a CPU run says once which measures need a GPU. The memory tables show every memory measure,
"none" where it does not exist on the run's device (the CPU's allocator neither caches, reserves nor retries).
A table too wide for a window (TensorBoard's Text tab at 1,280 px, a terminal) is split by its columns into tables
that fit, each repeating its label columns (tables.py ``markdown_tables``).
"""

from __future__ import annotations

from detector.lab.present.tables import cell_text, code_text, markdown_table, markdown_tables, speedup, times
from detector.lab.present.verdicts import (
    BASELINE,
    device_leads,
    host_ratio,
    host_speedup,
    loader_note,
    noise_note,
    paced_unlike,
    profiler_note,
)
from detector.lab.record.measures import (
    MEASURES,
    MEMORY,
    STEP_ONLY,
    WHY,
    absent_gpu_measures,
    format_value,
    gpu_note,
    legend,
    memory_note,
    present,
)
from detector.lab.record.run import ProfileRecord, device_paced, representative_step
from detector.lab.record.spread import Spread
from detector.regions import DATA_WAIT, REGIONS, STEP

TIME = ("wall_ms", "queue_wait_ms", "gpu_ms", "device_step_ms", "gpu_idle_share")  # a run table's first columns


def stats_cell(name: str, stats: Spread | None) -> str:
    """``12.3 [12.1–12.6]``: the median [q1–q3] of a measure in its unit; one value where they print the same."""
    if not stats:
        return "–"
    median, q1, q3 = (format_value(name, v) for v in (stats.median, stats.q1, stats.q3))
    return median if q1 == q3 == median else f"{median} [{q1}–{q3}]"


def run_table(record: ProfileRecord) -> str:
    """Regions x measures of one run: its time, the leading one first (``ProfileRecord.leading_time``: GPU ms where the
    device paced the step, else wall ms), then every why measure that is not zero throughout; in tables that fit a
    window, each repeating the region."""
    names = run_columns(record)
    rows = [[region] + [stats_cell(n, record.stats(region, n)) for n in names] for region in record.regions()]
    return markdown_tables(["region"] + [MEASURES[n].header for n in names], rows)


def run_columns(record: ProfileRecord) -> list[str]:
    """The measures of a run's table, in its order: the leading time first, the others as TIME and WHY list them."""
    lead = record.leading_time()
    return sorted(present([record], TIME + WHY), key=lambda n: n != lead)  # a stable sort: the rest keep their order


def run_card(record: ProfileRecord) -> str:
    """The run's Text card: what ran, its table, the step as training runs it, the loader, the noise and the
    warnings."""
    analysis = record.analysis
    size = f"{record.image_size or '?'} px, {record.max_boxes or '?'} box slots, boxes: {cell_text(boxes_of(record))}"
    protocol = "regions synchronised (profile.sync_regions)" if record.sync_regions else "regions unsynchronised"
    lines = [
        f"**{cell_text(record.title())}** ({size}, preset {cell_text(record.preset or '?')}, {protocol}), "
        f"run {code_text(record.run or '?')}",
        "",
        f"Median [q1–q3] over {analysis.steps} active steps (ProfilerStep {analysis.step_numbers}); "
        f"the timeline shows step {analysis.representative_step} ({representative_of(record)}).",
        "",
        run_table(record),
        "",
        *([f"What paced the step: {record.pacing_text()}.", ""] if record.analysis.gpu else []),
        profiler_note(record),
        "",
        noise_note(record),
    ]
    lines += ["", record.loader_fill.describe()] if record.loader_fill else []
    paced = loader_note(record)
    lines += ["", paced] if paced else []
    missing = gpu_note(absent_gpu_measures([record], TIME + WHY))
    lines += ["", missing] if missing else []
    lines += ["", legend(run_columns(record))]
    lines += memory_card(record)
    lines += [f"\n**warning**: {cell_text(w)}" for w in analysis.warnings + record.left_out]
    return "\n".join(lines)


def representative_of(record: ProfileRecord) -> str:
    """How the run's representative step was picked: where the device paced the steps, the step nearest the medians of
    the device step and the wall time (detector/lab/record/run.py ``representative_step``); else, and in a run recorded
    before that rule, the median wall time."""
    device = device_paced(record.per_step) and representative_step(record.per_step).step == (
        record.analysis.representative_step
    )
    return "nearest the medians of the device step and the wall time" if device else "median wall time"


NONE = "none"  # a memory measure that does not exist on the run's device (not 0: nothing was counted)


def memory_cell(record: ProfileRecord, region: str, name: str, spread: bool = True) -> str:
    """A memory table's cell: "none" where the measure does not exist on the run's device, blank where it is the whole
    step's only, else the median [q1–q3] (the median alone without ``spread``)."""
    if MEASURES[name].gpu_only and not record.analysis.gpu:
        return NONE
    if name in STEP_ONLY and region != STEP:
        return ""
    stats = record.stats(region, name)
    return stats_cell(name, stats) if spread else format_value(name, stats.median if stats else None)


def memory_card(record: ProfileRecord) -> list[str]:
    """The card's memory section: regions x every memory measure, or one line where the run recorded none."""
    if not record.stats(STEP, "peak_bytes"):
        return ["", memory_note([record])]
    rows = [[region] + [memory_cell(record, region, n) for n in MEMORY] for region in record.regions()]
    lines = [
        "",
        f"Memory on {cell_text(record.device)}, median [q1–q3] per step:",
        "",
        markdown_tables(["region"] + [MEASURES[n].header for n in MEMORY], rows),
    ]
    note = memory_note([record])
    return lines + (["", note] if note else []) + ["", legend(MEMORY)]


def memory_table(runs: list[tuple[str, ProfileRecord]]) -> str:
    """Per region and strategy: the medians of every memory measure ("none" where it does not exist on a run's
    device); a region no run allocated in has no rows, the step always."""
    records = [r for _, r in runs]
    rows = []
    for region in regions_of(records):
        if region != STEP and not any(r.median(region, "allocs") for r in records):
            continue
        for label, record in runs:
            if record.stats(region):
                cells = [memory_cell(record, region, n, spread=False) for n in MEMORY]
                rows.append([region, label] + cells)
    headers = ["region", "strategy"] + [MEASURES[n].header for n in MEMORY]
    return markdown_tables(headers, rows, "ll" + "r" * len(MEMORY), keep=2)


def boxes_of(record: ProfileRecord) -> str:
    """Where a run's boxes came from and what its slots cut (a summary from before data.boxes: synthetic)."""
    return record.data.describe() if record.data else "synthetic"


def data_note(runs: list[tuple[str, ProfileRecord]]) -> str | None:
    """A line where the runs' boxes came from different sources: their times are not of the same work."""
    sources = {label: boxes_of(r) for label, r in runs}
    if len(set(sources.values())) < 2:
        return None
    listed = "; ".join(f"{cell_text(label)}: {cell_text(source)}" for label, source in sources.items())
    return f"**Runs over different boxes** (their times are of different work): {listed}."


# ----------------------------------------------------------------------------- a comparison's tables


def setting(records: list[ProfileRecord]) -> str:
    """``batch 1024, NVIDIA H200, torch 2.11.0`` (each distinct setting, joined, when runs differ)."""
    found = dict.fromkeys(f"batch {r.batch_size}, {r.device}, torch {r.torch}" for r in records)
    return cell_text("; ".join(found))


def runs_table(runs: list[tuple[str, ProfileRecord]]) -> str:
    headers = ["strategy", "mode", "device", "torch", "batch", "image px", "regions", "steps", "noise", "run folder"]
    rows = []
    for _, r in runs:
        protocol = "synchronised" if r.sync_regions else "as training"
        noise = "unknown" if r.noise is None else ("noisy" if r.noisy else "quiet")
        rows.append([r.strategy, r.mode, r.device, r.torch, r.batch_size, r.image_size or "?", protocol])
        rows[-1] += [r.analysis.steps, noise, code_text(r.folder), r.max_boxes or "?", boxes_of(r)]
    return markdown_tables(headers + ["slots", "boxes"], rows, "lllllrlrllrl")


def regions_of(records: list[ProfileRecord]) -> list[str]:
    return [region for region in REGIONS if any(r.stats(region) for r in records)]


def time_table(runs: list[tuple[str, ProfileRecord]], base: ProfileRecord | None, measure: str) -> str:
    """Regions x strategies: ``measure`` (wall_ms or gpu_ms) "median [q1–q3] · speed-up vs padded"; the GPU table ends
    with the step on the device, the wall table with the host's wait for room in the launch queue where it waited; the
    first of the two (``device_leads``) ends with the step as training runs it."""
    records = [r for _, r in runs]
    rows = []
    for region in regions_of(records):
        if measure == "gpu_ms" and (region == DATA_WAIT or not any(r.median(region, measure) for r in records)):
            continue  # the loader's copies are not the strategy's work; a region without GPU work has no row
        name = f"**{region}**" if region == STEP else region
        rows.append([name] + [time_cell(r, base, region, measure) for r in records])
    if measure == "gpu_ms":
        rows.append(["**step, on the device**"] + [time_cell(r, base, STEP, "device_step_ms") for r in records])
    if measure == "wall_ms" and any(r.median(STEP, "queue_wait_ms") for r in records):
        rows.append(["of the step: waiting for room in the launch queue"] + [wait_cell(r) for r in records])
    if (measure == "gpu_ms") == device_leads(records):
        rows.append(["**step, as training runs it**"] + [timed_cell(r, base) for r in records])
    return markdown_table(["region"] + [label for label, _ in runs], rows)


def wait_cell(record: ProfileRecord) -> str:
    """The step's queue wait, median [q1–q3], and its share of the host's step."""
    wait, step = record.stats(STEP, "queue_wait_ms"), record.stats(STEP)
    if not wait:
        return stats_cell("queue_wait_ms", wait)
    share = f" ({100 * wait.median / step.median:.0f} %)" if step and step.median > 0 else ""
    return stats_cell("queue_wait_ms", wait) + share


def time_cell(record: ProfileRecord, base: ProfileRecord | None, region: str, measure: str) -> str:
    """``12.3 [12.1–12.6] · 2×``: the median [q1–q3], then the speed-up against the baseline (none on a host time
    where the device paced both steps: ``host_ratio``)."""
    s = record.stats(region, measure)
    cell = stats_cell(measure, s)
    if not s or base is None or base is record or not base.stats(region, measure):
        return cell
    if measure == "wall_ms" and not host_ratio(base, record):
        return cell
    if region == STEP and paced_unlike(base, record):
        return f"{cell} · not judged"  # one of the two is loader-paced: the verdicts say which
    if region == STEP and measure == "wall_ms":
        return f"{cell} · {times(host_speedup(base, record))}"
    return f"{cell} · {times(speedup(base.stats(region, measure), s))}"


def timed_cell(record: ProfileRecord, base: ProfileRecord | None) -> str:
    s = record.timed_step()
    cell = stats_cell("wall_ms", s)
    if s and base is not None and base is not record and base.timed_step():
        cell += " · not judged" if paced_unlike(base, record) else f" · {times(speedup(base.timed_step(), s))}"
    return cell


def pacing_lines(runs: list[tuple[str, ProfileRecord]]) -> list[str]:
    """One line: what paced each GPU run's step, from its trace (``ProfileRecord.pacing_text``); none on the CPU."""
    paced = [f"{cell_text(label)}: {r.pacing_text()}" for label, r in runs if r.analysis.gpu]
    return ["", f"**What paced each step**: {'; '.join(paced)}."] if paced else []


def why_table(runs: list[tuple[str, ProfileRecord]], names: list[str]) -> str:
    """Per region and strategy: the medians of the why measures ``names``; a region in which every one of them
    is zero in every run has no rows."""
    rows = []
    records = [r for _, r in runs]
    for region in regions_of(records):
        if region != STEP and not any(r.median(region, m) for r in records for m in names):
            continue
        for label, record in runs:
            if record.stats(region):
                rows.append([region, label] + [format_value(m, record.median(region, m)) for m in names])
    headers = ["region", "strategy"] + [MEASURES[m].header for m in names]
    return markdown_tables(headers, rows, "ll" + "r" * len(names), keep=2)


TIMED_ROW = " The last row: the steps timed without the profiler (by CUDA events on a GPU), the verdict's."


def host_section(runs: list[tuple[str, ProfileRecord]], base: ProfileRecord | None) -> list[str]:
    """The host's time per region: the comparison's first table where the host paced the steps (the CPU, or a GPU
    waiting for its host); else the time the host took to launch each region, without speed-ups (``host_ratio``)."""
    if device_leads([r for _, r in runs]):
        heading = "### Host ms per step: the time to launch each region"
        text = (
            "The device paced these steps: the host ran steps ahead of it, so a region's time here is the time the "
            "host took to launch its work, and where the launch queue was full, to wait for room in it (its own row), "
            "not what the region cost: that is its GPU ms above, and no speed-up is given here. Median [q1–q3] over "
            "the active steps."
        )
    else:
        heading = "### Wall ms per step (host)"
        text = (
            "Median [q1–q3] over the active steps; `· 2×` = padded's median / this median where the interquartile "
            "ranges do not overlap, `· ≈` where they do, `· not judged` on a step where one of the two runs is "
            "loader-paced. The step's verdict must also hold without the data wait (the loader's, shown on its own "
            "line)." + TIMED_ROW
        )
    return ["", heading, "", text, "", time_table(runs, base, "wall_ms")]


def device_section(runs: list[tuple[str, ProfileRecord]], base: ProfileRecord | None) -> list[str]:
    """The GPU time each region launched (none without a GPU run): where the device paced the steps, each region's
    cost and the comparison's first table."""
    records = [r for _, r in runs]
    if not any(r.analysis.gpu for r in records):
        return []
    text = (
        "The kernels, copies and memsets each region launched, whenever they ran: where the device paces the step, "
        "each region's cost. Median [q1–q3] over the active steps; `· 2×` = padded's median / this median where the "
        "interquartile ranges do not overlap, `· ≈` where they do. The step on the device runs from the start of its "
        "first GPU work to the next step's: the profiled step's verdict."
    )
    text += TIMED_ROW if device_leads(records) else ""
    return ["", "### GPU ms per step (device)", "", text, "", time_table(runs, base, "gpu_ms")]


def mode_markdown(
    mode: str, runs: list[tuple[str, ProfileRecord]], base: ProfileRecord | None, verdicts, growth
) -> str:
    """One mode's section of compare.md: the verdicts, then the tables that back them."""
    records = [r for _, r in runs]
    why = present(records, WHY)
    lines = [f"## mode={mode} — {setting(records)}", "", "### Verdicts", ""]
    lines += [
        f"Each strategy against {BASELINE}: first the memory and the counts that no load changes, then the time by the "
        "rule below (`≈`: not distinguishable on this machine), then what the profiler added where the two disagree.",
        "",
        *verdicts,
    ]
    mixed = data_note(runs)
    lines += ["", mixed] if mixed else []
    noisy = [label for label, r in runs if r.noisy]
    if noisy:
        lines += ["", f"**Noisy runs** (their times are not judged): {', '.join(map(cell_text, noisy))}."]
    paced = [f"{cell_text(label)}: loader-paced: {r.loader_paced()}" for label, r in runs if r.loader_paced()]
    if paced:
        lines += [
            "",
            "**Loader-paced runs** (the loader, not the step's own work, set their time; not judged against a run "
            f"the loader does not pace): {'; '.join(paced)}.",
        ]
    lines += pacing_lines(runs)
    lines += ["", "### How the counts grow with the batch", "", *growth] if growth else []
    tables = [host_section(runs, base), device_section(runs, base)]
    lines += [line for table in (tables[::-1] if device_leads(records) else tables) for line in table]
    if any(r.stats(STEP, "peak_bytes") for r in records):
        lines += ["", f"### Memory (mode={mode}): medians per step", "", memory_table(runs), "", legend(MEMORY)]
    note = memory_note(records)
    lines += ["", note] if note else []
    lines += ["", f"### Why (mode={mode}): medians per step", "", why_table(runs, why)]
    missing = gpu_note(absent_gpu_measures(records, WHY + ("gpu_ms",)))
    lines += ["", missing] if missing else []
    lines += ["", legend(why)]
    for label, record in runs:
        lines += [
            f"\n**warning** ({cell_text(label)}): {cell_text(w)}" for w in record.analysis.warnings + record.left_out
        ]
    return "\n".join(lines)
