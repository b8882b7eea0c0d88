"""What each strategy's loss costs per slot and per box, for the shape report's prediction (detector/lab/shapes.py).

Strategies differ in what their time grows with: ``padded`` and the every-slot kernels with the B × M slots of
a batch, ``packed`` and ``cuda_conditional`` with the boxes present. A strategy's forward+backward is modelled
as ``per_slot × slots + per_box × boxes``, its fixed cost (launches, dispatch) counted in the slots' share, so
a prediction far from the scale it was measured at carries that error.

Two sources, the first that applies:

- ``bench losses``' result file (``<dir of bench.out>/losses.json``) of this device: at the batch nearest the
  run's, its ``seed`` and ``tail`` cases hold the same slots and different boxes; the difference of their times
  is the boxes' cost, the rest the slots'. Its slots per image are those it records (``max_boxes``), else those
  at which its cases draw the boxes they timed (detector/lab/measure/cases.py draws the counts from a generator seeded
  with the batch): one slot count at a batch of hundreds; where a few fit, the run's own if it is one of them.
- otherwise a cheap timing here: each strategy's forward+backward on a batch of the run's shape with no box,
  then with the data's counts of boxes.

Memory is modelled the same way, ``per_slot × slots + per_box × boxes`` bytes (``MemoryCost``; it and ``Cost`` are
records of detector/lab/record/shapes.py, which shapes.json holds), from each strategy's loss forward as the training
step runs it in "calc loss" (its predictions requiring a gradient, so that autograd keeps what the backward will
need), measured here on the same two batches: the peak it rises to above what was allocated before it (on a GPU the
caching allocator's peak, on the CPU the profiler's memory events). Bytes depend on the shapes alone, so the model
holds at other batches as long as the strategy allocates per slot and per box.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from detector.checked import RecordError
from detector.config.device import device_name
from detector.data.targets import make_targets
from detector.lab.measure.cases import random_boxes, sample_counts
from detector.lab.measure.timing import event_ms, loss_closures, wall_ms
from detector.lab.measure.trace import peak_rise, read_events
from detector.lab.record import bench as bench_record
from detector.lab.record.bench import LossCase
from detector.lab.record.shapes import Cost, Costs, MemoryCost
from detector.losses import STRATEGIES, get_strategy

DISTRIBUTIONS = ("seed", "tail")  # bench losses' cases with the same slots and different boxes
LARGEST_SLOTS = 4096  # the slot counts tried when telling a bench file's slots from its tail case
QUICK = {"warmup": 2, "repeats": 7, "max_seconds": 1.0}  # the cheap timing: a few calls, at most ~1 s a case
# a call this slow twice (the first may pay a kernel's compilation) is timed no more: it ranks far behind the
# millisecond strategies already (loop: ~1.5 s a call at seed scale on an H100), and 3 more calls would cost seconds
SLOW_MS = 200.0
FAR_BEHIND = 100.0  # a slice of the batch this many times the fastest's slice: the strategy is not called whole
SLICE = 16  # the slice: a sixteenth of the batch's images


# ----------------------------------------------------------------------------- from bench losses' result file


def from_bench(path: Path, device: str, batch: int, slots: int) -> tuple[Costs | None, str]:
    """The costs in bench losses' result file at ``path`` if it is of ``device``; else None and why not. Its cases
    at the batch nearest ``batch``; its slots as recorded, else as its cases tell (``slots`` where they fit it)."""
    if not path.exists():
        return None, f"no {path} (make bench)"
    try:
        found = bench_record.read(path)
        if found.target != "losses":
            return None, f"{path} is not a bench losses result"
        if found.device != device:
            return None, f"{path} is of {found.device}, and this run is on {device}"
        records = [c for c in found.loss_cases(str(path)) if c.distribution in DISTRIBUTIONS]
    except RecordError as err:
        return None, str(err)
    sizes = sorted({c.batch_size for c in records})
    if not sizes:
        return None, f"{path} has no seed and tail cases"
    at = min(sizes, key=lambda b: (abs(np.log(b / batch)), -b))  # the batch nearest the run's
    cases = {(c.strategy, c.distribution): c for c in records if c.batch_size == at}
    fits = [found.max_boxes] if found.max_boxes is not None else bench_slots(cases, at)
    if len(fits) != 1 and slots not in fits:
        return None, f"{path} does not say its slots; its cases fit {len(fits)} slot counts ({fits[:4]}), not {slots}"
    slots = slots if slots in fits else fits[0]
    costs = [c for c in (bench_cost(name, cases, at, slots) for name in dict.fromkeys(n for n, _ in cases)) if c]
    source = f"{path} ({device}, torch {found.torch}; bench losses at batch {at} x {slots} slots)"
    return Costs(source, costs, str(path)), ""


def bench_slots(cases: dict[tuple[str, str], LossCase], batch: int) -> list[int]:
    """The slot counts at which bench losses' cases draw the boxes it timed at ``batch`` (random_case draws the
    counts first, from a generator seeded with the batch): one at a batch of hundreds, maybe a few at tens."""
    boxes = {d: c.valid_boxes for (_, d), c in cases.items()}
    if not all(d in boxes for d in DISTRIBUTIONS):
        return []
    return [
        slots
        for slots in range(1, LARGEST_SLOTS + 1)
        if all(
            int(sample_counts(d, batch, slots, torch.Generator().manual_seed(batch)).sum()) == boxes[d]
            for d in DISTRIBUTIONS
        )
    ]


def bench_cost(name: str, cases: dict[tuple[str, str], LossCase], batch: int, slots: int) -> Cost | None:
    """A strategy's cost from its seed and tail cases at one batch: the boxes' difference, the slots' rest."""
    seed, tail = cases.get((name, "seed")), cases.get((name, "tail"))
    if not seed or not tail or not seed.forward_backward_ms or not tail.forward_backward_ms:
        return None
    t_seed, t_tail = seed.forward_backward_ms, tail.forward_backward_ms
    n_seed, n_tail = seed.valid_boxes, tail.valid_boxes
    per_box = max(0.0, (t_tail - t_seed) / (n_tail - n_seed)) if n_tail > n_seed else 0.0
    per_slot = max(0.0, t_seed - per_box * n_seed) / (batch * slots)
    return Cost(name, per_slot, per_box, f"batch {batch} x {slots} slots, {n_seed:,} and {n_tail:,} boxes")


