"""The lab's one model of a profiled step: what it launched, placed where it ran. Both pictures draw it: the
PNG timeline (detector/lab/present/timeline.py) and TensorBoard's Traces tab (detector/board/).

`make profile` writes it as ``extract.json.gz`` beside the trace (its record: detector/lab/record/steps.py ``Extract``,
each step a typed ``Step``), so that the tab reads a few kilobytes per step instead of parsing the whole trace on every
request (a loop trace is hundreds of MB of JSON). An older run without one is converted on first read (``load``).

Every time is in µs from the step's start (the ProfilerStep's start on the host; ``start``, that start on
the host's clock, which the ranks of one host share). Per step:

- ``regions``: the lab's regions on the step's thread, ``[name, start, duration]``;
- ``threads``: each thread of the process that ran operators in the step, with its top-level operators
  ``[start, duration, name]`` (names are indices into the extract's ``names``);
- ``calls``: the CUDA calls that launched device work or made the host wait, ``[start, duration, thread,
  name, region, flags]`` (flags: 1 a kernel launch, 2 a host-device sync);
- ``streams``: per GPU stream, the kernels, copies and memsets the step's calls launched, whenever they
  ran, ``[start, duration, category, name, call]``: the host runs ahead, so a step's device work often
  starts after its host part has ended;
- ``why``: every measure of each region in this step (detector/lab/record/measures.py), for the tab's region panel;
- ``memory`` (where the profile recorded memory): the run's device (``cuda:0``, ``cpu``), the bytes allocated
  when the step began (``start``), the allocator's events in it (``events``) and ``rows`` ``[start, allocated,
  bytes, operator]``: the bytes allocated after each allocation (bytes > 0) or free (< 0) and the operator it is
  attributed to (-1: none), as a user reads it (``MemoryNames``: a compiled graph's own allocation is named by the
  graph and the operator it came before or after, not by inductor's ``## Call CompiledFxGraph <hash> ##``). A step
  of more than MEMORY_ROWS events keeps, in each of MEMORY_ROWS / 4 equal slices of its time, the first, the last,
  the highest and the lowest: the curve's envelope, its peak exact.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from pathlib import Path

from detector.checked import RecordError, read_json
from detector.lab.measure.analysis import measure_steps
from detector.lab.measure.trace import (
    ALLOCATING,
    LAUNCHES,
    TRACE_BYTES,
    Trace,
    call_range,
    is_sync,
    load_trace,
    step_regions,
    step_threads,
)
from detector.lab.record.run import ProfileRecord, StepMeasures, representative_step
from detector.lab.record.steps import (
    CATEGORIES,
    EXTRACT,
    LAUNCH,
    SYNC,
    Extract,
    Step,
    StepMemory,
    Stream,
    Thread,
    read_extract,
    write_extract,
)
from detector.regions import OTHER, STEP

# memory events kept per step: a GPU step of the loop strategy allocates ~10^5 times, and a screen is ~2000 px wide
MEMORY_ROWS = 8000
# torch.compile's frames in a trace: inductor's call of a compiled graph (a record function named by the graph's
# hash), the compiled region (Dynamo's frame) that runs a forward graph, and the autograd node that runs a backward one
COMPILED_GRAPH = re.compile(r"## Call CompiledFxGraph \S+ ##")
COMPILED_REGION = re.compile(r"Torch-Compiled Region: (\S+)")
COMPILED_BACKWARD = "CompiledFunctionBackward"
NEIGHBOURS = 256  # the operators looked back over for the one a free in a compiled graph came after


class Names:
    """A string table: each name stored once, referred to by its index."""

    def __init__(self):
        self.index: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        return self.index.setdefault(name, len(self.index))

    def table(self) -> list[str]:
        return list(self.index)


def build(source, steps: list[StepMeasures] | None = None, about: dict | None = None) -> Extract:
    """The extract of a trace (path, events or trace.Trace): every ProfilerStep; ``steps`` its
    ``measure_steps`` when the caller has them; ``about`` the run's facts (strategy, mode, device...)."""
    trace = load_trace(source)
    steps = measure_steps(trace) if steps is None else steps
    names, memory_names = Names(), MemoryNames(trace)
    extracted = {}
    for event, measured in zip(trace.steps, steps, strict=True):
        extracted[str(measured.step)] = step_extract(trace, event, measured, names, memory_names)
    return Extract(
        about=about or {},
        gpu=trace.has_gpu,
        representative_step=representative_step(steps).step,
        steps=extracted,
        names=names.table(),
    )


