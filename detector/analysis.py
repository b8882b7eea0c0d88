"""Per-step, per-region measures from a torch.profiler (Kineto) trace, and their spread over the steps.

A trace holds one ``ProfilerStep#N`` user annotation per active step; inside it, on the same thread, the
lab's regions ("copy data", "forward", "calc loss", "backward", "optimizer step", or "step (CUDA graph)"),
each ended by one ``cudaDeviceSynchronize``, and the DataLoader's ``enumerate(DataLoader)#...__next__``,
measured as "data wait". "step" is the whole ProfilerStep. For every step and region (``measure_steps``):

- ``wall_ms``: the region's wall time on the host.
- ``gpu_busy_ms``: the union of all GPU intervals (kernel, gpu_memcpy, gpu_memset; every stream) inside
  the region. ``gpu_idle_share`` = 1 - busy / wall: how much of the region the GPU waits on the host —
  near 1 where a strategy is launch-bound (the loop strategy), small for fused kernels. On a trace with
  no GPU events at all (CPU-only profiling) busy is 0.0 and the idle share is None (not 1.0: there is no
  GPU to idle).
- ``launches``: kernel launch calls (cudaLaunchKernel, cudaLaunchKernelExC, cuLaunchKernel,
  cuLaunchKernelEx, cudaGraphLaunch) on the region's threads. A cudaGraphLaunch counts as ONE launch,
  however many kernels the graph replays; ``kernels`` counts the GPU kernels those calls produced (linked
  by correlation id), so a CUDA-graph step shows launches 1 and kernels in the hundreds. The loop
  strategy's launches grow with the batch size B; padded's stay constant; a fused loss is one or two.
- ``h2d_copies`` / ``h2d_bytes``, ``d2h_copies`` / ``d2h_bytes``: GPU memcpy events attributed to the
  region through the correlation id of the runtime call that issued them. Device-to-device and
  peer copies are on-device work: they count in ``gpu_busy_ms`` only. Concat-style strategies show
  per-image copies here; padded's "copy data" is three H2D copies (images, boxes, counts).
- ``syncs``: host-device synchronisations: each cudaDeviceSynchronize, cudaStreamSynchronize,
  cudaEventSynchronize (and the driver's cuCtx/cuStream/cuEventSynchronize), each synchronous copy
  (cudaMemcpy, cudaMemcpy2D/3D, cudaMemcpyPeer, cuMemcpyDtoH), and a device-to-host cudaMemcpyAsync into
  pageable memory (it returns only once the copy is done) — unless the next call on its thread is a
  synchronize, which then stands for both: ``.item()`` and ``.cpu()`` (a D2H cudaMemcpyAsync then a
  cudaStreamSynchronize) count ONE sync. Excluded: the cudaDeviceSynchronize that ends each lab region
  (the last CUDA call on the region's thread, when it is one), also when counting the whole step.
  Syncs inside the loss reveal data-dependent shapes (``nonzero``, ``.item()``, per-image splits).
- ``runtime_ms``: host time inside CUDA runtime and driver calls (union, so a runtime call that wraps a
  driver call counts once; summed over the region's threads), leaving out the lab's region-ending
  synchronize (it waits out the region's GPU work): the launch and sync overhead the host pays.

The region's threads are the thread of its annotation plus the autograd engine's device threads
(``pt_autograd_*``) of that process: on a GPU, backward launches its kernels from those. Calls count when
they start inside the region. A region that occurs twice in one step is measured as the sum of both.

``summarise`` gives, per region and measure over the steps, median, q1, q3 (``statistics.quantiles``,
inclusive method), min, max and n (None values left out); ``trace_summary`` is both in one JSON-ready
dict for a run's summary.json; ``markdown_table`` formats it. Events are indexed once (sorted per thread,
GPU intervals merged with prefix sums), so each region costs a bisect plus its own calls.
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

LAB_REGIONS = ("copy data", "forward", "calc loss", "backward", "optimizer step", "step (CUDA graph)")
REGIONS = ("data wait",) + LAB_REGIONS + ("step",)  # table order
DATA_WAIT_PREFIX = "enumerate(DataLoader)#"
STEP_NAME = re.compile(r"ProfilerStep#(\d+)$")
MEASURES = (
    "wall_ms",
    "gpu_busy_ms",
    "gpu_idle_share",
    "launches",
    "kernels",
    "h2d_copies",
    "h2d_bytes",
    "d2h_copies",
    "d2h_bytes",
    "syncs",
    "runtime_ms",
)

CALL_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCHES = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}
)
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


class Call(NamedTuple):
    """A CUDA runtime or driver call on a CPU thread (times in µs, as in the trace)."""

    ts: float
    end: float
    name: str
    correlation: int | None


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
    gpu: list = field(default_factory=list)  # (ts, end, category, stream) by ts
    busy: tuple = ([], [], [0.0])  # merged GPU intervals: starts, ends, prefix sums of lengths
    copies: dict = field(default_factory=lambda: defaultdict(list))  # correlation -> [Copy]
    kernels: Counter = field(default_factory=Counter)  # correlation -> kernels it launched
    thread_names: dict = field(default_factory=dict)  # (pid, tid) -> name
    ending_syncs: dict = field(default_factory=dict)  # tid -> {index into calls} of region-ending syncs

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
    copy_events = []
    for e in events:
        cat, ph = e.get("cat"), e.get("ph")
        if ph == "M" and e.get("name") == "thread_name":
            trace.thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
        if ph != "X":
            continue
        if cat == "user_annotation":
            trace.annotations[e["tid"]].append(e)
            if STEP_NAME.match(e["name"]):
                trace.steps.append(e)
        elif cat in CALL_CATEGORIES:
            corr = e.get("args", {}).get("correlation")
            trace.calls[e["tid"]].append(Call(e["ts"], e["ts"] + e["dur"], e["name"], corr))
        elif cat in GPU_CATEGORIES:
            args = e.get("args", {})
            trace.gpu.append((e["ts"], e["ts"] + e["dur"], cat, args.get("stream", e.get("tid"))))
            if cat == "kernel":
                trace.kernels[args.get("correlation")] += 1
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
    trace.gpu.sort()
    trace.busy = _merge(trace.gpu)
    trace.ending_syncs = _ending_syncs(trace)
    return trace


def _merge(intervals: list[tuple]) -> tuple[list, list, list]:
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


def _ending_syncs(trace: Trace) -> dict:
    """{tid: {index}} of each lab region's closing cudaDeviceSynchronize: its last call, when it is one."""
    ending = defaultdict(set)
    for tid, marks in trace.annotations.items():
        for e in marks:
            if e["name"] not in LAB_REGIONS:
                continue
            lo, hi = _call_range(trace, tid, e["ts"], e["ts"] + e["dur"])
            if hi > lo and trace.calls[tid][hi - 1].name == "cudaDeviceSynchronize":
                ending[tid].add(hi - 1)
    return dict(ending)