# ----------------------------------------------------------------------------- a cheap timing here


def timed_here(
    names: list[str], counts: np.ndarray, slots: int, device: torch.device, why: str, empty: bool = True
) -> Costs:
    """Each strategy's forward+backward at a batch of ``counts`` boxes (each <= ``slots``), and with none: its
    slots' cost (the time with no box) and its boxes' (the difference, a box). Without ``empty``, at the batch of
    ``counts`` alone, all of it counted as the slots' cost: half the calls, for a prediction at this very shape
    (train.strategy=auto's ranking), which another shape would read wrongly."""
    batch, boxes = len(counts), int(counts.sum())
    print(f"shapes: timing {len(names)} strategies at batch {batch} x {slots} slots here ({why}) ...", flush=True)
    costs = []
    if not empty:
        for name, (full, note, seconds) in at_one_shape(names, counts, slots, device).items():
            costs.append(Cost(name, full / (batch * slots), 0.0, f"batch {batch} x {slots} slots, {boxes:,} boxes"))
            print(f"  {name:<18} {full:9.3f} ms with {boxes:,} boxes{note}; timed in {seconds:.2f} s", flush=True)
    else:
        for name in names:
            none = loss_ms(name, np.zeros_like(counts), slots, device)
            full = loss_ms(name, counts, slots, device)
            per_box = max(0.0, full - none) / boxes if boxes else 0.0
            measured = f"batch {batch} x {slots} slots, 0 and {boxes:,} boxes"
            costs.append(Cost(name, none / (batch * slots), per_box, measured))
            print(f"  {name:<18} {none:9.3f} ms without boxes, {full:9.3f} ms with {boxes:,}", flush=True)
    drawn_inputs.cache_clear()
    source = f"timed here on {device_name(device)}, torch {torch.__version__} ({why})"
    return Costs(source, costs)


