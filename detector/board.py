"""Profile runs in TensorBoard, offline: event files beside each trace, and the `make tensorboard` launcher.

``write_profile_events`` puts into a profile run folder (``runs/profile/<strategy>[-forward]/<time>/``)
what TensorBoard's own dashboards draw without the internet:

- Scalars ``<n> <measure>/<i> <region>`` (``2 wall ms/0 step``), one point per active step (x = N of
  ProfilerStep#N), for each measure of detector.measures that is not zero in every step and region of the
  run (a CPU run has no GPU measures). Every run uses the same tags, so one chart overlays all strategies:
  tick the runs to compare. TensorBoard sorts its groups and cards by name, numbers first: the numbers
  put the comparison's charts first (``1 compare``, detector.compare), then each measure in the order of
  detector.measures, and in each the whole step first.
- Text ``summary/tables``: the run's settings, its per-region table, the step as training runs it and
  the analysis' warnings (markdown).
- Images ``<n> each run/timeline of the median step`` (detector.timeline.draw_step of the median-wall
  step) and ``<n> each run/ms per region`` (median wall and GPU time per region, with the counts that
  explain them).

``main`` serves a folder with TensorBoard and its Traces tab (detector.trace_view), all offline.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from detector.analysis import REGIONS, load_trace
from detector.measures import MEASURES, WHY, format_value, gpu_note, legend
from detector.tables import markdown_table, significant
from detector.timeline import REGION_COLORS, draw_step

TIME = (
    "wall_ms",
    "gpu_ms",
    "device_step_ms",
    "gpu_idle_share",
)  # a run table's first columns, then the why measures present


def present(summaries: list[dict], names=tuple(MEASURES)) -> list[str]:
    """The measures among ``names`` that some region of some run has at a non-zero median (wall_ms always):
    a measure that is 0 or missing in every run is neither drawn nor written."""

    def nonzero(name):
        return any(
            (stats.get(name) or {}).get("median") for s in summaries for stats in s["analysis"]["regions"].values()
        )

    return [name for name in names if name == "wall_ms" or nonzero(name)]


def absent_gpu_measures(summaries: list[dict], names) -> list[str]:
    """The GPU-only measures among ``names`` that these runs cannot have: they have no GPU events."""
    return [] if any(s["analysis"].get("gpu") for s in summaries) else [n for n in names if MEASURES[n].gpu_only]


COMPARE_GROUP = "1 compare"  # detector.compare's charts: the landing page's first cards
RUN_GROUP = f"{len(MEASURES) + 2} each run"  # a run's own pictures, after its measures


def scalar_tag(measure: str, region: str) -> str:
    """``2 wall ms/0 step``, ``9 syncs/4 calc loss``: the same tag in every run, so strategies overlay; the
    numbers give TensorBoard's order (it sorts by name): measures as in detector.measures, the step first."""
    group = list(MEASURES).index(measure) + 2
    order = ["step", *(r for r in REGIONS if r != "step")].index(region)
    return f"{group} {MEASURES[measure].header}/{order} {region}"


