"""Per-step, per-region measures from a torch.profiler (Kineto) trace, checked against each other.

A trace holds one ``ProfilerStep#N`` user annotation per active step; inside it, on the same thread, the
lab's regions ("copy data", "forward", "calc loss", "backward", "optimizer step", or "step (CUDA graph)")
and the batch loader's ``enumerate(DataLoader)#...__next__``, measured as "data wait". "other" is the
step's time outside those regions (Python between them, the schedule, the profiler's own step), and
"step" the whole ProfilerStep. Every measure is defined once, in detector.measures.

How a region's measures are found (``measure_steps``):

- Host side: the calls and operators that *start* inside the region's time span, on any thread of the
  profiled process (the autograd engine launches the backward from its own threads, whatever they are
  named). Each is counted in exactly one of the regions, "other" included, so counts add up to the step.
- Device side: a kernel, copy or memset belongs to the region whose call launched it (the trace links
  them by a correlation id), whenever it ran. The host runs ahead of the device as in training, so a
  region's GPU ms may run long after its wall time has ended; the step's GPU idle share is the part of
  its wall time in which the device ran nothing at all.
- Syncs: each cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize (and the driver's
  cuCtx/cuStream/cuEventSynchronize), each synchronous copy (cudaMemcpy, cudaMemcpy2D/3D,
  cudaMemcpyPeer, cuMemcpyDtoH), and a device-to-host cudaMemcpyAsync into pageable memory (it returns
  only once the copy is done), unless the next call on its thread is a synchronize, which then stands for
  both: ``.item()`` and ``.cpu()`` count one sync each. Under ``profile.sync_regions=true`` the lab's own
  synchronize at the end of each region sits in a ``lab sync`` annotation: it is measured as
  ``sync_wait_ms`` and left out of every other count.

``check_steps`` tests what must hold whatever the strategy, and returns a warning for each violation
(never a silent number): the regions and "other" add up to the step, every region with kernels has
launches, every launch has its kernel, and every GPU event in the active steps has the call that
launched it. ``summarise`` gives each measure's median, quartiles (``statistics.quantiles``, inclusive
method), min, max and n over the steps; ``trace_summary`` is all of it, JSON-ready, for summary.json.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from detector.measures import MEASURES

LAB_REGIONS = ("copy data", "forward", "calc loss", "backward", "optimizer step", "step (CUDA graph)")
OTHER = "other"
REGIONS = ("data wait",) + LAB_REGIONS + (OTHER, "step")  # table order
PARTS = REGIONS[:-1]  # the regions a step is made of
LAB_SYNC = "lab sync"  # the annotation around a region's closing synchronize (profile.sync_regions=true)
DATA_WAIT_PREFIX = "enumerate(DataLoader)#"
STEP_NAME = re.compile(r"ProfilerStep#(\d+)$")

CALL_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
GRAPH_LAUNCH = "cudaGraphLaunch"
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", GRAPH_LAUNCH})
SYNCHRONIZES = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
    }
)
SYNC_COPIES = frozenset(
    {"cudaMemcpy", "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyPeer", "cuMemcpyDtoH", "cuMemcpyDtoH_v2"}
)
SYNC_CANDIDATES = SYNCHRONIZES | SYNC_COPIES | {"cudaMemcpyAsync"}  # the calls is_sync has to look at
COPY_DIRECTION = re.compile(r"Memcpy (HtoD|DtoH)")
# operator names -> the op measure they count in, besides "ops" (every aten:: operator)
OP_KINDS = {
    **dict.fromkeys(("aten::select", "aten::slice", "aten::narrow", "aten::split", "aten::split_with_sizes"), "slices"),
    "aten::unbind": "slices",
    **dict.fromkeys(("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"), "host_reads"),
}
OP_MEASURES = ("ops", "slices", "host_reads")


class Call(NamedTuple):
    """A CUDA runtime or driver call on a CPU thread (times in µs, as in the trace)."""

    ts: float
    end: float
    name: str
    correlation: int | None


class Gpu(NamedTuple):
    """A kernel, memcpy or memset on a GPU stream (times in µs)."""

    ts: float
    end: float
    category: str  # "kernel" | "gpu_memcpy" | "gpu_memset"
    stream: object
    correlation: int | None  # the launching call's
    name: str


class Op(NamedTuple):
    """An operator (``cpu_op``) on a CPU thread (times in µs)."""

    ts: float
    end: float
    name: str


class Copy(NamedTuple):
    direction: str  # "h2d" | "d2h"
    bytes: int
    pageable: bool  # host side is pageable memory: a D2H copy into it blocks the host


@dataclass
class Trace:
    """A trace's events indexed for region queries; build it with ``load_trace``."""

    name: str
    steps: list[dict]  # ProfilerStep user annotations, by start time
    annotations: dict = field(default_factory=lambda: defaultdict(list))  # tid -> user annotations by ts
    annotation_starts: dict = field(default_factory=dict)  # tid -> [ts], for bisect
    calls: dict = field(default_factory=lambda: defaultdict(list))  # tid -> [Call] by ts
    call_starts: dict = field(default_factory=dict)  # tid -> [ts], for bisect
    ops: dict = field(default_factory=dict)  # tid -> ([ts], {op measure: prefix counts}) of aten operators
    op_events: dict = field(default_factory=lambda: defaultdict(list))  # tid -> [Op] by ts, every operator
    threads: dict = field(default_factory=lambda: defaultdict(set))  # pid -> tids with calls or operators
    gpu: list = field(default_factory=list)  # [Gpu] by ts
    busy: tuple = ([], [], [0.0])  # merged GPU intervals: starts, ends, prefix sums of lengths
    launched: dict = field(default_factory=lambda: defaultdict(list))  # correlation -> [Gpu] it launched
    copies: dict = field(default_factory=lambda: defaultdict(list))  # correlation -> [Copy]
    kernels: Counter = field(default_factory=Counter)  # correlation -> kernels it launched
    lab_syncs: dict = field(default_factory=dict)  # tid -> {index into calls} inside "lab sync" annotations

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu)


