"""A torch.profiler (Kineto) trace, read and indexed for the lab's questions: which calls, operators and GPU
work start inside a span of time, which call launched which GPU work, and which calls made the host wait.

- A step is a ``ProfilerStep#N`` user annotation; inside it, on the same thread, the regions of
  detector/regions.py ("copy data", "forward", ...; the loader's wait is read as "data wait"). "other" is
  the step's time outside them, "step" the whole ProfilerStep.
- Calls are CUDA runtime and driver calls; GPU work (kernels, copies, memsets) is linked to the call that
  launched it by the trace's correlation id.
- Collectives: NCCL's kernels (names starting ``ncclDevKernel`` or ``ncclKernel``; a gloo run has none, nor any GPU
  event), with the message size the trace gives them (``In``/``Out msg nelems`` and ``dtype`` in their args);
  ``compute`` is the union of every other kernel, which a collective on another stream runs beside.
- Syncs: each cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize (and the driver's
  cuCtx/cuStream/cuEventSynchronize), each synchronous copy (cudaMemcpy, cudaMemcpy2D/3D,
  cudaMemcpyPeer, cuMemcpyDtoH), and a device-to-host cudaMemcpyAsync into pageable memory (it returns
  only once the copy is done), unless the next call on its thread is a synchronize, which then stands for
  both: ``.item()`` and ``.cpu()`` count one sync each. Under ``profile.sync_regions=true`` the lab's own
  synchronize at the end of each region sits in a ``lab sync`` annotation: it is measured on its own and
  left out of every other count.
- Memory: the profiler's ``[memory]`` instant events (``profile.profile_memory``), one per allocation (``Bytes`` > 0)
  or free (< 0), with the bytes allocated (``Total Allocated``) and, on a GPU, reserved (``Total Reserved``) after
  it, on the device ``Device Type`` (c10's: 0 the CPU, 1 CUDA) and ``Device Id``. The run's device's are kept: a
  GPU trace's CUDA device with the most events, else the CPU's. Each is attributed to the innermost operator
  around it on its thread that is not an allocation primitive (``aten::empty`` and kin): the operator that
  needed the memory.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from detector.checked import read_json
from detector.lab.record.measures import OF_OPERATORS
from detector.regions import LAB_SYNC, OTHER, REGIONS, STEP, region_of_label

STEP_NAME = re.compile(r"ProfilerStep#(\d+)$")
TRACE_BYTES = 512 * 2**20  # decompressed: a trace of ten GPU steps of the loop strategy is a few hundred MB

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
COLLECTIVE_PREFIXES = ("ncclDevKernel", "ncclKernel")
MEMORY_EVENT = "[memory]"
CPU_DEVICE, CUDA_DEVICE = 0, 1  # c10::DeviceType, as a memory event's "Device Type" gives it
# The caching allocator's own calls for device memory (runtime calls: the driver's cuMemAlloc inside cudaMalloc is not
# counted twice; under expandable segments it maps memory with driver calls the profiler does not record)
DEVICE_MALLOCS = frozenset({"cudaMalloc", "cudaMallocAsync"})
DEVICE_FREES = frozenset({"cudaFree", "cudaFreeAsync"})
# operators that only allocate: the memory is the operator's around them
ALLOCATING = frozenset(
    {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided"}
)
# the element sizes of the dtype names (c10's) that the trace gives a collective
DTYPE_BYTES = {"Double": 8, "Long": 8, "Float": 4, "Int": 4, "BFloat16": 2, "Half": 2, "Short": 2, "Char": 1}
DTYPE_BYTES |= {"Byte": 1, "Bool": 1}


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


class Memory(NamedTuple):
    """The allocator's events on the run's device, by time (µs): ``bytes`` > 0 an allocation, < 0 a free;
    ``allocated`` and ``reserved`` the allocator's totals after each (reserved: 0 on the CPU, which reserves
    nothing); ``ops`` the operator each one is attributed to ("" outside any). ``counts``: prefix sums of the
    allocations, their bytes and the frees, for a span's totals by bisection."""

    device: str  # "cuda:0", "cpu"
    ts: list
    bytes: list
    allocated: list
    reserved: list
    ops: list
    counts: dict

    def level(self, i: int) -> int:
        """The bytes allocated just before event ``i`` (after the last event for ``i`` = len)."""
        return self.allocated[i - 1] if i > 0 else self.allocated[0] - self.bytes[0] if self.ts else 0


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
    # merged GPU intervals (starts, ends, prefix sums of lengths), the work running unrecorded at the opening included
    busy: tuple = ([], [], [0.0])
    launched: dict = field(default_factory=lambda: defaultdict(list))  # correlation -> [Gpu] it launched
    copies: dict = field(default_factory=lambda: defaultdict(list))  # correlation -> [Copy]
    kernels: Counter = field(default_factory=Counter)  # correlation -> kernels it launched
    compute: tuple = ([], [], [0.0])  # merged intervals of the kernels that are not collectives
    message_bytes: dict = field(default_factory=dict)  # a collective's Gpu -> its message's bytes, where given
    lab_syncs: dict = field(default_factory=dict)  # tid -> {index into calls} inside "lab sync" annotations
    memory: Memory | None = None  # the run's device's allocator events; None where the profile recorded none

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu)