def step_extract(
    trace: Trace, step: dict, measured: StepMeasures, names: Names, memory_names: MemoryNames | None = None
) -> Step:
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    spans = step_regions(trace, step)
    regions = sorted((a, b, name) for name, found in spans.items() if name not in (OTHER, STEP) for a, b in found)
    starts = [a for a, _, _ in regions]

    def region_of(ts: float) -> int:
        i = bisect_right(starts, ts) - 1
        return i if i >= 0 and ts < regions[i][1] else -1  # -1: outside the regions ("other")

    threads, calls, streams = [], [], {}
    for tid in step_threads(trace, step):
        ops = top_level(trace.op_events.get(tid, []), t0, t1)
        thread, first = len(threads), len(calls)
        for i in range(*call_range(trace, tid, t0, t1)):
            call = trace.calls[tid][i]
            flags = LAUNCH * (call.name in LAUNCHES) + SYNC * is_sync(trace, tid, i)
            launched = trace.launched.get(call.correlation, ())
            if not flags and not launched:
                continue
            index = len(calls)
            calls.append(
                [us(call.ts - t0), us(call.end - call.ts), thread, names(call.name), region_of(call.ts), flags]
            )
            for g in launched:
                row = [us(g.ts - t0), us(g.end - g.ts), CATEGORIES.index(g.category), names(g.name), index]
                streams.setdefault(g.stream, []).append(row)
        if ops or len(calls) > first:  # a thread that only polled (event queries) is left out
            threads.append(Thread(tid, [[us(o.ts - t0), us(o.end - o.ts), names(o.name)] for o in ops]))
    return Step(
        start=t0,  # µs on the host's clock: one host's ranks share it, so their steps align on one axis
        dur=us(t1 - t0),
        regions=[[name, us(a - t0), us(b - a)] for a, b, name in regions],
        threads=threads,
        calls=calls,
        streams=[Stream(str(s), sorted(rows)) for s, rows in sorted(streams.items(), key=str)],
        why={region: {m: v for m, v in values.items() if v is not None} for region, values in measured.regions.items()},
        memory=memory_rows(trace, t0, t1, names, memory_names or MemoryNames(trace)),
    )


def memory_rows(trace: Trace, t0: float, t1: float, names: Names, memory_names: MemoryNames) -> StepMemory | None:
    """The memory of the step [t0, t1) (see the module docstring), or None where the trace has no memory."""
    memory = trace.memory
    if memory is None:
        return None
    i, j = bisect_left(memory.ts, t0), bisect_left(memory.ts, t1)
    kept = envelope(memory.ts, memory.allocated, i, j, t0, t1) if j - i > MEMORY_ROWS else range(i, j)
    rows = []
    for k in kept:
        op = memory_names(memory.ops[k], memory.ts[k], memory.bytes[k] > 0) if memory.ops[k] else ""
        rows.append([us(memory.ts[k] - t0), memory.allocated[k], memory.bytes[k], names(op) if op else -1])
    return StepMemory(memory.device, memory.level(i), j - i, rows)


