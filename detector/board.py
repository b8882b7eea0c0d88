"""Profile runs in TensorBoard, offline: event files beside each trace, and the `make tensorboard` launcher.

``write_profile_events`` puts into a profile run folder (``runs/profile/<strategy>[-forward]/<time>/``)
what TensorBoard's own dashboards draw without the internet:

- Scalars ``<measure>/<region>``, one point per active step (x = N of ProfilerStep#N): ``region_ms``
  (wall time), ``gpu_busy_ms``, ``gpu_idle_share``, ``launches``, ``kernels``, ``syncs``, ``h2d_copies``,
  ``h2d_bytes``, ``d2h_copies``, ``d2h_bytes``, ``runtime_ms`` (detector.analysis defines each). Every run
  uses the same tags, so one chart overlays all strategies: tick the runs to compare.
- Text ``summary/tables``: the run's settings and its per-region table (markdown).
- Images ``timeline/representative step`` (detector.timeline.draw_step of the median-wall step) and
  ``regions/ms per step`` (median wall and GPU-busy time per region, with launches and syncs written
  beside each bar).

``main`` serves a folder with plain TensorBoard. The PyTorch Profiler plugin (torch-tb-profiler, the
optional ``tb-profiler`` extra) is deprecated upstream and its pages load their charts from the
internet; when it is installed we still patch it for new traces: 0.4.3 knows only the old ``runtime``
event category, and without ``cuda_runtime``/``cuda_driver`` every GPU operator shows 0 device time. Its
loader processes fork (instead of spawn) so that they inherit the patch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from detector.analysis import MEASURES, REGIONS, load_trace, markdown_table
from detector.timeline import REGION_COLORS, draw_step

TABLE_MEASURES = (
    "wall_ms",
    "gpu_busy_ms",
    "gpu_idle_share",
    "launches",
    "kernels",
    "syncs",
    "h2d_copies",
    "h2d_bytes",
    "d2h_copies",
    "runtime_ms",
)
SCALAR_NAMES = {"wall_ms": "region_ms"}  # the tag prefix of a measure, where it differs from its name


def scalar_tag(measure: str, region: str) -> str:
    """``region_ms/forward``, ``syncs/calc loss``: the same tag in every run, so strategies overlay."""
    return f"{SCALAR_NAMES.get(measure, measure)}/{region}"


def write_profile_events(run_dir, summary: dict, events=None) -> None:
    """TensorBoard event files in ``run_dir`` from its summary.json dict (``per_step`` and ``analysis``):
    scalars per step and region, the tables as Text, a timeline and a per-region chart as Images.
    ``events``: the trace (path, dict, event list or analysis.Trace); default ``run_dir/summary["trace"]``."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = Path(run_dir)
    if events is None and summary.get("trace"):
        events = run_dir / summary["trace"]
    with SummaryWriter(log_dir=str(run_dir)) as writer, tempfile.TemporaryDirectory() as tmp:
        for step in summary["per_step"]:
            for region, measures in step["regions"].items():
                for measure in MEASURES:
                    if measures.get(measure) is not None:  # gpu_idle_share is None on a CPU-only trace
                        writer.add_scalar(scalar_tag(measure, region), measures[measure], step["step"])
        writer.add_text("summary/tables", summary_markdown(summary))
        if events is not None:
            trace = load_trace(events)
            step = summary["analysis"]["representative_step"]
            png = draw_step(trace, Path(tmp) / "timeline.png", step=step, title=f"{run_title(summary)}: step {step}")
            writer.add_image("timeline/representative step", read_png(png), dataformats="HWC")
        png = draw_regions(summary, Path(tmp) / "regions.png")
        writer.add_image("regions/ms per step", read_png(png), dataformats="HWC")


def run_title(summary: dict) -> str:
    """``padded, train, NVIDIA H200, torch 2.11.0, batch 1024``: what a picture or table is of."""
    return (
        f"{summary['strategy']}, {summary['mode']}, {summary.get('device', '?')}, torch {summary.get('torch', '?')}, "
        f"batch {summary.get('batch_size', '?')}"
    )


