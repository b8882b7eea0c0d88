"""Timeline pictures (PNG) of profiled steps, from the same traces as detector.analysis.

``draw_step`` shows one step of one run: the CPU thread with the lab's regions as coloured spans, a thin
tick at each kernel launch (on the region's threads, the autograd thread included) and a red marker at
each host-device sync; below it one row per GPU stream with kernels, memcpy and memset as bars.
``draw_steps`` stacks several runs' representative steps (one CPU row and one GPU row each) on one shared
time axis, so a step four times longer, a wall of launches or a GPU that idles is seen at a glance; the
axis ends at four times the median step, and a longer step is cut there with its length written. The
representative step is the one with the median wall time; time is in ms from the step's start. The
host runs ahead of the device, so a step's kernels may still run after its host part has ended: the GPU
rows show what ran during the step's wall time, whichever step launched it.
"""

from __future__ import annotations

from bisect import bisect_left
from pathlib import Path

from matplotlib.figure import Figure

from detector.analysis import (
    LAUNCHES,
    REGIONS,
    STEP_NAME,
    Trace,
    is_sync,
    load_trace,
    measure_steps,
    representative_step,
    step_regions,
    step_threads,
)

# data wait, copy data, forward, calc loss, backward, optimizer step, step (CUDA graph), other, step
REGION_COLORS = dict(
    zip(
        REGIONS,
        ("#bdbdbd", "#8c564b", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#17becf", "#e7e7e7", "#7f7f7f"),
        strict=True,
    )
)
GPU_COLORS = {"kernel": "#3b5b92", "gpu_memcpy": "#d62728", "gpu_memset": "#e7ba52"}
GPU_LABELS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
LEGEND_ORDER = REGIONS + ("kernel launch", "host-device sync") + tuple(GPU_LABELS.values())
PIXELS = 2000  # bars closer than 1/PIXELS of the axis merge: the loop strategy's 10⁵ kernels draw fast
CLIP = 4  # draw_steps' axis ends at 4x the median step: longer steps are cut, their length written


def draw_step(events, path, step: int | None = None, title: str = "") -> Path:
    """PNG timeline of one step (``step`` = N of ProfilerStep#N; default the median-wall step) of a trace
    (path, dict or event list). Rows: the CPU thread, then each GPU stream. Returns ``path``."""
    trace = events if isinstance(events, Trace) else load_trace(events)
    chosen = _step(trace, step)
    streams = sorted({bar.stream for bar in _gpu_bars(trace, chosen)}, key=str)
    rows = 1 + max(len(streams), 1)
    fig, ax = _figure(rows, title or f"{Path(trace.name).name}: {chosen['name']}")
    width = chosen["dur"] / 1e3
    _draw_cpu(ax, rows - 1, trace, chosen)
    for i, stream in enumerate(streams or [None]):
        _draw_gpu(ax, rows - 2 - i, trace, chosen, width, stream)
    labels = ["CPU"] + ([f"GPU stream {s}" for s in streams] or ["GPU (no events)"])
    return _finish(fig, ax, labels[::-1], width, path)


def draw_steps(runs: list[tuple[str, object]], path, title: str = "") -> Path:
    """PNG of several runs' representative steps, one CPU and one GPU row per run (streams merged), on a
    shared time axis; ``runs`` is [(label, trace path, dict or event list)]. Returns ``path``."""
    if not runs:
        raise ValueError("draw_steps needs at least one (label, trace) run")
    picked = []
    for label, events in runs:
        trace = events if isinstance(events, Trace) else load_trace(events)
        picked.append((label, trace, _step(trace, None)))
    rows = 2 * len(picked)
    fig, ax = _figure(rows, title or "representative step of each run")
    durations = sorted(step["dur"] / 1e3 for *_, step in picked)
    width = min(durations[-1], CLIP * durations[(len(durations) - 1) // 2])  # a 100x slower step stays readable
    labels = []
    for i, (label, trace, step) in enumerate(picked):
        y = rows - 1 - 2 * i
        _draw_cpu(ax, y, trace, step)
        _draw_gpu(ax, y - 1, trace, step, width, stream=None)
        ms = step["dur"] / 1e3
        text = f" {ms:.1f} ms" if ms <= width else f" → {ms:.0f} ms (cut)"
        ax.text(min(ms, width), y, text, va="center", ha="left", fontsize=8)
        labels += [f"{label} CPU", f"{label} GPU"]
        if i:
            ax.axhline(y + 0.5, color="grey", linewidth=0.6)  # between runs
    return _finish(fig, ax, labels[::-1], width * 1.12, path)


def _step(trace: Trace, number: int | None) -> dict:
    """The ProfilerStep annotation numbered ``number``, or the representative (median wall) step."""
    if number is None:
        number = representative_step(measure_steps(trace))["step"]
    for step in trace.steps:
        if int(STEP_NAME.match(step["name"]).group(1)) == number:
            return step
    found = ", ".join(s["name"] for s in trace.steps)
    raise ValueError(f"{trace.name}: no ProfilerStep#{number} (the trace has {found})")


def _gpu_bars(trace: Trace, step: dict) -> list[tuple]:
    """(start, end, category, stream) of the GPU events that start inside the step."""
    start, end = step["ts"], step["ts"] + step["dur"]
    return trace.gpu[bisect_left(trace.gpu, (start,)) : bisect_left(trace.gpu, (end,))]


def _figure(rows: int, title: str):
    """A Figure on the Agg canvas (no pyplot: no global backend or figure state) and its one axes."""
    fig = Figure(figsize=(14, 1.8 + 0.5 * rows), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    return fig, ax


def _draw_cpu(ax, y: float, trace: Trace, step: dict) -> None:
    """Region spans in the lower part of row ``y``, launch ticks and sync markers in the upper part."""
    t0, end = step["ts"], step["ts"] + step["dur"]
    for name, spans in step_regions(trace, step).items():
        if name not in ("step", "other"):
            bars = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in spans]
            ax.broken_barh(bars, (y - 0.4, 0.45), color=REGION_COLORS[name], label=name)
    launches, syncs = [], []
    for tid in step_threads(trace, step):
        starts, calls = trace.call_starts.get(tid, []), trace.calls.get(tid, [])
        for i in range(bisect_left(starts, t0), bisect_left(starts, end)):
            if calls[i].name in LAUNCHES:
                launches.append((calls[i].ts - t0) / 1e3)
            elif is_sync(trace, tid, i):
                syncs.append((calls[i].ts - t0) / 1e3)
    if launches:
        ax.vlines(launches, y + 0.1, y + 0.4, color="black", linewidth=0.3, label="kernel launch")
    if syncs:
        ax.plot(syncs, [y + 0.25] * len(syncs), "v", color="red", markersize=6, label="host-device sync")


def _draw_gpu(ax, y: float, trace: Trace, step: dict, width: float, stream) -> None:
    """Kernel, memset and memcpy bars of one stream (every stream when ``stream`` is None) in row ``y``."""
    t0 = step["ts"]
    bars = [b for b in _gpu_bars(trace, step) if stream is None or b.stream == stream]
    for category in ("kernel", "gpu_memset", "gpu_memcpy"):  # copies last: drawn on top
        merged = _merge_close([b for b in bars if b.category == category], gap=width * 1e3 / PIXELS)
        if not merged:
            continue  # no empty legend entries
        spans = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in merged]
        color = GPU_COLORS[category]
        ax.broken_barh(
            spans, (y - 0.35, 0.7), facecolor=color, edgecolor=color, linewidth=0.3, label=GPU_LABELS[category]
        )


def _merge_close(bars: list[tuple], gap: float) -> list[tuple[float, float]]:
    """(start, end) of bars sorted by start, those less than ``gap`` µs apart merged (a pixel is wider)."""
    merged = []
    for start, end, *_ in bars:
        if merged and start - merged[-1][1] < gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _finish(fig, ax, labels: list[str], xmax: float, path) -> Path:
    """Row labels (bottom to top), axis limits, one legend entry per label; save the PNG."""
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.set_xlim(0, xmax)
    ax.set_xlabel("ms from the step's start")
    ax.grid(axis="x", alpha=0.3)
    drawn = dict(zip(*ax.get_legend_handles_labels()[::-1], strict=True))  # label -> handle, one each
    handles = {label: drawn[label] for label in LEGEND_ORDER if label in drawn}
    fig.legend(
        handles.values(), handles.keys(), loc="outside lower center", ncol=max(1, min(len(handles), 11)), fontsize=8
    )
    fig.savefig(path, dpi=110)
    return Path(path)