class MemoryNames:
    """The operator of an allocator's event as a user recognises it. Most are an operator's own name (``aten::mm``),
    kept. An allocation that a compiled graph's own code makes (inductor's buffers, between its kernels) falls in no
    operator but the graph's call, a record function named ``## Call CompiledFxGraph <hash> ##``: it is named by the
    graph, which Dynamo's region ran it (``Torch-Compiled Region: 0/0``) or whether autograd ran it backward, and the
    operator of the graph it came just before (an allocation: the buffer of the kernel launched next) or just after (a
    free): ``compiled graph (forward, region 0/0), before triton_poi_fused_relu_0``."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.calls: dict[str, list[tuple[float, float, object]]] = {}  # graph's call -> its (start, end, thread)
        self.frames: dict[object, list] = {}  # thread -> its compiled regions and backward nodes
        for tid, ops in trace.op_events.items():
            for op in ops:
                if COMPILED_GRAPH.fullmatch(op.name):
                    self.calls.setdefault(op.name, []).append((op.ts, op.end, tid))
                elif op.name == COMPILED_BACKWARD or COMPILED_REGION.fullmatch(op.name):
                    self.frames.setdefault(tid, []).append(op)

    def __call__(self, name: str, t: float, allocation: bool) -> str:
        if not COMPILED_GRAPH.fullmatch(name):
            return name
        call = next(((a, b, tid) for a, b, tid in self.calls.get(name, ()) if a <= t < b), None)
        if call is None:
            return "a compiled graph"
        graph = f"compiled graph ({self.kind(*call)})"
        op = self.next_op(*call, t) if allocation else self.previous_op(*call, t)
        return f"{graph}, {'before' if allocation else 'after'} {op.name}" if op else graph

    def kind(self, start: float, end: float, tid) -> str:
        """``forward, region 0/0`` (the innermost compiled region around the call), ``backward``, or ``forward``."""
        around = [f for f in self.frames.get(tid, ()) if f.ts <= start and end <= f.end]
        if not around:
            return "forward"
        frame = max(around, key=lambda f: f.ts)
        region = COMPILED_REGION.fullmatch(frame.name)
        return f"forward, region {region.group(1)}" if region else "backward"

    def next_op(self, start: float, end: float, tid, t: float):
        """The graph's first operator that starts at ``t`` or after (an allocating primitive skipped), or None."""
        ops = self.trace.op_events[tid]
        for op in ops[bisect_left(ops, (t,)) :]:
            if op.ts >= end:
                return None
            if op.name not in ALLOCATING:
                return op
        return None

    def previous_op(self, start: float, end: float, tid, t: float):
        """The graph's operator that ended last before ``t`` (the outermost of those ending together), or None."""
        ops = self.trace.op_events[tid]
        found = None
        for k in range(bisect_left(ops, (t,)) - 1, max(-1, bisect_left(ops, (t,)) - 1 - NEIGHBOURS), -1):
            op = ops[k]
            if op.ts <= start:
                break
            if op.end <= t and op.name not in ALLOCATING and (found is None or op.end >= found.end):
                found = op
        return found


def envelope(ts: list, values: list, i: int, j: int, t0: float, t1: float) -> list[int]:
    """The indices in [i, j) that keep the curve's shape: in each of MEMORY_ROWS / 4 slices of [t0, t1), its first,
    last, highest and lowest event."""
    slices, width = MEMORY_ROWS // 4, max(t1 - t0, 1e-9)
    kept, current, first = set(), None, None
    low = high = None
    for k in range(i, j):
        s = min(slices - 1, int((ts[k] - t0) / width * slices))
        if s != current:
            if current is not None:
                kept.update((first, k - 1, low, high))
            current, first, low, high = s, k, k, k
        if values[k] > values[high]:
            high = k
        if values[k] < values[low]:
            low = k
    if current is not None:
        kept.update((first, j - 1, low, high))
    return sorted(kept)


def top_level(ops: list, start: float, end: float) -> list:
    """The operators of one thread (sorted) that start in [start, end) and are not inside an earlier one."""
    out, covered = [], start
    for op in ops[bisect_left(ops, (start,)) :]:
        if op.ts >= end:
            break
        if op.ts >= covered:
            out.append(op)
            covered = op.end
    return out


def us(value: float) -> float:
    return round(value, 2)


def load(run_dir: Path, record: ProfileRecord, trace: Path | None, keep: bool = True) -> Extract:
    """The extract of a profile run folder: its extract.json.gz, else built from ``trace`` (the run's trace file;
    None where it has none that may be read: which files are the run's is the caller's to decide) and, when
    ``keep``, written beside it for the next read. Each file is read under a cap on its decompressed size
    (EXTRACT_BYTES, TRACE_BYTES). RecordError with a one-line reason when neither can be read."""
    path = Path(run_dir) / EXTRACT
    if path.is_file():
        try:
            return read_extract(path)
        except RecordError as err:
            if "version" not in str(err):
                raise
    if trace is None or not trace.is_file():
        raise RecordError(f"{run_dir}: no {EXTRACT} and no trace to build one from")
    events = read_json(trace, TRACE_BYTES)
    try:
        extract = build(events, about=about(record))
    except ValueError as err:
        raise RecordError(f"{trace}: {str(err).removeprefix('<events>: ')}") from None
    if keep:
        try:
            write_extract(run_dir, extract)
        except OSError:
            pass  # a read-only run folder: served all the same, built again next time
    return extract


def about(record: ProfileRecord) -> dict:
    """What an extract says of its run."""
    return {
        "strategy": record.strategy,
        "mode": record.mode,
        "device": record.device,
        "torch": record.torch,
        "batch_size": record.batch_size,
    }