def write_profile_events(run_dir, summary: dict, events=None) -> None:
    """TensorBoard event files in ``run_dir`` from its summary.json dict (``per_step`` and ``analysis``):
    scalars per step and region, the tables as Text, a timeline and a per-region chart as Images.
    ``events``: the trace (path, dict, event list or analysis.Trace); default ``run_dir/summary["trace"]``."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = Path(run_dir)
    if events is None and summary.get("trace"):
        events = run_dir / summary["trace"]
    written = present([summary])
    with SummaryWriter(log_dir=str(run_dir)) as writer, tempfile.TemporaryDirectory() as tmp:
        for step in summary["per_step"]:
            for region, measures in step["regions"].items():
                for measure in written:
                    if measures.get(measure) is not None:  # gpu_idle_share: the step's alone
                        writer.add_scalar(scalar_tag(measure, region), measures[measure], step["step"])
        writer.add_text("summary/tables", summary_markdown(summary))
        if events is not None:
            trace = load_trace(events)
            step = summary["analysis"]["representative_step"]
            png = draw_step(trace, Path(tmp) / "timeline.png", step=step, title=f"{run_title(summary)}: step {step}")
            writer.add_image(f"{RUN_GROUP}/timeline of the median step", read_png(png), dataformats="HWC")
        png = draw_regions(summary, Path(tmp) / "regions.png")
        writer.add_image(f"{RUN_GROUP}/ms per region", read_png(png), dataformats="HWC")


def run_title(summary: dict) -> str:
    """``padded, train, NVIDIA H200, torch 2.11.0, batch 1024``: what a picture or table is of."""
    return (
        f"{summary['strategy']}, {summary['mode']}, {summary.get('device', '?')}, torch {summary.get('torch', '?')}, "
        f"batch {summary.get('batch_size', '?')}"
    )


def stats_cell(name: str, stats: dict | None) -> str:
    """``12.3 [12.1–12.6]``: the median [q1–q3] of a measure in its unit; one value where they print the same."""
    if not stats or stats.get("median") is None:
        return "–"
    median, q1, q3 = (format_value(name, stats[k]) for k in ("median", "q1", "q3"))
    return median if q1 == q3 == median else f"{median} [{q1}–{q3}]"


def run_table(summary: dict) -> str:
    """Regions x measures of one run, each cell "median [q1–q3]" over the active steps: wall and GPU time,
    then every why measure that is not zero throughout."""
    names = present([summary], TIME + WHY)
    regions = summary["analysis"]["regions"]
    rows = [[region] + [stats_cell(n, regions[region].get(n)) for n in names] for region in regions]
    return markdown_table(["region"] + [MEASURES[n].header for n in names], rows)


def summary_markdown(summary: dict) -> str:
    """The run's Text card: what ran, its table, the step as training runs it, the notes and warnings."""
    analysis = summary["analysis"]
    size = f"{summary.get('image_size', '?')} px, {summary.get('max_boxes', '?')} box slots"
    protocol = (
        "regions synchronised (profile.sync_regions)" if summary.get("sync_regions") else "regions unsynchronised"
    )
    lines = [
        f"**{run_title(summary)}** ({size}, preset {summary.get('preset', '?')}, {protocol}), "
        f"run `{summary.get('run', '?')}`",
        "",
        f"Median [q1–q3] over {analysis['steps']} active steps (ProfilerStep {analysis['step_numbers']}); "
        f"the timeline shows step {analysis['representative_step']} (median wall time).",
        "",
        run_table(summary),
        "",
        timed_note(summary),
    ]
    missing = gpu_note(absent_gpu_measures([summary], TIME + WHY))
    lines += [missing] if missing else []
    lines += ["", legend(present([summary], TIME + WHY))]
    lines += [f"\n**warning**: {w}" for w in analysis.get("warnings", [])]
    return "\n".join(lines)


def timed_note(summary: dict) -> str:
    """One line: the step as training runs it (timed without the profiler) against the profiled step, and
    what the difference is (the profiler's overhead, and the article's syncs under profile.sync_regions).

    On a GPU the profiled step compared is the device's (first kernel to the next step's first kernel): the
    timed steps are CUDA-event times of the device too, while the host's ProfilerStep jitters with how far
    the host runs ahead of the device. On the CPU both are host times."""
    timed = (summary.get("timed") or {}).get("step_ms") or {}
    step = summary["analysis"]["regions"]["step"]
    device = step.get("device_step_ms") or {}
    profiled, where = (device, " on the device") if device.get("median") else (step["wall_ms"], "")
    if not timed.get("n"):
        return "No steps were timed without the profiler (profile.timed=0)."
    ratio = profiled["median"] / timed["median"]
    cause = "the synchronised regions and the profiler" if summary.get("sync_regions") else "the profiler"
    text = (
        f"As training runs it (no profiler, no regions; {timed['n']} steps): step {significant(timed['median'])} ms "
        f"[{significant(timed['q1'])}–{significant(timed['q3'])}]. The profiled step{where} is {ratio:.2f}× that"
    )
    if ratio >= 1:
        text += f": {cause} add{'s' if cause == 'the profiler' else ''} {100 * (ratio - 1):+.0f} %."
    else:  # a profiler cannot make a step faster: the two samples differ by their noise
        text += f" ({100 * (1 - ratio):.0f} % shorter: the profiled and the timed steps differ by their noise)."
    wait = step.get("sync_wait_ms", {}).get("median")
    if summary.get("sync_regions") and wait is not None:
        text += f" The regions' closing synchronize kept the host waiting {significant(wait)} ms per step."
    return text