def loss_inputs(name: str, counts: np.ndarray, slots: int, device: torch.device):
    """(strategy, pred, targets): random boxes, ``counts[b]`` in image b, in the strategy's layout; predictions
    requiring a gradient, bf16 on a GPU (what autocast emits) and fp32 on the CPU."""
    strategy = get_strategy(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pred, targets = drawn_inputs(tuple(counts.tolist()), slots, strategy.layout, dtype)
    return strategy, pred.to(device, copy=True).requires_grad_(), targets.to(device)


@functools.lru_cache(maxsize=8)
def drawn_inputs(counts: tuple[int, ...], slots: int, layout: str, dtype: torch.dtype):
    """The host's (pred, targets) of ``loss_inputs``, drawn once for every strategy of a layout (a batch of a
    thousand images takes a tenth of a second to draw); the timings clear it when done."""
    generator = torch.Generator().manual_seed(len(counts))
    boxes = random_boxes((len(counts), slots), generator, integer=True).to(torch.uint8)  # [B, M, 4]
    targets = make_targets([boxes[b, :n] for b, n in enumerate(counts)], layout, slots)
    pred = (boxes.double() + torch.randn(boxes.shape, generator=generator, dtype=torch.float64)).to(dtype)
    return pred, targets


def at_one_shape(names: list[str], counts: np.ndarray, slots: int, device: torch.device) -> dict[str, tuple]:
    """{strategy: (its ms at a batch of ``counts``, a note, the seconds its timing took)}. Each strategy is first
    called on a slice of the batch (its first SLICE-th images, ``slice_ms``), after a call that may compile (triton's
    kernel, on a machine without its cache) or load its kernels. A strategy whose slice takes FAR_BEHIND times the
    fastest slice's is far behind at any batch; it is not called whole, and its whole is estimated in proportion to
    the images. The others are timed whole, as ``loss_ms`` times them, once where a call is slow: the slice's calls
    compiled what there was to compile (loop at seed scale on an H100: ~70 ms its slice, ~1.1 s its one whole call;
    the fastest ~0.1 ms)."""
    part = counts[: max(1, len(counts) // SLICE)]
    spent = dict.fromkeys(names, 0.0)

    def timed(name, how, *args, **kwargs):  # the call, and its seconds added to the strategy's
        started = time.perf_counter()
        found = how(name, *args, **kwargs)
        spent[name] += time.perf_counter() - started
        return found

    sliced = {name: timed(name, slice_ms, part, slots, device) for name in names}
    fastest = min(sliced.values(), default=0.0)
    out = {}
    for name, ms in sliced.items():
        if fastest > 0 and ms >= FAR_BEHIND * fastest:  # a second look: one slow call alone ranks no strategy last
            ms = min(ms, timed(name, slice_ms, part, slots, device, warmup=0))
        if fastest > 0 and ms >= FAR_BEHIND * fastest:  # a fastest of 0 ms (a coarse clock) bounds nothing
            note = (
                f" (estimated: {len(part)} of the {len(counts)} images took {ms:,.1f} ms, {ms / fastest:,.0f}x the "
                "fastest's, so it was not called whole)"
            )
            out[name] = ms * len(counts) / len(part), note
        else:
            out[name] = timed(name, loss_ms, counts, slots, device, warm=True), ""
    return {name: (ms, note, spent[name]) for name, (ms, note) in out.items()}


def slice_ms(name: str, part: np.ndarray, slots: int, device: torch.device, warmup: int = 1) -> float:
    """The wall ms of one forward+backward of a strategy on the batch ``part``, after ``warmup`` calls (the first may
    compile, or load its kernels)."""
    strategy, pred, targets = loss_inputs(name, part, slots, device)
    _, forward_backward = loss_closures(strategy, pred, targets)
    return wall_ms(forward_backward, device, warmup=warmup, repeats=1).median


def loss_ms(name: str, counts: np.ndarray, slots: int, device: torch.device, warm: bool = False) -> float:
    """The median ms of a strategy's forward+backward over random boxes, ``counts[b]`` in image b; the second call's
    alone where it and the first each took over SLOW_MS (the first's alone where ``warm``: the strategy was called
    before, at another batch of the same slots, so its first call here compiles nothing)."""
    strategy, pred, targets = loss_inputs(name, counts, slots, device)
    _, forward_backward = loss_closures(strategy, pred, targets)
    for _ in range(1 if warm else 2):
        once = wall_ms(forward_backward, device, warmup=0, repeats=1).median
        if once < SLOW_MS:
            return event_ms(forward_backward, device, **QUICK).median
    return once


# ----------------------------------------------------------------------------- memory


def memory_here(names: list[str], counts: np.ndarray, slots: int, device: torch.device) -> list[MemoryCost]:
    """Each strategy's loss forward at a batch of ``counts`` boxes (each <= ``slots``) and with none: its slots'
    bytes (the rise with no box) and its boxes' (the difference, a box)."""
    batch, boxes = len(counts), int(counts.sum())
    out = []
    for name in names:
        empty = loss_peak_rise(name, np.zeros_like(counts), slots, device)
        full = loss_peak_rise(name, counts, slots, device)
        per_box = max(0, full - empty) / boxes if boxes else 0.0
        out.append(
            MemoryCost(name, empty / (batch * slots), per_box, f"batch {batch} x {slots} slots, 0 and {boxes:,} boxes")
        )
    drawn_inputs.cache_clear()
    return out


def loss_peak_rise(name: str, counts: np.ndarray, slots: int, device: torch.device) -> int:
    """The bytes a strategy's loss forward rises to above what was allocated before it (after one call to warm up:
    a first call may allocate what the later ones reuse)."""
    strategy, pred, targets = loss_inputs(name, counts, slots, device)
    strategy(pred, targets)
    return peak_rise_of(lambda: strategy(pred, targets), device)


def peak_rise_of(fn, device: torch.device) -> int:
    """The peak bytes allocated while ``fn`` runs above those allocated before: the caching allocator's own peak on
    a GPU, the profiler's memory events on the CPU (whose allocator keeps no peak)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        return torch.cuda.max_memory_allocated(device) - before
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # as the profile's window: no Kineto log lines among ours
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/memory.json"
        prof.export_chrome_trace(path)
        return peak_rise(read_events(path)[1])


def quick_strategies(requested: list[str], device: torch.device) -> tuple[list[str], list[str]]:
    """The strategies the cheap timing runs (``requested``, or every one that runs here and is neither compiled, whose
    first call compiles, nor emulated, whose times are an emulator's) and those it leaves out."""
    if requested:
        return list(requested), []
    chosen, left = [], []
    for name, strategy in STRATEGIES.items():
        runs = not strategy.unavailable(device) and not strategy.emulated(device) and not strategy.compiled
        (chosen if runs else left).append(name)
    return chosen, left