# ----------------------------------------------------------------------------- reading and indexing


def read_events(source) -> tuple[str, list[dict]]:
    """(name, events) of a trace file (.json or .json.gz), a parsed trace dict, or a list of events."""
    name = str(source) if isinstance(source, (str, Path)) else "<events>"
    if isinstance(source, (str, Path)):
        try:
            with open(source, "rb") as f:
                raw = f.read()
            source = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
        except (OSError, EOFError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"{name}: cannot read a JSON trace ({err})") from err
    events = source.get("traceEvents") if isinstance(source, dict) else source
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{name}: not a Chrome/Kineto trace (expected a list of events or a 'traceEvents' list)")
    return name, events


def load_trace(source) -> Trace:
    """Index a trace (path, dict or event list) for region queries; ValueError naming it if it is not one.
    An indexed Trace is returned as it is."""
    if isinstance(source, Trace):
        return source
    name, events = read_events(source)
    try:
        trace = _index(name, events)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{name}: malformed trace event ({err!r})") from err
    if not trace.steps:
        raise ValueError(
            f"{name}: no ProfilerStep#N annotations (record with a torch.profiler schedule and prof.step())"
        )
    return trace


def _index(name: str, events: list[dict]) -> Trace:
    trace = Trace(name=name, steps=[])
    ops, copy_events = defaultdict(list), []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat == "user_annotation":
            trace.annotations[e["tid"]].append(e)
            if STEP_NAME.match(e["name"]):
                trace.steps.append(e)
        elif cat == "cpu_op":
            trace.op_events[e["tid"]].append(Op(e["ts"], e["ts"] + e["dur"], e["name"]))
            if e["name"].startswith("aten::"):
                ops[e["tid"]].append((e["ts"], OP_KINDS.get(e["name"])))
                trace.threads[e["pid"]].add(e["tid"])
        elif cat in CALL_CATEGORIES:
            corr = e.get("args", {}).get("correlation")
            trace.calls[e["tid"]].append(Call(e["ts"], e["ts"] + e["dur"], e["name"], corr))
            trace.threads[e["pid"]].add(e["tid"])
        elif cat in GPU_CATEGORIES:
            args = e.get("args", {})
            corr = args.get("correlation")
            trace.gpu.append(Gpu(e["ts"], e["ts"] + e["dur"], cat, args.get("stream", e.get("tid")), corr, e["name"]))
            trace.launched[corr].append(trace.gpu[-1])
            if cat == "kernel":
                trace.kernels[corr] += 1
            elif cat == "gpu_memcpy":
                copy_events.append(e)
    for e in copy_events:
        match = COPY_DIRECTION.match(e["name"])
        if match:
            direction = "h2d" if match.group(1) == "HtoD" else "d2h"
            trace.copies[e["args"].get("correlation")].append(
                Copy(direction, int(e["args"].get("bytes", 0)), "Pageable" in e["name"])
            )
    trace.steps.sort(key=lambda e: e["ts"])
    for tid, marks in trace.annotations.items():
        marks.sort(key=lambda e: e["ts"])
        trace.annotation_starts[tid] = [e["ts"] for e in marks]
    for tid, calls in trace.calls.items():
        calls.sort()
        trace.call_starts[tid] = [c.ts for c in calls]
    for tid, found in ops.items():
        found.sort(key=lambda op: op[0])
        prefix = {m: [0] for m in OP_MEASURES}
        for _, kind in found:
            for m in OP_MEASURES:
                prefix[m].append(prefix[m][-1] + (m == "ops" or m == kind))
        trace.ops[tid] = ([ts for ts, _ in found], prefix)
    trace.gpu.sort(key=lambda g: g[:2])
    for found in trace.op_events.values():
        found.sort()
    trace.busy = _merge(trace.gpu)
    trace.lab_syncs = _lab_syncs(trace)
    return trace