# ----------------------------------------------------------------------------- reading and indexing


def read_events(source) -> tuple[str, list[dict]]:
    """(name, events) of a trace file (.json or .json.gz), a parsed trace dict, or a list of events."""
    name = str(source) if isinstance(source, (str, Path)) else "<events>"
    if isinstance(source, (str, Path)):
        source = read_json(Path(source), TRACE_BYTES)  # RecordError, a ValueError, naming it
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
    ops, copy_events, memory_events = defaultdict(list), [], []
    for e in events:
        if e.get("ph") != "X":
            if e.get("name") == MEMORY_EVENT and e.get("ph") == "i":
                memory_events.append(e)
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
                _message(trace, trace.gpu[-1], args)
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
        prefix = {m: [0] for m in OF_OPERATORS}
        for _, kind in found:
            for m in OF_OPERATORS:
                prefix[m].append(prefix[m][-1] + (m == "ops" or m == kind))
        trace.ops[tid] = ([ts for ts, _ in found], prefix)
    trace.gpu.sort(key=lambda g: g[:2])
    for found in trace.op_events.values():
        found.sort()
    trace.busy = merge_intervals(sorted([*trace.gpu, *_unrecorded_at_opening(trace)], key=lambda g: (g[0], g[1])))
    trace.compute = merge_intervals(g for g in trace.gpu if g.category == "kernel" and not is_collective(g))
    trace.lab_syncs = _lab_syncs(trace)
    trace.memory = _memory(trace, memory_events)
    return trace


# On a stream with room, GPU work starts within tens of microseconds of its launch; work that starts later than this
# after it could have (its launch, or the window's opening for work launched before it) waited behind earlier work
QUEUED_US = 100.0


def _unrecorded_at_opening(trace: Trace) -> list[tuple[float, float]]:
    """The spans from the profiler's window opening (the first step's start) to each stream's first recorded GPU
    event, where that event waited behind earlier work (QUEUED_US): the host runs steps ahead of the device, so when
    the window opens the device is still running work launched before it, which the trace does not hold. That work
    kept the device busy; without it the first step's idle share counts the device's busiest time as idle. A stream
    whose first event started as soon as it could was idle before it: nothing is inferred there."""
    if not trace.gpu or not trace.steps:
        return []
    opened = trace.steps[0]["ts"]
    first = {}
    for g in trace.gpu:
        first.setdefault(g.stream, g)
    wanted = {g.correlation for g in first.values()}
    launched_at = {c.correlation: c.ts for calls in trace.calls.values() for c in calls if c.correlation in wanted}
    return [
        (opened, g.ts)
        for g in first.values()
        if g.ts > opened and g.ts - max(opened, launched_at.get(g.correlation, opened)) > QUEUED_US
    ]