def summary_markdown(summary: dict) -> str:
    """The run's Text card: what ran, then regions x measures, each "median [min–max]" over the steps."""
    analysis = summary["analysis"]
    size = f"{summary.get('image_size', '?')} px, {summary.get('max_boxes', '?')} box slots"
    return "\n".join(
        [
            f"**{run_title(summary)}** ({size}, preset {summary.get('preset', '?')}), run `{summary.get('run', '?')}`",
            "",
            f"Median [min–max] over {analysis['steps']} active steps (ProfilerStep {analysis['step_numbers']}); "
            f"the timeline image shows step {analysis['representative_step']} (median wall time). "
            "Launches: kernel launch calls; syncs: host waits for the GPU (the lab's region-ending synchronize "
            "not counted); H2D/D2H: copies; CUDA API ms: host time in CUDA calls.",
            "",
            markdown_table(analysis, TABLE_MEASURES, band="range"),
        ]
    )


def draw_regions(summary: dict, path) -> Path:
    """Horizontal bars per region: median wall ms with its [min–max], GPU busy inside it, and the median
    launches and syncs written beside each bar (what makes a region slow)."""
    regions = [r for r in REGIONS if r in summary["analysis"]["regions"]]
    stats = summary["analysis"]["regions"]
    fig = Figure(figsize=(10, 1.2 + 0.45 * len(regions)), layout="constrained")
    ax = fig.add_subplot()
    ys = np.arange(len(regions))[::-1]
    for y, region in zip(ys, regions, strict=True):
        wall, busy = stats[region]["wall_ms"], stats[region]["gpu_busy_ms"]
        color = REGION_COLORS.get(region, "#7f7f7f")
        ax.barh(y, wall["median"], color=color, alpha=0.45)
        ax.errorbar(wall["median"], y, xerr=[[wall["median"] - wall["min"]], [wall["max"] - wall["median"]]], color="k")
        if busy["median"]:
            ax.barh(y, busy["median"], height=0.35, color=color)
        counts = f"  {wall['median']:.3g} ms, {stats[region]['launches']['median']:g} launches, "
        ax.text(wall["max"], y, counts + f"{stats[region]['syncs']['median']:g} syncs", va="center", fontsize=8)
    ax.set_yticks(ys, regions)
    ax.set_xlim(0, max(stats[r]["wall_ms"]["max"] for r in regions) * 1.45)  # room for the text
    ax.set_xlabel("ms per step (median; whisker: min–max over the active steps; thin bar: GPU busy)")
    ax.set_title(run_title(summary), fontsize=10)
    fig.savefig(path, dpi=100)
    return Path(path)


def read_png(path) -> np.ndarray:
    """A PNG as the [H, W, 3] uint8 array that SummaryWriter.add_image(dataformats="HWC") takes."""
    from matplotlib.image import imread

    image = imread(path)  # [H, W, 4] float in [0, 1] for a matplotlib PNG
    return (image[..., :3] * 255 + 0.5).astype(np.uint8)


# ----------------------------------------------------------------------------- make tensorboard


def load_profiler_plugin() -> bool:
    """Patch the optional PyTorch Profiler plugin for new traces; False when it is not installed."""
    try:
        from torch_tb_profiler.profiler import trace
    except ImportError:
        return False
    os.environ.setdefault("TORCH_PROFILER_START_METHOD", "fork")  # loader processes inherit the patch
    for category in ("cuda_runtime", "cuda_driver"):
        trace.EventTypeMap.setdefault(category, trace.EventTypes.RUNTIME)
    return True


def main(logdir: str = "runs", port: int = 6006, host: str | None = None) -> None:
    """TensorBoard on ``logdir`` (every interface unless ``host`` is given); blocks until stopped."""
    from tensorboard.main import run_main

    if load_profiler_plugin():
        print(
            "PyTorch Profiler plugin found (#pytorch_profiler): deprecated upstream, and its charts need "
            "internet access in the browser; the dashboards below work offline."
        )
    where = ["--host", host] if host else ["--bind_all"]
    sys.argv = ["tensorboard", "--logdir", str(logdir), "--port", str(port), *where]
    url = f"http://{host or 'localhost'}:{port}/"
    print(
        f"TensorBoard on {url}\n"
        f"  Scalars {url}#scalars     per-step ms, launches, syncs by region: tick runs to overlay; smoothing 0\n"
        f"  Text    {url}#text        each run's tables, and `make compare`'s\n"
        f"  Images  {url}#images      timelines of a representative step, bar charts",
        flush=True,
    )
    run_main()
