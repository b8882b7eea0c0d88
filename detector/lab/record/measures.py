"""The lab's vocabulary: every measure of a profiled region, once, with its unit and meaning.

detector/lab/measure/analysis.py computes these from a trace; `make profile`, `make compare`, TensorBoard
(detector/board/) and `make report` name, format and explain them from this table alone. A measure marked
``gpu_only`` is ``None`` on a trace without GPU events (a CPU run): the tables then say once that it needs
a GPU, instead of printing zeros.

Times are per step and region; counts are calls or events that *start* inside the region, on any thread
of the profiled process (the autograd engine launches the backward's kernels from threads of its own).

Memory is the run's device's: the CUDA caching allocator's on a GPU, c10's CPU allocator's on the CPU, as the
profiler's memory events (``profile.profile_memory``) report each allocation and free with the bytes allocated
after it. A run recorded without them has no memory measures (None, like a GPU measure on the CPU); a memory
measure marked ``gpu_only`` does not exist on the CPU, whose allocator neither caches, reserves nor retries.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    name: str  # the key in summary.json, and the TensorBoard tag's first part
    header: str  # a table's column header
    unit: str  # "ms", "count", "bytes" (moved, decimal: kB, MB), "memory" (held, binary: KiB, MiB) or "share"
    meaning: str  # one sentence: what it counts and why it matters
    gpu_only: bool = False
    # the TensorBoard group's number (``<tag> <header>/...``): fixed once given, so that runs written before a measure
    # was added overlay runs written after; a new measure takes the next free number
    tag: int = 0
    why: bool = False  # a column of a why table: what makes a region cost what it costs (time has its own)
    stable: bool = False  # a count no load on the machine changes: a verdict leads with it (present/verdicts.py)
    memory: bool = False  # a column of a memory table
    step_only: bool = False  # measured for the whole step only
    additive: bool = False  # its regions and "other" add up to the step's (measure/analysis.py checks it)
    of_operators: bool = False  # counted from the operators a region dispatched (measure/trace.py)
    chart: int = 0  # its place among the counts `make compare` draws on a log axis (0: not drawn)
    verdict: int = 0  # its place among the memory measures a verdict leads with (0: none; deterministic, as counts)


MEASURES: dict[str, Measure] = {
    m.name: m
    for m in (
        Measure(
            "wall_ms",
            "wall ms",
            "ms",
            "the region's time on the host: its cost where the host paces the step (the CPU, a GPU waiting for its "
            "host); where the device paces it, the time the host took to launch the region's work, its waits for room "
            "in the launch queue included, while the device runs steps behind",
            tag=2,
            additive=True,
        ),
        Measure(
            "gpu_ms",
            "GPU ms",
            "ms",
            "device time of the kernels, copies and memsets the region launched, whenever they ran "
            "(streams overlapping counted once): the device's share of the work",
            gpu_only=True,
            tag=3,
        ),
        Measure(
            "device_step_ms",
            "device step ms",
            "ms",
            "the step as the device runs it: from the start of its first GPU work to the start of the next "
            "step's (the last step: to the end of its own). The host runs ahead, so the host's step times "
            "jitter with the launch queue; this is what training's throughput is made of",
            gpu_only=True,
            tag=4,
        ),
        Measure(
            "gpu_idle_share",
            "GPU idle",
            "share",
            "the share of the step's wall time in which the device ran nothing: near 100 % when the host "
            "(Python, launches, syncs, the loader) cannot keep it busy",
            gpu_only=True,
            tag=5,
        ),
        Measure(
            "ops",
            "operators",
            "count",
            "PyTorch operators dispatched (aten::*, nested ones too): each costs the host microseconds, so a "
            "loss that loops over images dispatches B times as many",
            tag=6,
            why=True,
            stable=True,
            additive=True,
            of_operators=True,
            chart=1,
        ),
        Measure(
            "slices",
            "slices",
            "count",
            "select, slice, narrow, split and unbind calls: per-image code takes the batch apart image by "
            "image, and each slice's backward writes a tensor of the whole batch's shape",
            tag=7,
            why=True,
            stable=True,
            additive=True,
            of_operators=True,
            chart=6,
        ),
        Measure(
            "host_reads",
            "host reads",
            "count",
            "operators whose result the host must read before it goes on (.item(), nonzero, masked_select): "
            "data-dependent shapes; on a GPU each one is a host-device sync",
            tag=8,
            why=True,
            stable=True,
            additive=True,
            of_operators=True,
            chart=5,
        ),
        Measure(
            "launches",
            "launches",
            "count",
            "kernel launch calls (a CUDA graph's replay counts once): each costs the host microseconds",
            gpu_only=True,
            tag=9,
            why=True,
            stable=True,
            additive=True,
            chart=2,
        ),
        Measure(
            "kernels",
            "kernels",
            "count",
            "kernels the device ran for those launches (a graph replay runs many)",
            gpu_only=True,
            tag=10,
            why=True,
            additive=True,
        ),
        Measure(
            "syncs",
            "syncs",
            "count",
            "host waits for the device: synchronize calls, synchronous copies, .item() and .cpu(); the host "
            "cannot run ahead past one",
            gpu_only=True,
            tag=11,
            why=True,
            stable=True,
            additive=True,
            chart=3,
        ),
        Measure(
            "h2d_copies",
            "H2D copies",
            "count",
            "host-to-device copies: per-image targets show here as one copy per image",
            gpu_only=True,
            tag=12,
            why=True,
            stable=True,
            additive=True,
            chart=4,
        ),
        Measure("h2d_bytes", "H2D bytes", "bytes", "bytes those copies moved", gpu_only=True, tag=13),
        Measure(
            "d2h_copies",
            "D2H copies",
            "count",
            "device-to-host copies: values the host reads back",
            gpu_only=True,
            tag=14,
            why=True,
            stable=True,
            additive=True,
        ),
        Measure("d2h_bytes", "D2H bytes", "bytes", "bytes those copies moved", gpu_only=True, tag=15),
        Measure(
            "runtime_ms",
            "CUDA API ms",
            "ms",
            "host time inside CUDA runtime and driver calls: launch overhead, and waits in syncs",
            gpu_only=True,
            tag=16,
            why=True,
        ),
        Measure(
            "queue_wait_ms",
            "queue wait ms",
            "ms",
            "host time inside launch calls that waited for room in the device's launch queue (each such call over "
            "0.2 ms, where a launch with room takes microseconds): the host ran so far ahead that the device held it "
            "back, so the region's wall time is that wait, not the region's cost",
            gpu_only=True,
            tag=29,
            additive=True,
        ),
        Measure(
            "sync_wait_ms",
            "lab sync ms",
            "ms",
            "host time in the synchronize that ends each region under profile.sync_regions=true: what the "
            "article's protocol makes the host wait (not counted in syncs or CUDA API ms)",
            gpu_only=True,
            tag=17,
        ),
        Measure(
            "comm_ms",
            "comm ms",
            "ms",
            "device time of the collectives (NCCL's kernels: gradient reduces, weight gathers, broadcasts) the "
            "region launched, whenever they ran (overlapping ones counted once): the communication between the "
            "GPUs, on a run of several",
            gpu_only=True,
            tag=18,
        ),
        Measure(
            "comm_bytes",
            "comm bytes",
            "bytes",
            "the messages of those collectives where the trace gives their size: each one's larger of input and "
            "output (an all-gather's output, a reduce-scatter's input), as NCCL's own tests count a size",
            gpu_only=True,
            tag=19,
        ),
        Measure(
            "comm_hidden_share",
            "comm hidden",
            "share",
            "the share of those collectives' device time in which a compute kernel ran beside them on another "
            "stream: the communication the compute hid. What is not hidden, the step waits for",
            gpu_only=True,
            tag=20,
        ),
        Measure(
            "peak_bytes",
            "peak allocated",
            "memory",
            "the most bytes the device's allocator had allocated to tensors at once during the region, what was live "
            "when it began included (the weights, the optimizer's state, the activations kept for the backward): what "
            "must fit. On the CPU the allocator counts only what it allocated while the profiler recorded",
            tag=21,
            memory=True,
            verdict=2,
        ),
        Measure(
            "peak_rise_bytes",
            "peak rise",
            "memory",
            "the peak allocated less the bytes live when the region began: the working memory of the region's own "
            "operators (a padded loss's B·M slots, a loop's per-image tensors), on top of what it found",
            tag=22,
            memory=True,
            verdict=1,
        ),
        Measure(
            "alloc_bytes",
            "allocated bytes",
            "memory",
            "the bytes of the allocations the region made, each counted when made, freed or not: what passed "
            "through the allocator",
            tag=23,
            memory=True,
            additive=True,
        ),
        Measure(
            "allocs",
            "allocations",
            "count",
            "tensors allocated (each operator's outputs and temporaries): a per-image loop allocates B times as "
            "many, each a trip through the allocator",
            tag=24,
            memory=True,
            additive=True,
            verdict=3,
        ),
        Measure(
            "device_mallocs",
            "device mallocs",
            "count",
            "the allocator's own requests for new memory: on a GPU the caching allocator's cudaMalloc calls (a "
            "new segment, slow and synchronising; a warm step makes none), on the CPU one malloc per allocation "
            "(c10's CPU allocator caches nothing)",
            tag=25,
            memory=True,
            additive=True,
            verdict=4,
        ),
        Measure(
            "device_frees",
            "device frees",
            "count",
            "the memory the allocator gives back: on a GPU cudaFree calls (its cache emptied: after an allocation "
            "failed, or empty_cache), on the CPU one free per freed tensor",
            tag=26,
            memory=True,
            additive=True,
        ),
        Measure(
            "alloc_retries",
            "alloc retries",
            "count",
            "allocations the caching allocator could not serve, so it freed its cache and asked the device again "
            "(torch.cuda.memory_stats' num_alloc_retries, per step): a step at the edge of the memory, each one slow",
            gpu_only=True,
            tag=27,
            memory=True,
            step_only=True,
            verdict=5,
        ),
        Measure(
            "reserved_free_bytes",
            "reserved free",
            "memory",
            "at the step's end, the bytes the caching allocator holds reserved from the device but not allocated to "
            "any tensor: its cache and its fragmentation, which shapes that change from step to step make grow",
            gpu_only=True,
            tag=28,
            memory=True,
            step_only=True,
        ),
    )
}


def having(prop: str, order: str | None = None) -> tuple[str, ...]:
    """The measures whose ``prop`` is set, in the order of MEASURES, or of ``order`` (a property holding a place)."""
    found = [m for m in MEASURES.values() if getattr(m, prop)]
    if order:
        found.sort(key=lambda m: getattr(m, order))
    return tuple(m.name for m in found)


# Each list below is a property of the measures (``Measure``), read off them once.
WHY = having("why")
COUNTS = having("chart", order="chart")
STABLE = having("stable")
MEMORY = having("memory")
MEMORY_VERDICT = having("verdict", order="verdict")
STEP_ONLY = having("step_only")
ADDITIVE = having("additive")
OF_OPERATORS = having("of_operators")


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
    """A measure's value in its unit: a share as %, bytes moved in kB/MB/GB, memory held in KiB/MiB/GiB, ms to 3
    significant digits."""
    if value is None:
        return "–"
    unit = MEASURES[name].unit
    if unit == "share":
        return f"{value:.0%}"
    if unit == "memory":
        return memory_text(value)
    if unit == "bytes":
        for suffix, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= size:
                return f"{value / size:.3g} {suffix}"
        return f"{value:.0f} B"
    if unit == "ms":
        return f"{value:.3g}" if value < 1000 else f"{value:.0f}"
    return f"{value:g}"


def memory_text(value: float) -> str:
    """Bytes held, in binary units as allocators and nvidia-smi count them: ``1.5 GiB``, ``312 MiB``, ``0 B``."""
    for suffix, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {suffix}"
    return f"{value:.0f} B"


def memory_note(records) -> str:
    """The one line on the runs' memory measures where some are missing: not recorded, or not existing on the CPU."""
    unrecorded = [r for r in records if not r.stats("step", "peak_bytes")]
    if unrecorded and len(unrecorded) == len(list(records)):
        return "Memory: not recorded (profile.profile_memory=false, or a run of an older version)."
    cpu = [n for n in MEMORY if MEASURES[n].gpu_only] if not any(r.analysis.gpu for r in records) else []
    lines = []
    if cpu:
        headers = ", ".join(MEASURES[n].header for n in cpu)
        lines.append(f"{headers}: none on the CPU (c10's CPU allocator neither caches, reserves nor retries).")
    if unrecorded:
        lines.append(f"Memory not recorded in {len(unrecorded)} run(s) (profile.profile_memory=false).")
    return " ".join(lines)


def legend(names) -> str:
    """``**header**: meaning`` lines for a table's columns."""
    return "\n".join(f"- **{MEASURES[n].header}**: {MEASURES[n].meaning}." for n in names)
