"""Per-step, per-region measures of a profile's trace (detector/lab/measure/trace.py), checked against each other.

Every measure is defined once, in detector/lab/record/measures.py. How a region's measures are found
(``measure_steps``):

- Host side: the calls and operators that *start* inside the region's time span, on any thread of the
  profiled process (the autograd engine launches the backward from its own threads, whatever they are
  named). Each is counted in exactly one of the regions, "other" included, so counts add up to the step.
- Device side: a kernel, copy or memset belongs to the region whose call launched it (the trace links
  them by a correlation id), whenever it ran; so does a collective (an NCCL kernel), whose time, bytes and
  the share of it that other kernels ran beside (``comm_*``) are measured apart as well. The host runs
  ahead of the device as in training, so a region's GPU ms may run long after its wall time has ended; the
  step's GPU idle share is the part of its wall time in which the device ran nothing at all. When the profiler's
  window opens, the device still runs work launched before it, which the trace does not hold: the gap before a
  stream's first recorded event counts as busy where that event waited behind earlier work (trace.py
  ``_unrecorded_at_opening``), so the first step's idle is not the device's busiest time.
- Queue wait: the host's time in kernel launches that waited for room in the launch queue (QUEUE_BLOCKED_US). A
  host that runs as far ahead as the queue allows blocks there, in whichever region is launching: that region's
  wall time then holds the wait, not its cost, and on such a step a region's cost is its GPU ms.

- Memory: the allocator's events (trace.py ``Memory``) that fall in the region's time span, on any thread: the
  bytes live when it began, the most allocated at once in it (its peak, and how far that rose above the start),
  the allocations and their bytes; a GPU's device mallocs and frees are its CUDA calls (cudaMalloc, cudaFree),
  the CPU's every allocation and free (its allocator caches nothing). The caching allocator's retries are not in
  the trace: `make profile` reads them from torch.cuda.memory_stats around each step (``allocator_checks``).

``check_steps`` tests what must hold whatever the strategy, and returns a warning for each violation
(never a silent number): the regions and "other" add up to the step, every region with kernels has
launches, every launch has its kernel, every GPU event in the active steps has the call that
launched it, and no step's GPU idle share is contradicted by the steps beside it (``_idle_checks``); each memory
event's total follows from the one before, no region's peak rises further than it
allocated, and the step's peak is its regions' highest. On a GPU, ``allocator_checks`` holds the trace against
the allocator's own statistics of each step: the bytes live at its start, its peak and its device mallocs.
``summarise`` gives each measure's median, quartiles (``statistics.quantiles``, inclusive method), min, max
and n over the steps: the run record's ``Analysis`` (detector/lab/record/run.py), as summary.json holds it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from pathlib import Path

from detector.lab.measure.trace import (
    DEVICE_FREES,
    DEVICE_MALLOCS,
    LAUNCHES,
    STEP_NAME,
    SYNC_CANDIDATES,
    Trace,
    busy_us,
    call_range,
    covered_us,
    is_collective,
    is_sync,
    load_trace,
    merge_intervals,
    step_regions,
    step_threads,
)
from detector.lab.record.measures import ADDITIVE, MEASURES, OF_OPERATORS
from detector.lab.record.run import Analysis, StepMeasures, representative_step
from detector.lab.record.spread import Spread
from detector.regions import PARTS, REGIONS, STEP

# A kernel launch that finds room in the device's launch queue returns within tens of microseconds; one that finds the
# queue full waits until a queued kernel finishes, up to milliseconds where the kernels are long. Launches between
# the two are rare (in H100 traces of the seed scale, 10 of 1,791 lay between 0.1 and 0.2 ms), so a call longer
# than this waited for room: the host had run as far ahead of the device as the queue lets it
QUEUE_BLOCKED_US = 200.0


def measure_region(trace: Trace, threads: list, spans: list[tuple[float, float]], whole_step: bool = False) -> dict:
    """Every measure (detector/lab/record/measures.py) of a region made of ``spans``; GPU-only ones None without GPU
    events."""
    total, launched = Counter(), []
    for start, end in spans:
        total["wall_ms"] += end - start
        for tid in threads:
            _count_calls(trace, tid, start, end, total, launched)
            _count_ops(trace, tid, start, end, total)
    out = {name: total[name] for name in MEASURES}
    for name in ("wall_ms", "runtime_ms", "sync_wait_ms", "queue_wait_ms"):
        out[name] = total[name] / 1e3  # µs -> ms
    out["gpu_ms"] = merge_intervals(sorted(launched, key=lambda g: (g.ts, g.end)))[2][-1] / 1e3
    out.update(_communication(trace, launched))
    out["gpu_idle_share"] = out["device_step_ms"] = None  # the step's alone (measure_steps sets the period)
    if whole_step and out["wall_ms"] > 0:
        (start, end), *_ = spans
        out["gpu_idle_share"] = 1.0 - busy_us(trace, start, end) / (end - start)
    out.update(memory_measures(trace, spans, whole_step))
    if not trace.has_gpu:
        out.update({name: None for name, m in MEASURES.items() if m.gpu_only})
    return out


def memory_measures(trace: Trace, spans: list[tuple[float, float]], whole_step: bool = False) -> dict:
    """The memory measures (measures.py) of a region made of ``spans``: None where the trace has no memory events;
    a GPU's device mallocs and frees (its CUDA calls) are counted with the calls, as is the allocator's retries
    (``allocator_checks``). Over several spans, the highest peak and the largest rise of any."""
    memory, out = trace.memory, {"alloc_retries": None, "reserved_free_bytes": None}
    if memory is None:
        cpu = {} if trace.has_gpu else {"device_mallocs": None, "device_frees": None}
        return out | cpu | {"peak_bytes": None, "peak_rise_bytes": None, "alloc_bytes": None, "allocs": None}
    peak, rise, last = 0, 0, None
    totals = dict.fromkeys(memory.counts, 0)
    for start, end in spans:
        i, j = bisect_left(memory.ts, start), bisect_left(memory.ts, end)
        level = memory.level(i)
        top = max(level, max(memory.allocated[i:j], default=level))
        peak, rise = max(peak, top), max(rise, top - level)
        for name, prefix in memory.counts.items():
            totals[name] += prefix[j] - prefix[i]
        last = j
    out |= {
        "peak_bytes": peak,
        "peak_rise_bytes": rise,
        "alloc_bytes": totals["alloc_bytes"],
        "allocs": totals["allocs"],
    }
    if not trace.has_gpu:  # c10's CPU allocator asks the system for every allocation and gives every free back
        out |= {"device_mallocs": totals["allocs"], "device_frees": totals["frees"]}
    elif whole_step and last:
        out["reserved_free_bytes"] = memory.reserved[last - 1] - memory.allocated[last - 1]
    return out


def _communication(trace: Trace, launched: list) -> dict:
    """comm_ms, comm_bytes and comm_hidden_share of the collectives among ``launched`` (measures.py)."""
    collectives = sorted((g for g in launched if is_collective(g)), key=lambda g: (g.ts, g.end))
    merged = merge_intervals(collectives)
    comm_us = merged[2][-1]
    hidden_us = sum(covered_us(trace.compute, start, end) for start, end in zip(merged[0], merged[1], strict=True))
    return {
        "comm_ms": comm_us / 1e3,
        "comm_bytes": sum(trace.message_bytes.get(g, 0) for g in collectives),
        "comm_hidden_share": hidden_us / comm_us if comm_us else None,
    }


def _count_calls(trace: Trace, tid, start: float, end: float, out: Counter, launched: list) -> None:
    """Add the CUDA calls on ``tid`` that start in [start, end) to ``out``; collect their GPU work."""
    calls, lab = trace.calls.get(tid, []), trace.lab_syncs.get(tid, ())
    lo, hi = call_range(trace, tid, start, end)
    covered = start  # runtime_ms is a union: a driver call nested in a runtime call counts once
    launches = syncs = 0  # locals, not Counter updates: the loop strategy has 10⁵ calls a step
    for i in range(lo, hi):
        ts, call_end, name, correlation = calls[i]
        if i in lab:
            out["sync_wait_ms"] += call_end - ts
            continue
        out["runtime_ms"] += max(0.0, min(call_end, end) - max(ts, covered))
        covered = max(covered, min(call_end, end))
        if name in LAUNCHES:
            launches += 1
            if call_end - ts > QUEUE_BLOCKED_US:
                out["queue_wait_ms"] += call_end - ts
        elif name in SYNC_CANDIDATES:
            syncs += is_sync(trace, tid, i)
        elif name in DEVICE_MALLOCS:
            out["device_mallocs"] += 1
        elif name in DEVICE_FREES:
            out["device_frees"] += 1
        if correlation in trace.launched:
            launched.extend(trace.launched[correlation])
            out["kernels"] += trace.kernels[correlation]
            for copy in trace.copies.get(correlation, ()):
                out[f"{copy.direction}_copies"] += 1
                out[f"{copy.direction}_bytes"] += copy.bytes
    out["launches"] += launches
    out["syncs"] += syncs


def _count_ops(trace: Trace, tid, start: float, end: float, out: Counter) -> None:
    """Add the aten operators on ``tid`` that start in [start, end) to ``out`` (prefix sums: O(log n))."""
    if tid not in trace.ops:
        return
    starts, prefix = trace.ops[tid]
    lo, hi = bisect_left(starts, start), bisect_left(starts, end)
    for m in OF_OPERATORS:
        out[m] += prefix[m][hi] - prefix[m][lo]


def measure_steps(source) -> list[StepMeasures]:
    """Every measure of every region of each ProfilerStep, in order."""
    trace = load_trace(source)
    steps, spans = [], []
    for step in trace.steps:
        threads = step_threads(trace, step)
        regions = {
            name: measure_region(trace, threads, spans, whole_step=name == STEP)
            for name, spans in step_regions(trace, step).items()
        }
        steps.append(StepMeasures(int(STEP_NAME.match(step["name"]).group(1)), step["ts"], regions))
        spans.append(_gpu_span(trace, threads, step["ts"], step["ts"] + step["dur"]))
    for i, (step, (first, last)) in enumerate(zip(steps, spans, strict=True)):
        later = [s[0] for s in spans[i + 1 :] if s[0] is not None]
        if trace.has_gpu and first is not None:
            step.regions[STEP]["device_step_ms"] = ((later[0] if later else last) - first) / 1e3
    return steps


def _gpu_span(trace: Trace, threads: list, start: float, end: float) -> tuple[float | None, float | None]:
    """(start of the first, end of the last) kernel launched by the calls in [start, end) on ``threads``.
    Kernels, not copies: the loader copies the next batch on a stream of its own, which starts at once."""
    found = []
    for tid in threads:
        calls = trace.calls.get(tid, [])
        lo, hi = call_range(trace, tid, start, end)
        found += [g for c in calls[lo:hi] for g in trace.launched.get(c.correlation, ()) if g.category == "kernel"]
    if not found:
        return None, None
    return min(g.ts for g in found), max(g.end for g in found)


def check_steps(source, steps: list[StepMeasures]) -> list[str]:
    """One line per kind of violated invariant of the measured ``steps`` of a trace (see the module docstring)."""
    trace = load_trace(source)
    unbalanced, unlaunched = {}, {}
    for step in steps:
        regions, n = step.regions, step.step
        off = []
        for m in ADDITIVE:
            if regions[STEP][m] is not None:
                parts = sum(regions[r][m] for r in PARTS if r in regions)
                if abs(parts - regions[STEP][m]) > 1e-6 * max(1.0, abs(parts)):
                    off.append(f"{MEASURES[m].header} {parts:g} against {regions[STEP][m]:g}")
        if off:
            unbalanced[n] = ", ".join(off)
        missed = [
            f"{name} ({r['kernels']} kernels)" for name, r in regions.items() if r["kernels"] and not r["launches"]
        ]
        if missed:
            unlaunched[n] = ", ".join(missed)
    warnings = []
    if unbalanced:
        first = min(unbalanced)
        warnings.append(
            f"the regions do not add up to the step in {len(unbalanced)} of {len(steps)} steps (step {first}: "
            f"{unbalanced[first]}): overlapping regions?"
        )
    if unlaunched:
        first = min(unlaunched)
        warnings.append(
            f"kernels with no launch counted in {len(unlaunched)} of {len(steps)} steps (step {first}: "
            f"{unlaunched[first]}): launched by a call the analysis does not know as a launch"
        )
    return warnings + _idle_checks(steps) + _unmatched_launches(trace) + _memory_checks(trace, steps)


# A step's GPU idle share is contradicted by its neighbours where it is this many times theirs (and IDLE_GAP above it)
# though the host took no longer over it: a host as quick feeds the device as well, so the device cannot have idled
# more; the gap then lies in what the trace holds (work it did not record), not in the step
IDLE_RATIO, IDLE_GAP = 2.0, 0.05


def _idle_checks(steps: list[StepMeasures]) -> list[str]:
    """A warning naming the steps whose idle share their neighbours contradict (IDLE_RATIO): a step the host spent no
    longer on than on the steps beside it, whose device idled far more than in any of them."""
    found = []
    for i, step in enumerate(steps):
        idle, wall = step.regions[STEP].get("gpu_idle_share"), step.regions[STEP]["wall_ms"]
        near = [s.regions[STEP] for s in steps[max(0, i - 1) : i + 2] if s is not step]
        if idle is None or not near or any(n.get("gpu_idle_share") is None for n in near):
            continue
        most = max(n["gpu_idle_share"] for n in near)
        if idle > max(IDLE_RATIO * most, most + IDLE_GAP) and wall <= max(n["wall_ms"] for n in near):
            found.append(f"step {step.step} ({100 * idle:.1f} % against at most {100 * most:.1f} %)")
    if not found:
        return []
    return [
        f"GPU idle that the steps beside it contradict in {len(found)} of {len(steps)} steps ({', '.join(found)}): the "
        "host was no slower there, so the device cannot have idled more; GPU work the trace did not record?"
    ]


def _memory_checks(trace: Trace, steps: list[StepMeasures]) -> list[str]:
    """What the memory events must satisfy (see the module docstring): one line per kind of violation."""
    memory = trace.memory
    if memory is None:
        return []
    out = []
    broken = sum(
        1 for k in range(1, len(memory.ts)) if memory.allocated[k] != memory.allocated[k - 1] + memory.bytes[k]
    )
    if broken:
        out.append(
            f"{broken} of {len(memory.ts)} memory events do not follow from the one before (bytes allocated after "
            "it against before it plus its own): events dropped or out of order, the peaks may be off"
        )
    risen, peaks = {}, {}
    for step in steps:
        regions = {name: r for name, r in step.regions.items() if r.get("peak_bytes") is not None}
        over = [
            f"{name} (+{r['peak_rise_bytes']:,} B, {r['alloc_bytes']:,} B allocated)"
            for name, r in regions.items()
            if r["peak_rise_bytes"] > r["alloc_bytes"]
        ]
        if over:
            risen[step.step] = ", ".join(over)
        parts = [r["peak_bytes"] for name, r in regions.items() if name != STEP]
        if STEP in regions and parts and max(parts) != regions[STEP]["peak_bytes"]:
            peaks[step.step] = f"regions' highest {max(parts):,} B against the step's {regions[STEP]['peak_bytes']:,} B"
    for found, what in (
        (risen, "a region's peak rises further than it allocated"),
        (peaks, "the step's peak is not its regions' highest"),
    ):
        if found:
            first = min(found)
            out.append(f"{what} in {len(found)} of {len(steps)} steps (step {first}: {found[first]})")
    return out


# A trace's figure and the allocator's own may differ by this share before they are called different: both read
# the caching allocator's counters at the same allocations, so they agree exactly unless events were lost.
ALLOCATOR_TOLERANCE = 1e-3


def allocator_checks(steps: list[StepMeasures], allocator: dict[int, dict]) -> list[str]:
    """Set each step's alloc_retries from ``allocator`` (step number -> the caching allocator's figures around it,
    `make profile` reads them on a GPU: ``live``, ``peak``, ``device_mallocs``, ``retries``) and hold the trace's
    bytes live at the start, peak and device mallocs against them; one line per kind of disagreement."""
    found = {"live": {}, "peak": {}, "mallocs": {}}
    for step in steps:
        stats, measured = allocator.get(step.step), step.regions[STEP]
        if not stats:
            continue
        measured["alloc_retries"] = stats["retries"]
        if measured.get("peak_bytes") is not None:
            start = measured["peak_bytes"] - measured["peak_rise_bytes"]
            for key, trace_value in (("live", start), ("peak", measured["peak_bytes"])):
                if abs(trace_value - stats[key]) > ALLOCATOR_TOLERANCE * max(stats[key], 1):
                    found[key][step.step] = f"{trace_value:,} B in the trace, {stats[key]:,} B by the allocator"
        if measured.get("device_mallocs") is not None and measured["device_mallocs"] != stats["device_mallocs"]:
            found["mallocs"][step.step] = (
                f"{measured['device_mallocs']} in the trace, {stats['device_mallocs']} by the allocator"
            )
    what = {
        "live": "the bytes live at the step's start differ from the allocator's",
        "peak": "the step's peak differs from the allocator's (torch.cuda.max_memory_allocated)",
        "mallocs": "the step's device mallocs differ from the allocator's (num_device_alloc): under expandable "
        "segments it maps memory with driver calls the trace does not record, so the regions' are too low",
    }
    out = []
    for key, by_step in found.items():
        if by_step:
            first = min(by_step)
            out.append(f"{what[key]} in {len(by_step)} of {len(steps)} steps (step {first}: {by_step[first]})")
    return out


def _unmatched_launches(trace: Trace) -> list[str]:
    """Launches in the active steps without a kernel, and GPU events there without a launching call. The
    host runs ahead, so work launched before the profiler recorded (no call in the trace) still runs at
    the start of the window: on each stream, only an event that starts after the stream's first event
    launched inside the window has lost its call."""
    if not trace.has_gpu:
        return []
    start, end = trace.steps[0]["ts"], max(s["ts"] + s["dur"] for s in trace.steps)
    calls = [c for tid in trace.calls for c in trace.calls[tid][slice(*call_range(trace, tid, start, end))]]
    inside = {c.correlation for c in calls}
    known = {c.correlation for tid in trace.calls for c in trace.calls[tid]}
    first = {}  # stream -> start of its first event launched inside the window
    for g in trace.gpu:
        if g.correlation in inside:
            first[g.stream] = min(first.get(g.stream, g.ts), g.ts)
    launches = [c for c in calls if c.name in LAUNCHES]
    lost = sum(1 for c in launches if not trace.kernels.get(c.correlation))
    orphans = [
        g for g in trace.gpu if g.correlation not in known and g.stream in first and first[g.stream] <= g.ts < end
    ]
    out = []
    if lost:
        out.append(
            f"{lost} of {len(launches)} kernel launches in the active steps have no kernel in the trace (the "
            "profiler dropped GPU records?): kernels and GPU ms are too low"
        )
    if orphans:
        ms = sum(g.end - g.ts for g in orphans) / 1e3
        out.append(
            f"{len(orphans)} GPU events ({ms:.3g} ms) in the active steps have no launching call in the "
            "trace: no region counts them"
        )
    return out


def summarise(trace: Trace, steps: list[StepMeasures], allocator: dict[int, dict] | None = None) -> Analysis:
    """The record's analysis (detector/lab/record/run.py) of ``steps``, the trace's ``measure_steps``: each measure's
    spread per region over the steps, the representative step, and the warnings of ``check_steps`` (and, given the
    caching allocator's figures of each step, of ``allocator_checks``, which sets the steps' alloc retries)."""
    held = allocator_checks(steps, allocator) if allocator else []
    names = [name for name in REGIONS if any(name in s.regions for s in steps)]
    regions = {
        name: {m: Spread.of([s.regions[name][m] for s in steps if name in s.regions]) for m in MEASURES}
        for name in names
    }
    return Analysis(
        trace=Path(trace.name).name,
        gpu=trace.has_gpu,
        representative_step=representative_step(steps).step,
        steps=len(steps),
        step_numbers=[s.step for s in steps],
        regions=regions,
        warnings=check_steps(trace, steps) + held,
    )