def _call_range(trace: Trace, tid, start: float, end: float) -> tuple[int, int]:
    """Indices [lo, hi) of the calls on ``tid`` that start in [start, end)."""
    starts = trace.call_starts.get(tid, [])
    return bisect_left(starts, start), bisect_left(starts, end)


# ----------------------------------------------------------------------------- measures of one region


def region_threads(trace: Trace, step: dict) -> list:
    """The step's thread, then its process's autograd device threads (they launch backward's kernels)."""
    autograd = [tid for (pid, tid), name in trace.thread_names.items() if pid == step["pid"] and "pt_autograd" in name]
    return [step["tid"]] + sorted(tid for tid in set(autograd) if tid != step["tid"])


def step_regions(trace: Trace, step: dict) -> dict[str, list[tuple[float, float]]]:
    """{region: [(start, end) µs]} inside one ProfilerStep, in REGIONS order, "step" last."""
    start, end = step["ts"], step["ts"] + step["dur"]
    found = defaultdict(list)
    marks = trace.annotations[step["tid"]]
    for e in marks[bisect_left(trace.annotation_starts[step["tid"]], start) :]:
        if e["ts"] >= end:
            break
        name = "data wait" if e["name"].startswith(DATA_WAIT_PREFIX) else e["name"]
        if name in LAB_REGIONS or name == "data wait":
            found[name].append((e["ts"], e["ts"] + e["dur"]))
    found["step"].append((start, end))
    return {name: found[name] for name in REGIONS if name in found}


def measure_region(trace: Trace, threads: list, intervals: list[tuple[float, float]]) -> dict:
    """The MEASURES of a region (summed over its intervals when it occurs more than once)."""
    total = Counter()
    for start, end in intervals:
        total.update(_measure_span(trace, threads, start, end))
    out = {name: total[name] for name in MEASURES if name != "gpu_idle_share"}
    for name in ("wall_ms", "gpu_busy_ms", "runtime_ms"):
        out[name] = total[name] / 1e3  # µs -> ms
    wall, busy = out["wall_ms"], out["gpu_busy_ms"]
    out["gpu_idle_share"] = 1.0 - busy / wall if trace.has_gpu and wall > 0 else None
    return {name: out[name] for name in MEASURES}


def _measure_span(trace: Trace, threads: list, start: float, end: float) -> Counter:
    """Counts and µs of one interval: the calls that start in it on ``threads``, the GPU busy inside it."""
    out = Counter(wall_ms=end - start, gpu_busy_ms=_busy(trace, start, end))
    for tid in threads:
        calls, ending = trace.calls.get(tid, []), trace.ending_syncs.get(tid, ())
        lo, hi = _call_range(trace, tid, start, end)
        covered = start  # runtime_ms is a union: a driver call nested in a runtime call counts once
        launches = syncs = 0  # locals, not Counter updates: the loop strategy has 10⁵ calls a step
        for i in range(lo, hi):
            ts, call_end, name, correlation = calls[i]
            if i not in ending:
                out["runtime_ms"] += max(0.0, min(call_end, end) - max(ts, covered))
                covered = max(covered, min(call_end, end))
            if name in LAUNCHES:
                launches += 1
            elif name in SYNC_CANDIDATES:
                syncs += is_sync(trace, tid, i)
            if correlation in trace.kernels:
                out["kernels"] += trace.kernels[correlation]
            for copy in trace.copies.get(correlation, ()):
                out[f"{copy.direction}_copies"] += 1
                out[f"{copy.direction}_bytes"] += copy.bytes
        out.update(launches=launches, syncs=syncs)
    return out