def _merge(intervals) -> tuple[list, list, list]:
    """Union of (start, end, ...) intervals sorted by start: (starts, ends, prefix sums of lengths)."""
    starts, ends = [], []
    for start, end, *_ in intervals:
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    cumulative = [0.0]
    for start, end in zip(starts, ends, strict=True):
        cumulative.append(cumulative[-1] + end - start)
    return starts, ends, cumulative


def _lab_syncs(trace: Trace) -> dict:
    """{tid: {index}} of the calls inside "lab sync" annotations (the lab's region-ending synchronize)."""
    found = defaultdict(set)
    for tid, marks in trace.annotations.items():
        for e in marks:
            if e["name"] == LAB_SYNC:
                found[tid].update(range(*call_range(trace, tid, e["ts"], e["ts"] + e["dur"])))
    return dict(found)


def call_range(trace: Trace, tid, start: float, end: float) -> tuple[int, int]:
    """Indices [lo, hi) of the calls on ``tid`` that start in [start, end)."""
    starts = trace.call_starts.get(tid, [])
    return bisect_left(starts, start), bisect_left(starts, end)


# ----------------------------------------------------------------------------- measures of one region


def step_threads(trace: Trace, step: dict) -> list:
    """The step's own thread first, then every other thread of its process that made calls or ran operators."""
    return [step["tid"]] + sorted(trace.threads.get(step["pid"], set()) - {step["tid"]}, key=str)


def step_regions(trace: Trace, step: dict) -> dict[str, list[tuple[float, float]]]:
    """{region: [(start, end) µs]} of one ProfilerStep in REGIONS order: the regions found, "other" (the
    gaps between them) and "step"."""
    start, end = step["ts"], step["ts"] + step["dur"]
    found = defaultdict(list)
    marks = trace.annotations[step["tid"]]
    for e in marks[bisect_left(trace.annotation_starts[step["tid"]], start) :]:
        if e["ts"] >= end:
            break
        name = "data wait" if e["name"].startswith(DATA_WAIT_PREFIX) else e["name"]
        if name in LAB_REGIONS or name == "data wait":
            found[name].append((e["ts"], min(e["ts"] + e["dur"], end)))
    covered = sorted(span for spans in found.values() for span in spans)
    gaps, at = [], start
    for a, b in covered:
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if at < end:
        gaps.append((at, end))
    found[OTHER] = gaps
    found["step"].append((start, end))
    return {name: found[name] for name in REGIONS if found.get(name)}


def measure_region(trace: Trace, threads: list, spans: list[tuple[float, float]], whole_step: bool = False) -> dict:
    """Every measure (detector.measures) of a region made of ``spans``; GPU-only ones None without GPU events."""
    total, launched = Counter(), []
    for start, end in spans:
        total["wall_ms"] += end - start
        for tid in threads:
            _count_calls(trace, tid, start, end, total, launched)
            _count_ops(trace, tid, start, end, total)
    out = {name: total[name] for name in MEASURES}
    for name in ("wall_ms", "runtime_ms", "sync_wait_ms"):
        out[name] = total[name] / 1e3  # µs -> ms
    out["gpu_ms"] = _merge(sorted(launched, key=lambda g: (g.ts, g.end)))[2][-1] / 1e3
    out["gpu_idle_share"] = out["device_step_ms"] = None  # the step's alone (measure_steps sets the period)
    if whole_step and out["wall_ms"] > 0:
        (start, end), *_ = spans
        out["gpu_idle_share"] = 1.0 - _busy(trace, start, end) / (end - start)
    if not trace.has_gpu:
        out.update({name: None for name, m in MEASURES.items() if m.gpu_only})
    return out


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
        elif name in SYNC_CANDIDATES:
            syncs += is_sync(trace, tid, i)
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
    for m in OP_MEASURES:
        out[m] += prefix[m][hi] - prefix[m][lo]


