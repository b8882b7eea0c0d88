"""The lab's vocabulary: every measure of a profiled region, once, with its unit and meaning.

detector/lab/analysis.py computes these from a trace; `make profile`, `make compare`, TensorBoard
(detector/board/) and `make report` name, format and explain them from this table alone. A measure marked
``gpu_only`` is ``None`` on a trace without GPU events (a CPU run): the tables then say once that it needs
a GPU, instead of printing zeros.

Times are per step and region; counts are calls or events that *start* inside the region, on any thread
of the profiled process (the autograd engine launches the backward's kernels from threads of its own).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    name: str  # the key in summary.json, and the TensorBoard tag's first part
    header: str  # a table's column header
    unit: str  # "ms", "count", "bytes" or "share"
    meaning: str  # one sentence: what it counts and why it matters
    gpu_only: bool = False


MEASURES: dict[str, Measure] = {
    m.name: m
    for m in (
        Measure(
            "wall_ms",
            "wall ms",
            "ms",
            "the region's time on the host; for the whole step, what training's throughput sees",
        ),
        Measure(
            "gpu_ms",
            "GPU ms",
            "ms",
            "device time of the kernels, copies and memsets the region launched, whenever they ran "
            "(streams overlapping counted once): the device's share of the work",
            gpu_only=True,
        ),
        Measure(
            "device_step_ms",
            "device step ms",
            "ms",
            "the step as the device runs it: from the start of its first GPU work to the start of the next "
            "step's (the last step: to the end of its own). The host runs ahead, so the host's step times "
            "jitter with the launch queue; this is what training's throughput is made of",
            gpu_only=True,
        ),
        Measure(
            "gpu_idle_share",
            "GPU idle",
            "share",
            "the share of the step's wall time in which the device ran nothing: near 100 % when the host "
            "(Python, launches, syncs, the loader) cannot keep it busy",
            gpu_only=True,
        ),
        Measure(
            "ops",
            "operators",
            "count",
            "PyTorch operators dispatched (aten::*, nested ones too): each costs the host microseconds, so a "
            "loss that loops over images dispatches B times as many",
        ),
        Measure(
            "slices",
            "slices",
            "count",
            "select, slice, narrow, split and unbind calls: per-image code takes the batch apart image by "
            "image, and each slice's backward writes a tensor of the whole batch's shape",
        ),
        Measure(
            "host_reads",
            "host reads",
            "count",
            "operators whose result the host must read before it goes on (.item(), nonzero, masked_select): "
            "data-dependent shapes; on a GPU each one is a host-device sync",
        ),
        Measure(
            "launches",
            "launches",
            "count",
            "kernel launch calls (a CUDA graph's replay counts once): each costs the host microseconds",
            gpu_only=True,
        ),
        Measure(
            "kernels",
            "kernels",
            "count",
            "kernels the device ran for those launches (a graph replay runs many)",
            gpu_only=True,
        ),
        Measure(
            "syncs",
            "syncs",
            "count",
            "host waits for the device: synchronize calls, synchronous copies, .item() and .cpu(); the host "
            "cannot run ahead past one",
            gpu_only=True,
        ),
        Measure(
            "h2d_copies",
            "H2D copies",
            "count",
            "host-to-device copies: per-image targets show here as one copy per image",
            gpu_only=True,
        ),
        Measure("h2d_bytes", "H2D bytes", "bytes", "bytes those copies moved", gpu_only=True),
        Measure(
            "d2h_copies",
            "D2H copies",
            "count",
            "device-to-host copies: values the host reads back",
            gpu_only=True,
        ),
        Measure("d2h_bytes", "D2H bytes", "bytes", "bytes those copies moved", gpu_only=True),
        Measure(
            "runtime_ms",
            "CUDA API ms",
            "ms",
            "host time inside CUDA runtime and driver calls: launch overhead, and waits in syncs",
            gpu_only=True,
        ),
        Measure(
            "sync_wait_ms",
            "lab sync ms",
            "ms",
            "host time in the synchronize that ends each region under profile.sync_regions=true: what the "
            "article's protocol makes the host wait (not counted in syncs or CUDA API ms)",
            gpu_only=True,
        ),
        Measure(
            "comm_ms",
            "comm ms",
            "ms",
            "device time of the collectives (NCCL's kernels: gradient reduces, weight gathers, broadcasts) the "
            "region launched, whenever they ran (overlapping ones counted once): the communication between the "
            "GPUs, on a run of several",
            gpu_only=True,
        ),
        Measure(
            "comm_bytes",
            "comm bytes",
            "bytes",
            "the messages of those collectives where the trace gives their size: each one's larger of input and "
            "output (an all-gather's output, a reduce-scatter's input), as NCCL's own tests count a size",
            gpu_only=True,
        ),
        Measure(
            "comm_hidden_share",
            "comm hidden",
            "share",
            "the share of those collectives' device time in which a compute kernel ran beside them on another "
            "stream: the communication the compute hid. What is not hidden, the step waits for",
            gpu_only=True,
        ),
    )
}

# The columns of a why table: what makes a region cost what it costs (wall and GPU time have their own).
WHY = ("ops", "slices", "host_reads", "launches", "kernels", "syncs", "h2d_copies", "d2h_copies", "runtime_ms")
# Counts drawn on a log axis by `make compare`, in this order where a run has them.
COUNTS = ("ops", "launches", "syncs", "h2d_copies", "host_reads", "slices")
# The counts that no load on the machine changes: a verdict leads with them (detector/lab/verdicts.py).
STABLE = ("ops", "slices", "host_reads", "launches", "syncs", "h2d_copies", "d2h_copies")


def present(records, names=tuple(MEASURES)) -> list[str]:
    """The measures among ``names`` that some region of some run has at a non-zero median (wall_ms always):
    a measure that is 0 or missing in every run is neither drawn nor written."""
    return [name for name in names if name == "wall_ms" or any(present_regions(records, name))]


def present_regions(records, name: str) -> list[str]:
    """The regions in which some run has a non-zero median of measure ``name``."""
    found = dict.fromkeys(
        region
        for record in records
        for region, stats in record.analysis.regions.items()
        if stats.get(name) and stats[name].median
    )
    return list(found)


def absent_gpu_measures(records, names) -> list[str]:
    """The GPU-only measures among ``names`` that these runs cannot have: they have no GPU events."""
    return [] if any(r.analysis.gpu for r in records) else [n for n in names if MEASURES[n].gpu_only]


def gpu_note(names) -> str:
    """The one line that stands for the GPU-only measures among ``names`` on a CPU run."""
    headers = [MEASURES[n].header for n in names if MEASURES[n].gpu_only]
    return f"{', '.join(headers)}: need a GPU (this run has no GPU events)." if headers else ""


def format_value(name: str, value: float | None) -> str:
    """A measure's value in its unit: a share as %, bytes in kB/MB/GB, ms to 3 significant digits."""
    if value is None:
        return "–"
    unit = MEASURES[name].unit
    if unit == "share":
        return f"{value:.0%}"
    if unit == "bytes":
        for suffix, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= size:
                return f"{value / size:.3g} {suffix}"
        return f"{value:.0f} B"
    if unit == "ms":
        return f"{value:.3g}" if value < 1000 else f"{value:.0f}"
    return f"{value:g}"


def legend(names) -> str:
    """``**header**: meaning`` lines for a table's columns."""
    return "\n".join(f"- **{MEASURES[n].header}**: {MEASURES[n].meaning}." for n in names)
