"""What fits: the caching allocator under the training step's dynamic shapes, and the largest batch that trains. The
child process of `bench memory` (detector/bench/memory.py), one per allocator setting:

    python -m detector ceiling --out RESULTS.json --jobs JOBS.json --seconds S [key=value ...]

``JOBS.json`` lists ``[source, strategy, part]``: source ``synthetic`` or ``crowd:<file>`` (data.max_boxes from the
file, data.over_max_boxes=fit), part ``allocator`` or ``ceiling``. One training step (detector/train/run/step.py) a
source serves each of its strategies in turn: the step reads its loss at each call, so the same model, optimizer and
compiled graph run every strategy, as a fresh step of that strategy would after its first step. Batches are drawn once
per source from its sampler (detector/data/), straight into memory: the loader's workers and ring are not measured.

- ``allocator``: WARMUP steps, then MEASURED steps, each on a batch of other images and other box counts (the
  shapes a packed or per-image loss sees change every step); per measured step the caching allocator's figures
  (detector/lab/measure/allocator.py): its device mallocs and frees, retries, peak, and what it holds reserved but
  unallocated at the step's end.
- ``ceiling``: the largest batch whose PROBE_STEPS steps train before the device runs out of memory (``search``): a
  first probe at data.batch_size, the next where its memory per image says the device fills, then halves between the
  largest that fitted and the smallest that did not, to within RESOLUTION of it. A probe that runs out of memory is a
  result, not a failure: its tensors are freed and the search goes on. Each search has its share of the seconds left;
  a probe whose steps would not finish in it is not started, and the result says the batch is at least the largest
  that fitted ("time-limited").

Results are written after each job, so that a child stopped at its time limit, or killed, leaves what it measured.
Both files are records (``Jobs``, written by the parent and read here; ``ChildResults``, written here and read by the
parent), written atomically and read with their fields checked: a damaged one is one line naming the file and field.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from detector.checked import RecordError, need, optional, read_json, versioned, write_atomically
from detector.config.device import resolve_device
from detector.config.schema import load_config
from detector.data import build_sampler
from detector.data.targets import make_targets
from detector.errors import UserError
from detector.lab.measure.allocator import StepMeter
from detector.losses import get_strategy
from detector.train.run.speed_options import speed_option_refusal
from detector.train.run.step import TrainStep

WARMUP, MEASURED = 2, 3  # allocator: steps before it is measured, and steps measured (a loop's: seconds each)
PROBE_STEPS = 2  # ceiling: the steps a batch must train (the second reuses the optimizer's state the first made)
RESOLUTION = 1 / 32  # ceiling: the search stops when the largest fit and the first failure are this close
GRANULE = 32  # ceiling: batches are multiples of this
GROWTH = 8  # ceiling: the most a probe's batch exceeds the largest that fitted, where the estimate is unsure
PROBE_OVERHEAD = 5.0  # ceiling: seconds a probe takes beyond its steps (its batch drawn and copied, cuDNN's benchmark)
OOM_TEXT = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
VERSION = 2  # of the jobs and the results files; 1: no "version" key (the jobs file a bare list)
PARTS = ("allocator", "ceiling")
RECORD_BYTES = 16 * 2**20  # a few jobs and their rows are kB; a larger file is not one of these


def source_overrides(source: str) -> list[str]:
    """The data overrides of a source: the synthetic faces as configured, or a crowd file fitted to its slots."""
    if source == "synthetic":
        return []
    return [f"data.boxes=widerface:{source.partition(':')[2]}", "data.max_boxes=1024", "data.over_max_boxes=fit"]


# ----------------------------------------------------------------------------- the batches


class Pool:
    """Images and their boxes drawn from a source's sampler, grown on demand: batch k of size b is images
    [k·b, (k+1)·b), so that consecutive batches hold other images and other box counts."""

    def __init__(self, cfg: DictConfig):
        self.sampler, self.side = build_sampler(cfg.data), cfg.data.image_size
        self.images = np.empty((0, self.side, self.side), np.uint8)
        self.boxes: list[np.ndarray] = []

    def ensure(self, count: int) -> None:
        if count <= len(self.boxes):
            return
        more = np.empty((count - len(self.boxes), self.side, self.side), np.uint8)
        self.boxes += self.sampler.draw_batch(range(len(self.boxes), count), more)
        self.images = np.concatenate([self.images, more])

    def batch(self, size: int, k: int, layout: str, cfg: DictConfig, device: torch.device):
        """Batch ``k`` of ``size`` images on ``device``: ([B, 1, S, S] uint8, targets in ``layout``). Under
        train.compile its batch dimension is marked dynamic: one graph serves every batch size, compiled once a
        source in each child (and found in inductor's cache by the next child) instead of once a size."""
        self.ensure((k + 1) * size)
        part = slice(k * size, (k + 1) * size)
        images = torch.from_numpy(self.images[part]).unsqueeze(1).to(device)
        if cfg.train.compile:
            torch._dynamo.maybe_mark_dynamic(images, 0)
        boxes = [torch.from_numpy(b) for b in self.boxes[part]]
        return images, make_targets(boxes, layout, cfg.data.max_boxes).to(device)


def use_strategy(step: TrainStep, cfg: DictConfig, name: str) -> None:
    """Make ``step`` train with the loss ``name`` (refused where it cannot run here, as TrainStep refuses it)."""
    strategy = get_strategy(name)
    reason = strategy.unavailable(step.device) or speed_option_refusal(strategy, cfg.train, 1, step.device)
    if reason:
        raise UserError(f"strategy {name!r} cannot train here: {reason}")
    step.strategy = strategy


def free_memory(step: TrainStep) -> None:
    """What a failed step left: its gradients, its tensors (once the exception is gone), the allocator's cache."""
    step.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if step.device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or any(text in str(err) for text in OOM_TEXT)


# ----------------------------------------------------------------------------- the allocator


def allocator_row(step: TrainStep, pool: Pool, cfg: DictConfig) -> dict:
    """WARMUP steps, then MEASURED steps of the caching allocator's figures (None on the CPU: it has none)."""
    meter, batch = StepMeter(step.device), cfg.data.batch_size
    free_memory(step)  # the allocator's cache from the strategy before: each starts from an empty one, and warms up
    began = time.perf_counter()
    for k in range(WARMUP + MEASURED):
        images, targets = pool.batch(batch, k, step.strategy.layout, cfg, step.device)
        meter.start()
        step((images, targets))
        meter.stop(k)
    if step.device.type == "cuda":
        torch.cuda.synchronize(step.device)
    measured = [meter.steps[k] for k in range(WARMUP, WARMUP + MEASURED) if k in meter.steps]
    keys = ("peak", "reserved_free", "device_mallocs", "device_frees", "retries", "allocations")
    row = {key: statistics.median(s[key] for s in measured) if measured else None for key in keys}
    row["per_step"] = measured
    row["seconds"] = time.perf_counter() - began
    return row


# ----------------------------------------------------------------------------- the ceiling


@dataclass
class Probe:
    """A batch tried: whether its steps trained, the peak and the bytes allocated before its last step (model,
    optimizer), how long they took (all of them, and the last alone: the first may compile and benchmark cuDNN for a
    new shape), and why it failed (its first line)."""

    batch: int
    fits: bool
    seconds: float
    peak: int | None = None
    base: int | None = None
    error: str | None = None
    step_seconds: float | None = None


def search(probe, start: int, estimate, seconds: float) -> dict:
    """The largest batch for which ``probe(batch) -> Probe`` fits (see the module docstring). ``estimate(Probe)`` is
    the batch at which a fitting probe's memory per image says the device fills (None where it cannot tell)."""
    began, probes, lo, hi, stopped = time.perf_counter(), [], 0, None, None
    batch = start
    while batch:
        last = max((p for p in probes if p.fits), key=lambda p: p.batch, default=None)
        step = last.step_seconds if last and last.step_seconds is not None else last.seconds if last else 0.0
        expected = PROBE_OVERHEAD + PROBE_STEPS * step * batch / last.batch if last else 0.0  # steps grow with it
        if probes and time.perf_counter() - began + expected > seconds:
            stopped = (
                f"time-limited: a probe at {batch} would take ~{expected:.0f} s, past the search's {seconds:.0f} s"
            )
            break
        found = probe(batch)
        probes.append(found)
        if found.error and not found.fits and found.error.startswith("failed"):
            stopped = found.error
            break
        lo, hi = (batch, hi) if found.fits else (lo, batch)
        batch = next_batch(lo, hi, estimate(found) if found.fits else None)
    return {"largest": lo, "first_failure": hi, "probes": [asdict(p) for p in probes], "stopped": stopped}


def next_batch(lo: int, hi: int | None, guess: int | None) -> int:
    """The next batch to try (0: the search is done): past the largest fit, towards the estimate, until a probe
    fails; then halfway, until the two are within RESOLUTION."""
    if hi is None:
        target = guess * 1.02 if guess else 2 * lo  # just past where the device should fill: a failure bounds it
        return rounded(min(max(target, lo * (1 + 2 * RESOLUTION)), GROWTH * lo))
    if lo == 0:  # the first batch did not fit: halve it
        return rounded(hi / 2) if hi > GRANULE else (hi // 2 or 0)
    if hi - lo <= max(GRANULE, RESOLUTION * lo):
        return 0
    return rounded((lo + hi) / 2)


def rounded(batch: float) -> int:
    return max(GRANULE, int(batch) // GRANULE * GRANULE)


class Prober:
    """Probes of one source and strategy on the device: PROBE_STEPS steps of a batch (``__call__``), and where the
    device's memory per image says it fills (``estimate``)."""

    def __init__(self, step: TrainStep, pool: Pool, cfg: DictConfig):
        self.step, self.pool, self.cfg = step, pool, cfg

    def __call__(self, batch: int) -> Probe:
        step, device = self.step, self.step.device
        began, error, base = time.perf_counter(), None, None
        try:
            images, targets = self.pool.batch(batch, 0, step.strategy.layout, self.cfg, device)
            for _ in range(PROBE_STEPS):
                torch.cuda.synchronize(device)
                last = time.perf_counter()
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                step((images, targets))
            torch.cuda.synchronize(device)
            peak, last = torch.cuda.max_memory_allocated(device), time.perf_counter() - last
        except Exception as err:  # noqa: BLE001  whatever a probe hits is its result; the search goes on
            error = ("out of memory: " if out_of_memory(err) else "failed: ") + str(err).strip().split("\n")[0][:300]
        images = targets = None
        if error:
            free_memory(step)
            return Probe(batch, False, time.perf_counter() - began, error=error)
        return Probe(batch, True, time.perf_counter() - began, peak, base, step_seconds=last)

    def estimate(self, found: Probe) -> int | None:
        """The batch at which the allocator's headroom (the device's free memory and what it holds) runs out, at the
        probe's bytes per image above what its step found allocated."""
        if not found.peak or found.peak <= found.base:
            return None
        free, _ = torch.cuda.mem_get_info(self.step.device)
        room = free + torch.cuda.memory_reserved(self.step.device) - found.base
        return int(room / ((found.peak - found.base) / found.batch))


# ----------------------------------------------------------------------------- the records


def job_of(data, where: str) -> list[str]:
    """``[source, strategy, part]``; RecordError naming ``where`` for another shape."""
    job = need(data, list, where)
    if len(job) != 3:
        raise RecordError(f"{where} has {len(job)} items, expected [source, strategy, part]")
    source, name, part = (need(v, str, f"{where}[{i}]") for i, v in enumerate(job))
    if source != "synthetic" and not source.startswith("crowd:"):
        raise RecordError(f"{where}[0] is {source!r}, expected synthetic or crowd:<file>")
    if part not in PARTS:
        raise RecordError(f"{where}[2] is {part!r}, expected one of {', '.join(PARTS)}")
    return [source, name, part]


@dataclass
class Jobs:
    """The jobs file (``--jobs``): what the parent asks a child to measure, ``[source, strategy, part]`` each."""

    jobs: list[list[str]]
    version: int = VERSION

    def write(self, path: Path) -> None:
        write_atomically(path, json.dumps(asdict(self)).encode())

    @classmethod
    def parse(cls, data, where: str) -> Jobs:
        data = {"jobs": data} if isinstance(data, list) else data  # version 1: the bare list
        versioned(data, where, VERSION)
        return cls(
            [job_of(j, f"{where}.jobs[{i}]") for i, j in enumerate(need(data.get("jobs"), list, f"{where}.jobs"))]
        )


def read_jobs(path: Path) -> list[list[str]]:
    """The jobs in ``path``; a UserError, one line naming the file and the field, where it is not a jobs file."""
    try:
        return Jobs.parse(read_json(path, RECORD_BYTES), str(path)).jobs
    except RecordError as err:
        raise UserError(str(err)) from None


@dataclass
class ChildResults:
    """A child's results file (``--out``): its allocator setting, its device and per job done so far its row:
    ``{"job": [source, strategy, part], "slots": n}`` and ``"allocator"``, ``"ceiling"`` or ``"error"``."""

    setting: str
    device: str | None = None
    jobs: list[dict] = field(default_factory=list)
    version: int = VERSION

    def to_json(self) -> dict:
        return asdict(self)

    def write(self, path: Path) -> None:
        write_atomically(path, json.dumps(self.to_json(), indent=1).encode())

    @classmethod
    def parse(cls, data, where: str) -> ChildResults:
        versioned(data, where, VERSION)
        jobs = need(data.get("jobs"), list, f"{where}.jobs")
        for i, job in enumerate(jobs):
            at = f"{where}.jobs[{i}]"
            job_of(need(job, dict, at).get("job"), f"{at}.job")
            optional(job, "slots", int, at)
            if not any(isinstance(job.get(k), dict) for k in PARTS) and not isinstance(job.get("error"), str):
                raise RecordError(f"{at} has no allocator, ceiling or error")
        setting = need(data.get("setting"), str, f"{where}.setting")
        return cls(setting, optional(data, "device", str, where), jobs)

    @classmethod
    def read(cls, path: Path) -> ChildResults:
        """The results in ``path``; RecordError, one line naming the file and the field, otherwise."""
        return cls.parse(read_json(path, RECORD_BYTES), str(path))


# ----------------------------------------------------------------------------- the child process


def run_jobs(overrides: list[str], jobs: list[list[str]], out: Path, seconds: float) -> ChildResults:
    """Every job (see the module docstring), one source's at a time; the results written to ``out`` after each."""
    began = time.perf_counter()
    results = ChildResults(allocator_setting())
    for source in dict.fromkeys(source for source, _, _ in jobs):
        cfg = load_config(overrides + source_overrides(source), announce=None)
        device = resolve_device(cfg)
        results.device = str(device)
        step, pool = TrainStep(cfg, device), Pool(cfg)
        for _, name, part in (job for job in jobs if job[0] == source):
            left = [j for j in jobs if not any(r["job"] == j for r in results.jobs)]
            share = (seconds - (time.perf_counter() - began)) / max(1, len(left))
            results.jobs.append({"job": [source, name, part]} | run_job(step, pool, cfg, name, part, share))
            results.write(out)
        del step, pool
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def run_job(step: TrainStep, pool: Pool, cfg: DictConfig, name: str, part: str, seconds: float) -> dict:
    """One job's result: ``{"allocator": row}`` or ``{"ceiling": search}``, or ``{"error": why}``."""
    print(f"  {part} of {name} over {'synthetic' if cfg.data.boxes == 'synthetic' else cfg.data.boxes}", flush=True)
    return {"slots": cfg.data.max_boxes} | measure_job(step, pool, cfg, name, part, seconds)


def measure_job(step: TrainStep, pool: Pool, cfg: DictConfig, name: str, part: str, seconds: float) -> dict:
    try:
        use_strategy(step, cfg, name)
        if part == "allocator":
            return {"allocator": allocator_row(step, pool, cfg)}
        if step.device.type != "cuda":
            return {"error": "needs a GPU: the CPU has no device memory to run out of"}
        prober = Prober(step, pool, cfg)
        return {"ceiling": search(prober, cfg.data.batch_size, prober.estimate, seconds)}
    except Exception as err:  # noqa: BLE001  one job's failure is its row; the others run
        free_memory(step)
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        return {"error": f"{type(err).__name__}: {first}"}


def allocator_setting() -> str:
    """The allocator's configuration this process runs under (PYTORCH_CUDA_ALLOC_CONF), "default" where unset."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"


def run_file(overrides: list[str], jobs_file: Path, out: Path, seconds: float = math.inf) -> dict:
    """``run_jobs`` of the jobs listed in ``jobs_file``: ``python -m detector ceiling`` (detector/cli/main.py)."""
    jobs = read_jobs(jobs_file)
    return run_jobs(overrides, jobs, out, seconds)