def is_sync(trace: Trace, tid, i: int) -> bool:
    """Whether call ``i`` on ``tid`` makes the host wait for the device (the rule in the module docstring)."""
    calls = trace.calls[tid]
    call = calls[i]
    lab = trace.lab_syncs.get(tid, ())
    if i in lab:
        return False
    if call.name in SYNCHRONIZES or call.name in SYNC_COPIES:
        return True
    if call.name != "cudaMemcpyAsync":
        return False
    blocking = any(c.direction == "d2h" and c.pageable for c in trace.copies.get(call.correlation, ()))
    paired = i + 1 < len(calls) and calls[i + 1].name in SYNCHRONIZES and i + 1 not in lab
    return blocking and not paired


def _busy(trace: Trace, start: float, end: float) -> float:
    """µs of [start, end) covered by the union of GPU intervals (bisect on the merged intervals)."""
    starts, ends, cumulative = trace.busy
    i, j = bisect_right(ends, start), bisect_left(starts, end)  # intervals [i, j) overlap [start, end)
    if i >= j:
        return 0.0
    return cumulative[j] - cumulative[i] - max(0.0, start - starts[i]) - max(0.0, ends[j - 1] - end)


# ----------------------------------------------------------------------------- steps, checks, summary


def measure_steps(source) -> list[dict]:
    """[{"step": N, "start_us": ts, "regions": {region: {measure: value}}}] for each ProfilerStep, in order."""
    trace = load_trace(source)
    steps, spans = [], []
    for step in trace.steps:
        threads = step_threads(trace, step)
        regions = {
            name: measure_region(trace, threads, spans, whole_step=name == "step")
            for name, spans in step_regions(trace, step).items()
        }
        steps.append({"step": int(STEP_NAME.match(step["name"]).group(1)), "start_us": step["ts"], "regions": regions})
        spans.append(_gpu_span(trace, threads, step["ts"], step["ts"] + step["dur"]))
    for i, (step, (first, last)) in enumerate(zip(steps, spans, strict=True)):
        later = [s[0] for s in spans[i + 1 :] if s[0] is not None]
        if trace.has_gpu and first is not None:
            step["regions"]["step"]["device_step_ms"] = ((later[0] if later else last) - first) / 1e3
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


ADDITIVE = ("wall_ms", "ops", "slices", "host_reads", "launches", "kernels", "syncs", "h2d_copies", "d2h_copies")


def check_steps(source, steps: list[dict]) -> list[str]:
    """One line per kind of violated invariant of the measured ``steps`` of a trace (see the module docstring)."""
    trace = load_trace(source)
    unbalanced, unlaunched = {}, {}
    for step in steps:
        regions, n = step["regions"], step["step"]
        off = []
        for m in ADDITIVE:
            if regions["step"][m] is not None:
                parts = sum(regions[r][m] for r in PARTS if r in regions)
                if abs(parts - regions["step"][m]) > 1e-6 * max(1.0, abs(parts)):
                    off.append(f"{MEASURES[m].header} {parts:g} against {regions['step'][m]:g}")
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
    return warnings + _unmatched_launches(trace)


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


def representative_step(steps: list[dict]) -> dict:
    """The step whose wall time is the median (the lower of the two middle ones for an even count)."""
    walls = [s["regions"]["step"]["wall_ms"] for s in steps]
    return steps[walls.index(statistics.median_low(walls))]


def spread(values: list) -> dict:
    """median, q1, q3, min, max, n of the values that are not None (all None when there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return dict.fromkeys(("median", "q1", "q3", "min", "max"), None) | {"n": 0}
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarise(steps: list[dict]) -> dict:
    """{"steps": n, "step_numbers": [...], "regions": {region: {measure: spread}}} over the given steps."""
    names = [name for name in REGIONS if any(name in s["regions"] for s in steps)]
    regions = {
        name: {m: spread([s["regions"][name][m] for s in steps if name in s["regions"]]) for m in MEASURES}
        for name in names
    }
    return {"steps": len(steps), "step_numbers": [s["step"] for s in steps], "regions": regions}


def trace_summary(source, steps: list[dict] | None = None) -> dict:
    """JSON-ready summary of a trace for a run's summary.json: its name, whether it has GPU events, the
    spread of every measure per region over its steps (``summarise``), the representative step and the
    warnings of ``check_steps``. ``steps``: the trace's ``measure_steps``, when the caller has them already."""
    trace = load_trace(source)
    steps = measure_steps(trace) if steps is None else steps
    return {
        "trace": Path(trace.name).name,
        "gpu": trace.has_gpu,
        "representative_step": representative_step(steps)["step"],
        **summarise(steps),
        "warnings": check_steps(trace, steps),
    }
