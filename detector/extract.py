"""A compact per-step extract of a profile run: what TensorBoard's Traces tab (detector.trace_view) draws.

`make profile` writes ``extract.json.gz`` beside the trace, so that the tab reads a few kilobytes per
step instead of parsing the whole trace on every request (a loop trace is hundreds of MB of JSON). An
older run without one is converted on first read (``load``).

Every time is in µs from the step's start (the ProfilerStep's start on the host). Per step:

- ``regions``: the lab's regions on the step's thread, ``[name, start, duration]``;
- ``threads``: each thread of the process that ran operators in the step, with its top-level operators
  ``[start, duration, name]`` (names are indices into the extract's ``names``);
- ``calls``: the CUDA calls that launched device work or made the host wait, ``[start, duration, thread,
  name, region, flags]`` (flags: 1 a kernel launch, 2 a host-device sync);
- ``streams``: per GPU stream, the kernels, copies and memsets the step's calls launched, whenever they
  ran, ``[start, duration, category, name, call]``: the host runs ahead, so a step's device work often
  starts after its host part has ended;
- ``why``: every measure of each region in this step (detector.measures), for the tab's region panel.
"""

from __future__ import annotations

import gzip
import json
from bisect import bisect_left, bisect_right
from pathlib import Path

from detector.analysis import (
    LAUNCHES,
    OTHER,
    Trace,
    call_range,
    is_sync,
    load_trace,
    measure_steps,
    representative_step,
    step_regions,
    step_threads,
)

EXTRACT = "extract.json.gz"
VERSION = 1
CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH, SYNC = 1, 2  # a call's flags


class Names:
    """A string table: each name stored once, referred to by its index."""

    def __init__(self):
        self.index: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        return self.index.setdefault(name, len(self.index))

    def table(self) -> list[str]:
        return list(self.index)


def build(source, steps: list[dict] | None = None, about: dict | None = None) -> dict:
    """The extract of a trace (path, events or analysis.Trace): every ProfilerStep; ``steps`` its
    ``measure_steps`` when the caller has them; ``about`` the run's facts (strategy, mode, device...)."""
    trace = load_trace(source)
    steps = measure_steps(trace) if steps is None else steps
    names = Names()
    extracted = {}
    for event, measured in zip(trace.steps, steps, strict=True):
        extracted[str(measured["step"])] = step_extract(trace, event, measured, names)
    return {
        "version": VERSION,
        "about": about or {},
        "gpu": trace.has_gpu,
        "representative_step": representative_step(steps)["step"],
        "steps": extracted,
        "names": names.table(),
    }


def step_extract(trace: Trace, step: dict, measured: dict, names: Names) -> dict:
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    spans = step_regions(trace, step)
    regions = sorted((a, b, name) for name, found in spans.items() if name not in (OTHER, "step") for a, b in found)
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
            threads.append({"tid": tid, "ops": [[us(o.ts - t0), us(o.end - o.ts), names(o.name)] for o in ops]})
    return {
        "dur": us(t1 - t0),
        "regions": [[name, us(a - t0), us(b - a)] for a, b, name in regions],
        "threads": threads,
        "calls": calls,
        "streams": [{"stream": str(s), "events": sorted(rows)} for s, rows in sorted(streams.items(), key=str)],
        "why": {
            region: {m: v for m, v in values.items() if v is not None} for region, values in measured["regions"].items()
        },
    }


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


def write(run_dir, extract: dict) -> Path:
    path = Path(run_dir) / EXTRACT
    temp = path.with_name(f".{path.name}.new")
    with gzip.open(temp, "wt", compresslevel=6) as f:
        json.dump(extract, f, separators=(",", ":"))
    temp.replace(path)
    return path


def load(run_dir) -> dict:
    """The extract of a profile run folder, built from its trace and written on first read when missing;
    ValueError with a one-line reason when neither can be read."""
    run_dir = Path(run_dir)
    path = run_dir / EXTRACT
    if path.is_file():
        try:
            with gzip.open(path, "rt") as f:
                extract = json.load(f)
        except (OSError, EOFError, ValueError) as err:
            raise ValueError(f"{path}: cannot read it ({type(err).__name__}); delete it to rebuild it") from None
        if extract.get("version") == VERSION:
            return extract
    summary = read_summary(run_dir)
    trace = run_dir / summary.get("trace", "")
    if not summary.get("trace") or not trace.is_file():
        raise ValueError(f"{run_dir}: no extract and no trace to build one from")
    about = {k: summary.get(k) for k in ("strategy", "mode", "device", "torch", "batch_size")}
    extract = build(trace, about=about)
    try:
        write(run_dir, extract)
    except OSError:
        pass  # a read-only run folder: served all the same, built again next time
    return extract


def read_summary(run_dir: Path) -> dict:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{run_dir}: no readable summary.json ({type(err).__name__})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{run_dir}/summary.json: not a JSON object")
    return summary
