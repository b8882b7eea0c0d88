"""Verdicts: one strategy's profiled step against ``padded``'s, in an order that survives a noisy machine.

A verdict leads with what no load changes: first memory where the two differ (a region's peak rise, the step's peak
allocated, the allocations, device mallocs and retries; detector/lab/record/measures.py ``MEMORY_VERDICT``: the same
shapes allocate the same bytes), then per region the counts that differ (operators, slices, host reads, launches, syncs,
copies; ``STABLE``) as ratios. Then the time, by the one rule of detector/lab/present/tables.py: the step as training
runs it (the steps timed without the profiler), "N× slower" where the interquartile ranges do not overlap, "not
distinguishable on this machine" with both spreads where they do, and "not judged" where either run's noise check flags
it (detector/lab/record/noise.py ``Noise``), unless the two lie further apart than noise moves a step (BEYOND_NOISE),
and "not judged" where one run is loader-paced and the other is not (detector/lab/record/run.py ``LOADER_PACED_SHARE``:
the loader set the one's time, the step's own work the other's). Then the profiled step, and where it disagrees with
training's, what the profiler added to each side: its cost grows with the operators a strategy dispatches, so the
training verdict leads. Last, the region where the time went and the Traces tab's view of it.

``growth`` says how a strategy's counts grow with the batch, where the runs compared hold it at two batch
sizes or more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from detector.lab.present.tables import cell_text, significant, speedup, times
from detector.lab.record.measures import MEASURES, MEMORY_VERDICT, STABLE, format_value
from detector.lab.record.run import ProfileRecord
from detector.lab.record.spread import Spread
from detector.regions import DATA_WAIT, LOSS_REGIONS, STEP

BASELINE = "padded"
# A flagged pair's times are still judged where the slower step's q1 is at least this many times the faster's q3:
# the busiest machine the noise check was calibrated on (two busy loops beside a run on its 2 cores) spread the
# run's steps well short of a 2× gap between the two runs' quartiles (docs/measures.md, "Noise")
BEYOND_NOISE = 2.0
DIFFERENT = 1.2  # counts whose ratio is at least this (or one of them 0) differ; 129 against 132 operators do not


@dataclass(frozen=True)
class CountDiff:
    """One count of one region that differs between the baseline and a run (medians over the active steps)."""

    region: str
    measure: str
    base: float
    value: float

    @property
    def ratio(self) -> float:
        """How many times the baseline's count the run's is (inf where the baseline's is 0)."""
        return self.value / self.base if self.base else math.inf

    def weight(self) -> float:
        """How far from 1 the ratio is, either way: the order in which differences are named."""
        return math.inf if not self.base or not self.value else max(self.ratio, 1 / self.ratio)

    def text(self) -> str:
        header = MEASURES[self.measure].header
        value, base = format_value(self.measure, self.value), format_value(self.measure, self.base)
        if not self.base:
            return f"{value} {header} against none"
        if not self.value:
            return f"no {header} against {base}"
        if MEASURES[self.measure].unit == "memory" and self.ratio < 1:  # bytes are not "fewer"
            return f"the {header} {times(1 / self.ratio)} smaller ({value} against {base})"
        x = times(self.ratio) if self.ratio >= 1 else f"{times(1 / self.ratio)} fewer"
        return (
            f"{x} the {header} ({value} against {base})"
            if self.ratio >= 1
            else f"{x} {header} ({value} against {base})"
        )


def count_diffs(base: ProfileRecord, run: ProfileRecord) -> list[CountDiff]:
    """The counts that differ, per region of the step's own work, largest difference first."""
    found = []
    for region in LOSS_REGIONS:
        if not (base.stats(region) and run.stats(region)):
            continue
        for m in STABLE:
            a, b = base.median(region, m), run.median(region, m)
            if base.stats(region, m) is None or run.stats(region, m) is None or a == b:
                continue
            if not a or not b or max(a, b) / min(a, b) >= DIFFERENT:
                found.append(CountDiff(region, m, a, b))
    return sorted(found, key=lambda d: (-d.weight(), LOSS_REGIONS.index(d.region), STABLE.index(d.measure)))


def memory_diffs(base: ProfileRecord, run: ProfileRecord) -> list[CountDiff]:
    """The memory measures that differ (by DIFFERENT, as counts do), per region of the step's own work and the whole
    step: the regions by their largest difference, in each the peak first; none where either run recorded no memory."""
    found, regions = [], (*LOSS_REGIONS, STEP)
    cpu = not (base.analysis.gpu and run.analysis.gpu)  # the CPU's device mallocs are its allocations: named once
    for region in regions:
        for m in (m for m in MEMORY_VERDICT if not (cpu and m == "device_mallocs")):
            a, b = base.stats(region, m), run.stats(region, m)
            if a is None or b is None or a.median == b.median:
                continue
            if not a.median or not b.median or max(a.median, b.median) / min(a.median, b.median) >= DIFFERENT:
                found.append(CountDiff(region, m, a.median, b.median))
    largest = {}  # the regions in order of their largest difference; in each, the peak first
    for d in found:
        largest[d.region] = max(largest.get(d.region, 0.0), d.weight())
    key = lambda d: (-largest[d.region], regions.index(d.region), MEMORY_VERDICT.index(d.measure))  # noqa: E731
    return sorted(found, key=key)


def counts_text(diffs: list[CountDiff], regions: int = 3, per_region: int = 3) -> str:
    """``calc loss: 4.7× the operators (603 against 129), ...; backward: ...``, the regions in order of their
    largest difference."""
    if not diffs:
        return "the same counts in every region"
    order = list(dict.fromkeys(d.region for d in diffs))[:regions]
    parts = []
    for region in order:
        named = [d.text() for d in diffs if d.region == region][:per_region]
        parts.append(f"{region}: {', '.join(named)}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- times


@dataclass(frozen=True)
class Timing:
    """Two steps' spreads and what the rule makes of them: ``x`` the speed-up (base / run), None for ≈;
    ``noise`` the reasons either run's times cannot be judged."""

    base: Spread
    run: Spread
    x: float | None
    noise: tuple[str, ...] = ()
    pacing: str | None = None  # why the two are paced unlike (one by its loader): not judged, whatever their gap
    base_label: str = BASELINE  # the baseline run's label in compare (padded with its run where two share it)

    @property
    def judged(self) -> bool:
        return not self.pacing and (not self.noise or self.beyond_noise)

    @property
    def beyond_noise(self) -> bool:
        """Whether the two steps lie further apart than any noise measured here moves one (BEYOND_NOISE)."""
        fast, slow = sorted((self.base, self.run), key=lambda s: s.median)
        return fast.q3 > 0 and slow.q1 / fast.q3 >= BEYOND_NOISE

    def relation(self) -> str:
        if self.x is None:
            return "not distinguishable"
        way = "faster" if self.x > 1 else "slower"
        ratio = max(self.x, 1 / self.x)
        if ratio < 1.01:  # "1.00× faster" says nothing: the share does
            return f"{100 * (ratio - 1):.1f} % {way}"
        return f"{times(ratio)} {way}"

    def spreads(self, label: str) -> str:
        return f"{label} {spread_text(self.run)} ms against {cell_text(self.base_label)}'s {spread_text(self.base)}"


def spread_text(s: Spread) -> str:
    """``12.3 [12.1–12.6]``: a step's median [q1–q3] in ms, as the tables write it."""
    return f"{format_value('wall_ms', s.median)} [{format_value('wall_ms', s.q1)}–{format_value('wall_ms', s.q3)}]"


def noise_reasons(base: ProfileRecord, run: ProfileRecord, label: str, base_label: str) -> tuple[str, ...]:
    """``padded's run: <why>, <why>`` for each of the two runs whose noise check flags it."""
    found = []
    for record, name in ((base, base_label), (run, label)):
        reasons = record.noise_reasons()
        if reasons:
            found.append(f"{name}'s run: {', '.join(reasons)}")
    return tuple(found)


def paced_unlike(a: ProfileRecord, b: ProfileRecord) -> bool:
    """Whether exactly one of two runs is loader-paced: their times are then not of the same thing."""
    return (a.loader_paced() is None) != (b.loader_paced() is None)


def device_leads(records: list[ProfileRecord]) -> bool:
    """Whether a comparison's first time table is the device's: some run is on a GPU, and every GPU run's device
    paced its step (``ProfileRecord.leading_time``). Where a GPU run waits for its host, the host's time is its cost."""
    gpu = [r for r in records if r.analysis.gpu]
    return bool(gpu) and all(r.leading_time() == "gpu_ms" for r in gpu)


def host_ratio(base: ProfileRecord, record: ProfileRecord) -> bool:
    """Whether a host time of ``record`` gets a speed-up against ``base``'s: not where the device paced both steps,
    for the host then runs ahead and its time in a region is the time it took to launch it, or to wait for room in the
    launch queue, not what the region cost."""
    return not (base.leading_time() == "gpu_ms" and record.leading_time() == "gpu_ms")


def pacing_reason(base: ProfileRecord, run: ProfileRecord, label: str, base_label: str) -> str | None:
    """``padded's run is loader-paced (<why>), packed's is not: ...`` where exactly one of the two is; else None."""
    if not paced_unlike(base, run):
        return None
    (name, record), other = ((base_label, base), label) if base.loader_paced() else ((label, run), base_label)
    why = record.loader_paced()
    return f"{name}'s run is loader-paced ({why}), {other}'s is not: the loader, not the loss, set its time"


def trained(base: ProfileRecord, run: ProfileRecord, label: str, base_label: str) -> Timing | None:
    """The steps timed without the profiler, as training runs them."""
    a, b = base.timed_step(), run.timed_step()
    if not (a and b):
        return None
    noise, pacing = noise_reasons(base, run, label, base_label), pacing_reason(base, run, label, base_label)
    return Timing(a, b, speedup(a, b), noise, pacing, base_label)


def profiled(base: ProfileRecord, run: ProfileRecord, label: str, base_label: str) -> Timing:
    """The profiled step: on a GPU the device's step (the host, running ahead, paces its steps by the launch
    queue); on the CPU the host's, which must also differ without the data wait (the loader is not the
    strategy)."""
    noise, pacing = noise_reasons(base, run, label, base_label), pacing_reason(base, run, label, base_label)
    a, b = base.stats(STEP, "device_step_ms"), run.stats(STEP, "device_step_ms")
    if a and b:
        return Timing(a, b, speedup(a, b), noise, pacing, base_label)
    a, b = base.stats(STEP), run.stats(STEP)
    return Timing(a, b, host_speedup(base, run), noise, pacing, base_label)


def host_speedup(base: ProfileRecord, run: ProfileRecord) -> float | None:
    """The host step's speed-up, None (≈) where it is not one without the data wait too."""
    x = speedup(base.stats(STEP), run.stats(STEP))
    y = speedup(without_data_wait(base), without_data_wait(run))
    if x is None or y is None or (x > 1) != (y > 1):
        return None
    return x


def without_data_wait(record: ProfileRecord) -> Spread:
    """The spread over the active steps of the step's wall time less its data wait."""
    return Spread.of(
        s.regions[STEP]["wall_ms"] - s.regions.get(DATA_WAIT, {}).get("wall_ms", 0.0) for s in record.per_step
    )


def profiler_cost(record: ProfileRecord) -> float | None:
    """The profiled step's median over the step timed without the profiler, less 1: what profiling added."""
    timed, step = record.timed_step(), record.profiled_step()
    return step.median / timed.median - 1 if timed and step and timed.median > 0 else None


def disagree(a: Timing, b: Timing) -> bool:
    """Whether two judged timings say different things (one ≈ where the other is not, or opposite ways)."""
    if a.x is None or b.x is None:
        return (a.x is None) != (b.x is None)
    return (a.x > 1) != (b.x > 1)


# ----------------------------------------------------------------------------- where the time went


def device_bound(record: ProfileRecord) -> bool:
    """Whether the device was busy nearly all of the run's step (detector/lab/record/noise.py DEVICE_BOUND_IDLE)."""
    return record.paced_by() == "device"


def moved_most(base: ProfileRecord, run: ProfileRecord, faster: bool) -> tuple[str, float] | None:
    """(region, ms) where a step differs most from the baseline's in the verdict's direction (``faster``: the
    region that gained most; else the one that lost most). A region costs the larger of its wall and GPU ms,
    or its GPU ms alone where both steps kept the device busy: a host running ahead then waits wherever the
    launch queue is full, so its regions' wall times say where it waited, not what the region cost."""
    gpu_only = device_bound(base) and device_bound(run)

    def cost(r: ProfileRecord, region: str) -> float:
        gpu = r.median(region, "gpu_ms")
        return gpu if gpu_only else max(r.median(region), gpu)

    deltas = {r: cost(run, r) - cost(base, r) for r in LOSS_REGIONS if run.stats(r) and base.stats(r)}
    deltas = {r: d for r, d in deltas.items() if d and (d < 0) == faster}
    if not deltas:
        return None
    region = max(deltas, key=lambda r: abs(deltas[r]))
    return region, deltas[region]


# ----------------------------------------------------------------------------- the verdict


@dataclass
class Verdict:
    """One run against the baseline: the counts that differ, the trained and profiled timings, and the region
    where the time went (or, where the times cannot tell, where the counts differ most)."""

    label: str
    counts: list[CountDiff]
    trained: Timing | None
    profiled: Timing
    region: str | None
    moved_ms: float | None
    costs: tuple[float | None, float | None]  # what the profiler added to the baseline's step and the run's
    emulated: str | None = None
    memory: list[CountDiff] = field(default_factory=list)  # the memory measures that differ, which lead

    def leading(self) -> Timing:
        """The timing the verdict goes by: training's where the run has it."""
        return self.trained or self.profiled

    def line(self) -> str:
        """The verdict as one markdown bullet (its label, and each text naming it, escaped: it comes from a file)."""
        label = cell_text(self.label)
        memory = f"{counts_text(self.memory, per_region=2)}. " if self.memory else ""
        counts = counts_text(self.counts)
        if memory and not self.counts:  # a sentence of its own after the memory's
            counts = counts.capitalize()
        parts = [f"- **{label}** — {memory}{counts}."]
        parts.append(self.time_sentence(label))
        if self.trained and disagree(self.trained, self.profiled) and self.profiled.judged:
            parts.append(self.profiler_sentence(label))
        elif not self.trained:
            parts.append("(Not timed without the profiler: the profiled step is all there is.)")
        if self.emulated:
            parts.append(f"Its times are not its kernels': {cell_text(self.emulated)} here.")
        if self.region:
            parts.append(f"Traces tab: align on *{self.region}*.")
        return " ".join(parts)

    def time_sentence(self, label: str) -> str:
        timing = self.leading()
        how = "as training runs it" if self.trained else "profiled"
        noise = cell_text("; ".join(timing.noise))  # the runs' labels among the reasons
        if timing.pacing:
            return f"Times {how} not judged: {cell_text(timing.pacing)} ({timing.spreads(label)})."
        if not timing.judged:
            return f"Times {how} not judged, the noise check flags them — {noise} ({timing.spreads(label)})."
        if timing.x is None:
            return f"{how.capitalize()}: not distinguishable on this machine ({timing.spreads(label)})."
        where = ""
        if self.moved_ms is not None:
            sign = "+" if self.moved_ms > 0 else "-"
            where = f", most of it in {self.region} ({sign}{format_value('wall_ms', abs(self.moved_ms))} ms)"
        if timing.noise:
            where += f"; a gap beyond the noise the check flags — {noise}"
        return f"{how.capitalize()}: {timing.relation()} ({timing.spreads(label)}){where}."

    def profiler_sentence(self, label: str) -> str:
        if all(c is not None and abs(c) < 0.01 for c in self.costs):  # the profiler left both steps as they were
            return (
                f"Profiled: {self.profiled.relation()}, a difference the profiler's window alone shows (it added "
                f"under 1 % to either step); the training verdict stands."
            )
        base, run = (f"{100 * c:+.0f} %" if c is not None else "an unknown share" for c in self.costs)
        return (
            f"Profiled: {self.profiled.relation()}, because the profiler added {run} to {label}'s step and {base} "
            f"to {cell_text(self.profiled.base_label)}'s (its cost grows with the operators dispatched); the training "
            "verdict stands."
        )


def judge(base: ProfileRecord, run: ProfileRecord, label: str, base_label: str = BASELINE) -> Verdict:
    """The verdict on ``run`` against ``base`` (see the module docstring); ``base_label``: the baseline's label in
    the comparison, which names it in the verdict's sentences."""
    counts = count_diffs(base, run)
    train, prof = trained(base, run, label, base_label), profiled(base, run, label, base_label)
    lead = train or prof
    region, moved = None, None
    if lead.judged and lead.x is not None and not (train and disagree(train, prof)):
        found = moved_most(base, run, faster=lead.x > 1)
        if found:
            region, moved = found
    if region is None and counts:
        region = counts[0].region  # the times cannot tell: where the counts differ most
    costs = (profiler_cost(base), profiler_cost(run))
    return Verdict(label, counts, train, prof, region, moved, costs, run.emulated, memory_diffs(base, run))


def judge_all(runs: list[tuple[str, ProfileRecord]], base: ProfileRecord | None) -> dict[str, Verdict]:
    """The verdict on each run of ``base``'s setting against it, by label (``runs``: [(label, record)], the baseline
    among them); none without a baseline."""
    if base is None:
        return {}
    base_label = next(label for label, record in runs if record is base)
    return {
        label: judge(base, record, label, base_label)
        for label, record in runs
        if record is not base and setting(record) == setting(base)
    }


def verdict_lines(
    runs: list[tuple[str, ProfileRecord]], base: ProfileRecord | None, verdicts: dict[str, Verdict]
) -> list[str]:
    """One line per run after the baseline: its verdict (``verdicts``, judge_all's), or why it has none."""
    if base is None:
        return [f"(no {BASELINE} run in this setting: no verdicts)"]
    lines = []
    for label, record in runs:
        if record is base:
            continue
        if label in verdicts:
            lines.append(verdicts[label].line())
        else:
            device, batch, side = setting(record)
            lines.append(
                f"- **{cell_text(label)}** — no {BASELINE} run at batch {batch}, {side} px on {cell_text(device)}: "
                "not judged."
            )
    return lines


def setting(record: ProfileRecord) -> tuple:
    """What two runs must share to be judged against each other: the device, the batch and the image size."""
    return record.device, record.batch_size, record.image_size


def profiler_note(record: ProfileRecord) -> str:
    """One line: the step as training runs it against the profiled step, and what profiling added to it (the
    profiler, and the article's syncs under profile.sync_regions).

    On a GPU the profiled step compared is the device's (first kernel to the next step's first kernel): the
    timed steps are CUDA-event times of the device too, while the host's ProfilerStep jitters with how far
    the host runs ahead of the device. On the CPU both are host times."""
    timed, step = record.timed_step(), record.profiled_step()
    if not timed:
        return "No steps were timed without the profiler (profile.timed=0)."
    where = " on the device" if record.stats(STEP, "device_step_ms") else ""
    ratio = step.median / timed.median
    cause = "the synchronised regions and the profiler" if record.sync_regions else "the profiler"
    text = (
        f"As training runs it (no profiler, no regions; {timed.n} steps): step {spread_text(timed)} ms. "
        f"The profiled step{where} is {ratio:.2f}× that"
    )
    if ratio >= 1:
        text += f": {cause} add{'s' if cause == 'the profiler' else ''} {100 * (ratio - 1):+.0f} %."
    else:  # a profiler cannot make a step faster: the two samples differ by their noise
        text += f" ({100 * (1 - ratio):.0f} % shorter: the profiled and the timed steps differ by their noise)."
    wait = record.stats(STEP, "sync_wait_ms")
    if record.sync_regions and wait:
        text += f" The regions' closing synchronize kept the host waiting {significant(wait.median)} ms per step."
    return text


def loader_note(record: ProfileRecord) -> str | None:
    """One line where the loader paced the run's step (detector/lab/record/run.py ``LOADER_PACED_SHARE``), else None."""
    why = record.loader_paced()
    if why is None:
        return None
    return (
        f"**Loader-paced**: {why}: the loader, not the step's own work, set its time; compare does not judge it "
        "against a run the loader does not pace."
    )


def noise_note(record: ProfileRecord) -> str:
    """One line: the load the run ran under, and whether its times can be compared."""
    if record.noise is None:
        return "The machine's noise was not recorded (a run of an older version)."
    reasons = record.noise_reasons()
    verdict = f"**noisy**: {'; '.join(reasons)}" if reasons else "quiet"
    return f"Noise: {verdict} ({record.noise.describe()})."


# ----------------------------------------------------------------------------- growth with the batch


def growth(runs: list[tuple[str, ProfileRecord]]) -> list[str]:
    """How each strategy's counts grow with the batch, for the strategies that the runs hold at two batch sizes
    or more: per region and count, the values at each batch and whether they stay, grow with it or faster."""
    by_strategy: dict[str, dict[int, ProfileRecord]] = {}
    for _, record in runs:
        by_strategy.setdefault(record.strategy, {}).setdefault(record.batch_size, record)
    lines = []
    for strategy, by_batch in by_strategy.items():
        if len(by_batch) < 2:
            continue
        batches = sorted(by_batch)
        small, large = by_batch[batches[0]], by_batch[batches[-1]]
        named = []
        for region in LOSS_REGIONS:
            for m in STABLE:
                a, b = small.median(region, m), large.median(region, m)
                if a and b:
                    exponent = math.log(b / a) / math.log(batches[-1] / batches[0])
                    trend = (
                        "stays"
                        if abs(exponent) < 0.15
                        else "grows with the batch"
                        if exponent < 1.3
                        else "grows faster than the batch"
                    )
                    values = ", ".join(f"{format_value(m, by_batch[n].median(region, m))} at {n}" for n in batches)
                    named.append(f"{region} {MEASURES[m].header} {trend} ({values})")
        if named:
            lines.append(f"- **{cell_text(strategy)}**: " + "; ".join(named[:6]) + ".")
    return lines