def draw_regions(summary: dict, path) -> Path:
    """Horizontal bars per region: median wall ms with its [q1–q3], the GPU time it launched (thin bar), and
    beside each bar the counts that explain it (launches and syncs on a GPU, operators on the CPU)."""
    stats = summary["analysis"]["regions"]
    regions = [r for r in REGIONS if r in stats]
    counts = ("launches", "syncs") if summary["analysis"].get("gpu") else ("ops", "host_reads")
    fig = Figure(figsize=(10, 1.2 + 0.45 * len(regions)), layout="constrained")
    ax = fig.add_subplot()
    ys = np.arange(len(regions))[::-1]
    right = 0.0
    for y, region in zip(ys, regions, strict=True):
        wall, gpu = stats[region]["wall_ms"], stats[region].get("gpu_ms") or {}
        color = REGION_COLORS.get(region, "#7f7f7f")
        ax.barh(y, wall["median"], color=color, alpha=0.45)
        ax.errorbar(wall["median"], y, xerr=[[wall["median"] - wall["q1"]], [wall["q3"] - wall["median"]]], color="k")
        if gpu.get("median"):
            ax.barh(y, gpu["median"], height=0.35, color=color)
        end = max(wall["q3"], gpu.get("median") or 0.0)
        right = max(right, end)
        text = ", ".join(f"{format_value(c, stats[region][c]['median'])} {MEASURES[c].header}" for c in counts)
        ax.text(end, y, f"  {significant(wall['median'])} ms, {text}", va="center", fontsize=8)
    ax.set_yticks(ys, regions)
    ax.set_xlim(0, right * 1.5)  # room for the text
    gpu = "; thin bar: the GPU time it launched" if summary["analysis"].get("gpu") else ""
    ax.set_xlabel(f"ms per step (median; whisker: q1–q3 over the active steps{gpu})")
    ax.set_title(run_title(summary), fontsize=10)
    fig.savefig(path, dpi=100)
    return Path(path)


def read_png(path) -> np.ndarray:
    """A PNG as the [H, W, 3] uint8 array that SummaryWriter.add_image(dataformats="HWC") takes."""
    from matplotlib.image import imread

    image = imread(path)  # [H, W, 4] float in [0, 1] for a matplotlib PNG
    return (image[..., :3] * 255 + 0.5).astype(np.uint8)


# ----------------------------------------------------------------------------- make tensorboard


def main(logdir: str = "runs", port: int = 6006, host: str | None = None) -> None:
    """TensorBoard on ``logdir`` (every interface unless ``host`` is given), with the Traces tab
    (detector.trace_view) also where the package is not installed; blocks until stopped."""
    from absl import app
    from tensorboard import default, main_lib, program

    from detector.trace_view import TracesPlugin

    plugins = default.get_plugins()
    if not any(getattr(p, "plugin_name", None) == TracesPlugin.plugin_name for p in plugins):
        plugins.append(TracesPlugin)  # not installed as a package: its entry point is not there
    where = ["--host", host] if host else ["--bind_all"]
    argv = ["tensorboard", "--logdir", str(logdir), "--port", str(port), *where]
    url = f"http://{host or 'localhost'}:{port}/"
    print(
        f"TensorBoard on {url}\n"
        f"  Time Series {url}#timeseries  the comparison's charts first, then each measure per step: tick runs\n"
        f"  Traces      {url}#traces      steps of several runs as lanes on one time axis: zoom, hover, click\n"
        f"  Text        {url}#text        the comparison's verdicts and tables, each run's table",
        flush=True,
    )
    main_lib.global_init()
    tensorboard = program.TensorBoard(plugins=plugins)
    app.run(tensorboard.main, argv=argv, flags_parser=tensorboard.configure)