def is_sync(trace: Trace, tid, i: int) -> bool:
    """Whether call ``i`` on ``tid`` makes the host wait for the device (the rule in the module docstring)."""
    calls = trace.calls[tid]
    call = calls[i]
    if i in trace.ending_syncs.get(tid, ()):
        return False
    if call.name in SYNCHRONIZES or call.name in SYNC_COPIES:
        return True
    if call.name != "cudaMemcpyAsync":
        return False
    blocking = any(c.direction == "d2h" and c.pageable for c in trace.copies.get(call.correlation, ()))
    paired = i + 1 < len(calls) and calls[i + 1].name in SYNCHRONIZES and i + 1 not in trace.ending_syncs.get(tid, ())
    return blocking and not paired


def _busy(trace: Trace, start: float, end: float) -> float:
    """µs of [start, end) covered by the union of GPU intervals (bisect on the merged intervals)."""
    starts, ends, cumulative = trace.busy
    i, j = bisect_right(ends, start), bisect_left(starts, end)  # intervals [i, j) overlap [start, end)
    if i >= j:
        return 0.0
    return cumulative[j] - cumulative[i] - max(0.0, start - starts[i]) - max(0.0, ends[j - 1] - end)


# ----------------------------------------------------------------------------- steps and their summary


def measure_steps(source) -> list[dict]:
    """[{"step": N, "start_us": ts, "regions": {region: {measure: value}}}] for each ProfilerStep, in order."""
    trace = source if isinstance(source, Trace) else load_trace(source)
    steps = []
    for step in trace.steps:
        threads = region_threads(trace, step)
        regions = {name: measure_region(trace, threads, spans) for name, spans in step_regions(trace, step).items()}
        steps.append({"step": int(STEP_NAME.match(step["name"]).group(1)), "start_us": step["ts"], "regions": regions})
    return steps


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
    spread of every measure per region over its steps (``summarise``) and the representative step.
    ``steps``: the trace's ``measure_steps``, when the caller has them already."""
    trace = source if isinstance(source, Trace) else load_trace(source)
    steps = measure_steps(trace) if steps is None else steps
    return {
        "trace": Path(trace.name).name,
        "gpu": trace.has_gpu,
        "representative_step": representative_step(steps)["step"],
        **summarise(steps),
    }


# ----------------------------------------------------------------------------- markdown

HEADERS = {
    "wall_ms": "wall ms",
    "gpu_busy_ms": "GPU busy ms",
    "gpu_idle_share": "GPU idle",
    "launches": "launches",
    "kernels": "kernels",
    "h2d_copies": "H2D",
    "h2d_bytes": "H2D bytes",
    "d2h_copies": "D2H",
    "d2h_bytes": "D2H bytes",
    "syncs": "syncs",
    "runtime_ms": "CUDA API ms",
}


def markdown_table(summary: dict, measures=MEASURES, band: str = "range") -> str:
    """One run's table: regions as rows, measures as columns, each cell "median [min–max]"
    (``band="range"``) or "median [q1–q3]" (``band="iqr"``); a single bracketless value when they agree."""
    if band not in ("range", "iqr"):
        raise ValueError(f"band must be 'range' or 'iqr', got {band!r}")
    low, high = ("min", "max") if band == "range" else ("q1", "q3")
    lines = [
        f"| region | {' | '.join(HEADERS[m] for m in measures)} |",
        f"|---|{'---:|' * len(measures)}",
    ]
    for region, stats in summary["regions"].items():
        cells = []
        for m in measures:
            s = stats[m]
            median, lo, hi = (format_measure(m, s[key]) for key in ("median", low, high))
            cells.append(median if s["n"] == 0 or lo == hi == median else f"{median} [{lo}–{hi}]")
        lines.append(f"| {region} | {' | '.join(cells)} |")
    return "\n".join(lines)


def format_measure(measure: str, value: float | None) -> str:
    """A measure's value in its unit: a share as %, bytes in kB/MB/GB, ms to 3 significant digits."""
    if value is None:
        return "–"
    if measure == "gpu_idle_share":
        return f"{value:.0%}"
    if measure.endswith("_bytes"):
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= size:
                return f"{value / size:.3g} {unit}"
        return f"{value:.0f} B"
    if measure.endswith("_ms"):
        return f"{value:.3g}" if value < 1000 else f"{value:.0f}"
    return f"{value:g}"
