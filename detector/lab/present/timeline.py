"""Timeline pictures (PNG) of profiled steps, drawn from the lab's model of a step (detector/lab/measure/extract.py):
the same events TensorBoard's Traces tab draws.

``draw_step`` shows one step of one run: the host's regions as coloured spans, a thin tick at each kernel
launch and a red marker at each host-device sync; below, one row per GPU stream with the work the step
launched, coloured by the region whose call launched it, wherever it ran: the host runs ahead of the
device, so a step's kernels often run after its host part has ended. ``draw_steps`` stacks several runs'
representative steps (one host row and one GPU row each) on one time axis, so a step four times longer, a
wall of launches or a GPU that idles is seen at a glance; the axis ends at four times the median step,
and a longer step is cut there with its length written. A run without GPU work draws no GPU rows, and the
legend names only what is drawn. ``draw_memory`` draws each run's bytes allocated over its step, one panel a run,
each level coloured by the region whose allocation or free set it: where a strategy's memory rises, and how far.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from detector.lab.record.measures import memory_text
from detector.lab.record.steps import LAUNCH, SYNC, StepModel
from detector.regions import OTHER, REGIONS

# data wait, copy data, forward, calc loss, backward, optimizer step, step (CUDA graph), other, step
REGION_COLORS = dict(
    zip(
        REGIONS,
        ("#bdbdbd", "#8c564b", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#17becf", "#7f7f7f", "#4d4d4d"),
        strict=True,
    )
)
LAUNCH_COLOR, SYNC_COLOR = "#000000", "#d62728"
COPY_EDGE = "#d62728"  # a copy's outline, whatever region launched it: per-image copies stand out
PIXELS = 2000  # bars closer than 1/PIXELS of the axis merge: the loop strategy's 10⁵ kernels draw fast
CLIP = 4  # draw_steps' axis ends at 4x the median step: longer steps are cut, their length written


def draw_step(model: StepModel, path, title: str = "") -> Path:
    """PNG timeline of one step: the host row, then each GPU stream's row (none on a CPU run)."""
    streams = sorted({stream for stream, *_ in model.gpu_events()}, key=str)
    rows = 1 + len(streams)
    fig, ax = _figure(rows, title or f"step {model.number}")
    width = model.end() / 1e3
    _draw_host(ax, rows - 1, model)
    for i, stream in enumerate(streams):
        _draw_gpu(ax, rows - 2 - i, model, width, stream)
    labels = ["host"] + [f"GPU stream {s}" for s in streams]
    return _finish(fig, ax, labels[::-1], width, path)