def _memory(trace: Trace, events: list[dict]) -> Memory | None:
    """The run's device's memory events (see the module docstring), indexed; None where there are none."""
    by_device = defaultdict(list)
    for e in events:
        args = e.get("args", {})
        by_device[(args.get("Device Type"), args.get("Device Id"))].append(e)
    wanted = CUDA_DEVICE if trace.has_gpu else CPU_DEVICE  # a GPU run's memory is its GPU's
    keys = [key for key in by_device if key[0] == wanted]
    if not keys:
        return None
    key = max(keys, key=lambda k: len(by_device[k]))
    found = by_device[key]
    found.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    ts = [e["ts"] for e in found]
    sizes = [int(e["args"]["Bytes"]) for e in found]
    counts = {"allocs": [0], "alloc_bytes": [0], "frees": [0]}
    for b in sizes:
        counts["allocs"].append(counts["allocs"][-1] + (b > 0))
        counts["alloc_bytes"].append(counts["alloc_bytes"][-1] + max(b, 0))
        counts["frees"].append(counts["frees"][-1] + (b < 0))
    return Memory(
        device=f"cuda:{key[1]}" if key[0] == CUDA_DEVICE else "cpu",
        ts=ts,
        bytes=sizes,
        allocated=[int(e["args"]["Total Allocated"]) for e in found],
        reserved=[int(e["args"].get("Total Reserved", 0)) for e in found],
        ops=_allocating_ops(trace, found),
        counts=counts,
    )


def peak_rise(events: list[dict], device_type: int = CPU_DEVICE) -> int:
    """The most bytes allocated at once on ``device_type`` during ``events`` (any profiler trace's, no steps needed)
    above what was allocated before the first of them: the working memory of the code profiled."""
    found = sorted(
        (e for e in events if e.get("name") == MEMORY_EVENT and e.get("args", {}).get("Device Type") == device_type),
        key=lambda e: e["ts"],
    )
    if not found:
        return 0
    before = found[0]["args"]["Total Allocated"] - found[0]["args"]["Bytes"]
    return max(before, *(e["args"]["Total Allocated"] for e in found)) - before


def _allocating_ops(trace: Trace, events: list[dict]) -> list[str]:
    """Per memory event (sorted by time), the innermost operator around it on its thread that is not in
    ALLOCATING: one sweep per thread over its operators (sorted, nested), a stack of those open."""
    names = [""] * len(events)
    by_thread = defaultdict(list)
    for i, e in enumerate(events):
        by_thread[e.get("tid")].append(i)
    for tid, indices in by_thread.items():
        ops = sorted(trace.op_events.get(tid, []), key=lambda o: (o.ts, -o.end))
        stack, k = [], 0
        for i in indices:
            t = events[i]["ts"]
            while k < len(ops) and ops[k].ts <= t:
                while stack and stack[-1].end <= ops[k].ts:
                    stack.pop()
                stack.append(ops[k])
                k += 1
            while stack and stack[-1].end <= t:
                stack.pop()
            names[i] = next((o.name for o in reversed(stack) if o.name not in ALLOCATING and o.end > t), "")
    return names


def is_collective(g: Gpu) -> bool:
    """Whether ``g`` is a collective's kernel (NCCL's)."""
    return g.category == "kernel" and g.name.startswith(COLLECTIVE_PREFIXES)


def _message(trace: Trace, g: Gpu, args: dict) -> None:
    """Record a collective's message size: the larger of its input and output (an all-gather's output, a
    reduce-scatter's input, an all-reduce's either), as NCCL's own tests count a size."""
    if not is_collective(g):
        return
    size = DTYPE_BYTES.get(args.get("dtype"))
    counts = [args.get(key) for key in ("In msg nelems", "Out msg nelems")]
    counts = [n for n in counts if isinstance(n, int) and n >= 0]
    if size and counts:
        trace.message_bytes[g] = max(counts) * size


def merge_intervals(intervals) -> tuple[list, list, list]:
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
        name = region_of_label(e["name"])
        if name:
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
    found[STEP].append((start, end))
    return {name: found[name] for name in REGIONS if found.get(name)}


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


def busy_us(trace: Trace, start: float, end: float) -> float:
    """µs of [start, end) covered by the union of GPU intervals (bisect on the merged intervals)."""
    return covered_us(trace.busy, start, end)


def covered_us(merged: tuple, start: float, end: float) -> float:
    """µs of [start, end) covered by ``merged`` (``merge_intervals``'s result)."""
    starts, ends, cumulative = merged
    i, j = bisect_right(ends, start), bisect_left(starts, end)  # intervals [i, j) overlap [start, end)
    if i >= j:
        return 0.0
    return cumulative[j] - cumulative[i] - max(0.0, start - starts[i]) - max(0.0, ends[j - 1] - end)