def draw_steps(runs: list[tuple[str, StepModel]], path, title: str = "") -> Path:
    """PNG of several runs' steps on a shared time axis, a host row and (for runs with GPU work) a GPU row per
    run, the streams merged; ``runs`` is [(label, model)]. Returns ``path``."""
    if not runs:
        raise ValueError("draw_steps needs at least one (label, step) run")
    heights = [2 if model.gpu_events() else 1 for _, model in runs]
    rows = sum(heights)
    fig, ax = _figure(rows, title or "representative step of each run")
    ends = sorted(model.end() / 1e3 for _, model in runs)
    width = min(ends[-1], CLIP * ends[(len(ends) - 1) // 2])  # a 100x slower step stays readable
    labels, y = [], rows - 1
    for i, ((label, model), height) in enumerate(zip(runs, heights, strict=True)):
        _draw_host(ax, y, model)
        labels.append(f"{label} host")
        if height == 2:
            _draw_gpu(ax, y - 1, model, width, stream=None)
            labels.append(f"{label} GPU")
        ms = model.end() / 1e3
        text = f" {ms:.1f} ms" if ms <= width else f" → {ms:.0f} ms (cut)"
        ax.text(min(ms, width), y, text, va="center", ha="left", fontsize=8)
        if i:
            ax.axhline(y + 0.5, color="grey", linewidth=0.6)  # between runs
        y -= height
    return _finish(fig, ax, labels[::-1], width * 1.12, path)


def _figure(rows: int, title: str):
    """A Figure on the Agg canvas (no pyplot: no global backend or figure state) and its one axes."""
    fig = Figure(figsize=(14, 1.8 + 0.5 * rows), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    return fig, ax


def _draw_host(ax, y: float, model: StepModel) -> None:
    """Region spans in the lower part of row ``y``, launch ticks and sync markers in the upper part."""
    spans: dict[str, list] = {}
    for name, start, dur in model.regions():
        spans.setdefault(name, []).append((start / 1e3, dur / 1e3))
    for name in REGIONS:
        if name in spans:
            ax.broken_barh(spans[name], (y - 0.4, 0.45), color=REGION_COLORS[name], label=name)
    launches, syncs = model.calls(LAUNCH), model.calls(SYNC)
    if launches:
        ticks = [t / 1e3 for t in launches]
        ax.vlines(ticks, y + 0.1, y + 0.4, color=LAUNCH_COLOR, linewidth=0.3, label="kernel launch")
    if syncs:
        marks = [t / 1e3 for t in syncs]
        ax.plot(marks, [y + 0.25] * len(marks), "v", color=SYNC_COLOR, markersize=6, label="host-device sync")


def _draw_gpu(ax, y: float, model: StepModel, width: float, stream) -> None:
    """The GPU work of one stream (every stream when ``stream`` is None) in row ``y``, coloured by the region
    that launched it; copies outlined."""
    gap = width * 1e3 / PIXELS
    events = sorted(
        (start, start + dur, category, region)
        for s, start, dur, category, region in model.gpu_events()
        if stream is None or s == stream
    )
    for region in REGIONS:
        bars = _merge_close([(a, b) for a, b, _, r in events if r == region], gap)
        if bars:
            spans = [(a / 1e3, (b - a) / 1e3) for a, b in bars]
            color = REGION_COLORS[region]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolor=color, edgecolor=color, linewidth=0.3, label=region)
    copies = _merge_close([(a, b) for a, b, category, _ in events if category == "gpu_memcpy"], gap)
    if copies:
        spans = [(a / 1e3, (b - a) / 1e3) for a, b in copies]
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolor="none", edgecolor=COPY_EDGE, linewidth=0.8, label="copy")


def _merge_close(bars: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """(start, end) of bars sorted by start, those less than ``gap`` µs apart merged (a pixel is wider)."""
    merged: list[tuple[float, float]] = []
    for start, end in bars:
        if merged and start - merged[-1][1] < gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def draw_memory(runs: list[tuple[str, StepModel]], path, title: str = "") -> Path | None:
    """PNG of the bytes allocated over each run's step (``runs``: [(label, model)]), a panel a run on a shared time
    axis, the area under the curve coloured by region; each panel's axis spans its own lowest to highest, and its
    label says the peak and how far it rose over the step's start. None where no run recorded memory."""
    drawn = [(label, model, model.memory()) for label, model in runs]
    drawn = [(label, model, memory) for label, model, memory in drawn if memory]  # a step of no event: flat
    if not drawn:
        return None
    fig = Figure(figsize=(14, 1.2 + 1.3 * len(drawn)), layout="constrained")
    axes = fig.subplots(len(drawn), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title or "bytes allocated over each run's step", fontsize=11)
    width = max(model.dur for _, model, _ in drawn) / 1e3
    for ax, (label, model, (start, rows)) in zip(axes, drawn, strict=True):
        times = [0.0] + [t / 1e3 for t, *_ in rows] + [model.dur / 1e3]
        levels = [start] + [allocated for _, allocated, *_ in rows]
        regions = [rows[0][4] if rows else OTHER] + [region for *_, region in rows]
        low, high = min(levels), max(levels)
        levels.append(levels[-1])  # the last level holds to the step's end
        regions.append(regions[-1])
        for name in REGIONS:  # each level holds until the next event, in the colour of its region: the others at 0
            mine = [level if region == name else low for level, region in zip(levels, regions, strict=True)]
            if any(region == name for region in regions):
                ax.fill_between(times, low, mine, step="post", color=REGION_COLORS[name], linewidth=0, label=name)
        ax.step(times, levels, where="post", color="#333333", linewidth=0.5)
        ax.set_ylim(low - 0.02 * (high - low + 1), high + 0.08 * (high - low + 1))
        ax.set_yticks([low, high], [memory_text(low), memory_text(high)], fontsize=7)
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
        ax.set_title(
            f"peak {memory_text(high)}, {memory_text(high - start)} over the step's start", loc="right", fontsize=8
        )
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, width)
    axes[-1].set_xlabel("ms from the step's start (host time: the allocator serves the host as it dispatches)")
    handles = {}
    for ax in axes:
        handles |= dict(zip(*ax.get_legend_handles_labels()[::-1], strict=True))
    shown = {name: handles[name] for name in REGIONS if name in handles}
    fig.legend(shown.values(), shown.keys(), loc="outside lower center", ncol=len(shown), fontsize=8)
    fig.savefig(path, dpi=110)
    return Path(path)


LEGEND_ORDER = REGIONS + ("kernel launch", "host-device sync", "copy")


def _finish(fig, ax, labels: list[str], xmax: float, path) -> Path:
    """Row labels (bottom to top), axis limits, one legend entry per label drawn; save the PNG."""
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.set_xlim(0, xmax)
    ax.set_xlabel("ms from the step's start (GPU rows: the work the step launched, coloured by region)")
    ax.grid(axis="x", alpha=0.3)
    drawn = dict(zip(*ax.get_legend_handles_labels()[::-1], strict=True))  # label -> handle, one each
    handles = {label: drawn[label] for label in LEGEND_ORDER if label in drawn}
    fig.legend(
        handles.values(), handles.keys(), loc="outside lower center", ncol=max(1, min(len(handles), 11)), fontsize=8
    )
    fig.savefig(path, dpi=110)
    return Path(path)
