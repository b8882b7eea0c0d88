"""`make profile`: the training step of a config (detector/train/run/step.py) under torch.profiler.

The step is the one `make train` runs with the same config: the same optimizer, schedule, clipping,
autocast and speed options (train.compile, train.cuda_graphs); profile.strategy picks the loss.
MODE=forward keeps the article's protocol (copy, forward, loss; no gradient). First the loader's workers fill
its ring (every slot drawn and waiting, as in a training run whose loader keeps ahead; at most FILL_SECONDS),
so that no step waits on the loader's start-up. Then the profiler runs
``profile.wait`` steps, then ``profile.warmup``, then records ``profile.active`` steps; the step's
regions are marked from the warm-up on. The regions are labels only: the host runs ahead of the device
as it does in training (``profile.sync_regions=true`` ends each region in a device synchronize instead,
the article's protocol). Then ``profile.timed`` more steps run with neither profiler nor regions: the step
as training runs it, which the profiled step is checked against.

Each run gets its own folder, ``<profile.out_dir>/<strategy>[-forward]/<YYYYmmdd-HHMMSS>/``; under torchrun
(`make profile NPROC=2`) the step is the one `make train NPROC=2` runs (the processes share the model as
train.shard_optimizer says, each rank reads its block of every global batch), and each rank records its own
run in ``<YYYYmmdd-HHMMSS>/rank<r>/`` (`make compare RUNS="<time>/rank0 <time>/rank1"` sets them side by side):

    trace/           the gzipped Kineto trace, alone (HolisticTraceAnalysis and Perfetto open the folder)
    summary.json     the run record (detector/lab/record/run.py): its facts; per region, the spread over the
                     active steps of every measure (detector/lab/record/measures.py); the timed steps; the
                     machine's noise around the run; the analysis' warnings
    extract.json.gz  each active step as the lab models it (detector/lab/measure/extract.py): the timelines and
                     TensorBoard's Traces tab draw it
    events.out.*     TensorBoard (written by the command, detector/board/events.py): per-step scalars, the
                     tables as text, a timeline of one step

Every run records the machine's noise (measure/cpu_load.py, record/noise.py): the CPU cores other processes kept busy
for a moment before the run, during it and for a moment after, and how widely its timed steps spread. `make compare` and
`make report` flag a noisy run instead of comparing its times as if the machine were quiet; the card and `make compare`
flag a loader-paced run (detector/lab/record/run.py ``LOADER_PACED_SHARE``), whose time compare does not judge against a
run the loader does not pace.

Where the step compiles (train.compile; on a GPU the optimizer's pass too), the profile shares `make train`'s portable
cache of the compiled step, one file per configuration in ``<train.out_dir>/compile-cache/``
(detector/train/run/speed_options.py ``compile_cache_file``): a profile after a training run or another profile of that
configuration loads it, and the first step saves what it compiled for the next run (MODE=forward compiles other graphs,
and keeps a file of its own). The command's last line, and summary.json's ``times``, say where the run's wall clock
went, part by part: the model, the first step (and what it found in that cache), the other steps, the profiler's stop,
the trace's writing, the timed steps, the analysis, the TensorBoard events.

A failed run removes only its own new folder (a rank, its rank's); older runs are never touched.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from detector.config.device import device_name
from detector.data import build_loader
from detector.lab.folders import new_run_dir
from detector.lab.measure import analysis, extract
from detector.lab.measure.allocator import StepMeter
from detector.lab.measure.cpu_load import LoadMeter
from detector.lab.measure.trace import load_trace
from detector.lab.present.text import run_card
from detector.lab.record.noise import Noise
from detector.lab.record.run import FIRST_STEP, LoaderFill, ProfileRecord, RunTimes, Timed, write_summary
from detector.lab.record.source import DataSource
from detector.lab.record.steps import Extract, write_extract
from detector.losses import get_strategy
from detector.train.distributed import processes as distributed
from detector.train.distributed.processes import DistEnv
from detector.train.observe.memory_estimate import check_command_memory
from detector.train.observe.profile_window import make_profiler
from detector.train.run.rank_data import rank_loader
from detector.train.run.speed_options import (
    COMPILING,
    compile_cache_file,
    compile_caches,
    load_compile_cache,
    save_compile_cache,
)
from detector.train.run.step import TrainStep, time_steps

# The bound on the wait for the loader's ring to fill before the first step. A loader that keeps up with a step fills
# its 2 slots per worker (and 2 more) in seconds (`make bench-step` prints its images/s); one that cannot in this long
# is too slow for any step, and the run then shows as loader-paced.
FILL_SECONDS = 30.0


class Profiled(NamedTuple):
    """A profile run: its folder, record, step extract (this rank's, under torchrun) and card (the markdown printed at
    its end, and the Text tab's: built once)."""

    run_dir: Path
    record: ProfileRecord
    extract: Extract
    card: str


class Stepped(NamedTuple):
    """What ``profile_steps`` ran: the trace file, the timed steps' wall ms, the profiled steps' losses (on the device,
    unread), the loader's fill, and what the first step found in the compiled step's cache (``RunTimes``)."""

    trace: Path
    timed: list[float]
    losses: list[torch.Tensor]
    fill: LoaderFill
    compile_cache: str | None


class Laps:
    """The run's wall clock cut into parts, one after the other: ``lap(part)`` adds the seconds since the last lap to
    ``part``, so that the parts sum to the time since the first."""

    def __init__(self):
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, part: str, listed: bool = True) -> None:
        """``listed`` false: no lap now (the time since the last joins the next part's)."""
        if not listed:
            return
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now


def run_profile(cfg: DictConfig) -> Profiled:
    """Profile the config's training step, into a new run folder; its TensorBoard events are the profile command's
    (detector/cli/main.py ``profile``: detector/board/ draws on the lab, not the other way round)."""
    cfg = OmegaConf.merge(cfg, {"train": {"strategy": cfg.profile.strategy}})
    env, device = distributed.setup(cfg)  # one process: no group, the config's device
    try:
        return profile_rank(cfg, env, device)
    finally:
        distributed.teardown(env)


def profile_rank(cfg: DictConfig, env: DistEnv, device: torch.device) -> Profiled:
    pcfg = cfg.profile
    laps, meter = Laps(), LoadMeter()
    meter.start()  # the machine's load before the steps: a window over the model's build (its own CPU left out)
    check_command_memory(cfg, device, "profile", batches=pcfg.wait + pcfg.warmup + pcfg.active + pcfg.timed)
    step = TrainStep(cfg, device, env.world_size)  # the training step of this config; refuses what cannot run here
    folder = pcfg.strategy if pcfg.mode == "train" else f"{pcfg.strategy}-forward"
    run_dir = rank_run_dir(Path(pcfg.out_dir) / folder, env)
    try:
        laps.lap("model and optimizer")
        before = meter.stop(sample=True)
        laps.lap("load samples", listed=meter.slept > 0)  # the window's rest, where the build was shorter
        meter.start()
        allocator = StepMeter(device)  # the caching allocator's own figures of each step, on a GPU
        ran = profile_steps(step, cfg, device, run_dir / "trace", env, laps, allocator)
        step.strategy.nonfinite_gradient()  # a user's backward of NaN: its profile would time a broken step
        during, own = meter.stop(), meter.own
        meter.start()  # the load after the steps: a window over the trace's analysis
        spread = Timed.of(ran.timed).step_ms.relative_iqr()
        timed_by = "device" if device.type == "cuda" else "host"

        def noise() -> Noise:  # once the trace is analysed: the window after the steps lies over the analysis
            after = meter.stop(sample=True)
            laps.lap("load samples", listed=meter.slept > 0)  # the window's rest, where the analysis was shorter
            return Noise(meter.cores, before, during, after, spread, load_own=own, timed_by=timed_by)

        warnings = nonfinite(ran.losses)
        record, steps_extract = summarise_run(cfg, device, run_dir, ran, noise, laps, warnings, allocator.steps)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # only this run's own, unfinished folder
        if env.world_size > 1 and env.is_main:
            with contextlib.suppress(OSError):
                run_dir.parent.rmdir()  # the run's folder, once no rank's is left in it
        raise
    card = run_card(record)
    print(card)
    return Profiled(run_dir, record, steps_extract, card)


def rank_run_dir(parent: Path, env: DistEnv) -> Path:
    """A new ``parent/<time>/``, or under torchrun ``parent/<time>/rank<r>/``: rank 0 picks the time, every rank
    makes its own folder in it."""
    if env.world_size == 1:
        return new_run_dir(parent)
    name = [new_run_dir(parent).name if env.is_main else None]
    dist.broadcast_object_list(name, src=0)
    run_dir = parent / name[0] / f"rank{env.rank}"
    run_dir.mkdir()
    return run_dir


def profile_steps(
    step: TrainStep,
    cfg: DictConfig,
    device: torch.device,
    trace_dir: Path,
    env: DistEnv,
    laps: Laps,
    allocator: StepMeter | None = None,
) -> Stepped:
    """Load the compiled step's cache where the step compiles (`make train`'s of the same configuration: the same
    file, under train.out_dir), let the loader fill, run wait + warmup + active steps under the profiler (the first
    step's compilation saved to that cache for the next run), then ``profile.timed`` steps without it.
    ``allocator`` (a StepMeter) reads each step's figures; ``laps`` times each of these parts."""
    pcfg = cfg.profile
    total = pcfg.wait + pcfg.warmup + pcfg.active
    run = step if pcfg.mode == "train" else step.forward_only
    print(
        f"profiling {step.strategy.name} ({step.strategy.description}), mode={pcfg.mode}, "
        f"device={device_name(device)}, batch {cfg.data.batch_size} x {cfg.data.image_size}px, "
        f"{cfg.data.max_boxes} slots, {total} steps (wait {pcfg.wait}, warmup {pcfg.warmup}, active {pcfg.active})"
        + (f", rank {env.rank} of {env.world_size} ({step.sharing.description})" if env.world_size > 1 else "")
        + (", regions synchronised (profile.sync_regions)" if step.regions.sync else "")
        + (f", then {pcfg.timed} timed without the profiler" if pcfg.timed else "")
    )
    cache, loaded = load_step_cache(cfg, device, env.world_size)
    if cache is not None:
        laps.lap("compile cache")
    layout = step.strategy.layout
    if env.world_size == 1:
        loader = build_loader(cfg.data, layout, device)
    else:  # this rank's block of each global batch, as in training
        loader = rank_loader(cfg.data, layout, device, env.rank, env.world_size, 0, total + pcfg.timed)
    batches = iter(loader)
    fill = fill_loader(batches, loader.workers)
    laps.lap("loader")
    if cache is not None:
        print(f"  compiling: step 1 waits for {COMPILING} ({compile_caches()})", flush=True)
    losses, saved = [], False
    with make_profiler(pcfg, trace_dir, device, step.strategy.name) as prof:
        time_trace_export(prof, laps)
        for i in range(total):
            step.regions.active = i >= pcfg.wait
            start = time.perf_counter()
            if allocator:
                allocator.start()
            losses.append(run(next(batches)))  # kept, not read: reading would wait for the device
            if allocator:
                allocator.stop(i)  # the step is ProfilerStep#i
            took = time.perf_counter() - start
            if i == 0:
                laps.lap(FIRST_STEP)
                if cache is not None:
                    saved = env.is_main and save_compile_cache(cache)  # before the step a trace may keep begins
                    laps.lap("compile cache")
            elif i == total - 1:
                laps.lap(f"{total - 1} more steps")  # the profiler's start, and its waits for the device, included
            phase = "wait" if i < pcfg.wait else "warmup" if i < pcfg.wait + pcfg.warmup else "active"
            print(f"  step {i + 1:3d}/{total} [{phase:6s}] {took * 1e3:9.1f} ms", flush=True)
            prof.step()  # after the window's last step: the profiler stops and writes the trace
            if i == 0 and i < pcfg.wait + pcfg.warmup:
                # A user's backward of NaN stops here, before the traced steps run on NaN weights (whose frees of
                # blocks made before the trace began make torch's profiler warn on stderr); a step the trace keeps
                # is never waited for.
                step.strategy.nonfinite_gradient()
    if pcfg.timed:
        print(f"  timing {pcfg.timed} steps without the profiler ...", flush=True)
    timed = time_steps(step, run, batches, pcfg.timed, device)
    if pcfg.timed:
        laps.lap(f"{pcfg.timed} timed steps")
    del batches
    traces = sorted(trace_dir.glob("*.pt.trace.json*"))
    if len(traces) != 1:
        raise RuntimeError(f"expected one trace in {trace_dir}, found {len(traces)}")
    return Stepped(traces[0], timed, losses, fill, cache_note(cache, loaded, saved))


def load_step_cache(cfg: DictConfig, device: torch.device, world_size: int) -> tuple[Path | None, str | None]:
    """The file of the compiled step's cache that `make train` of this configuration reads and writes (None where
    nothing compiles), loaded where it exists; what it loaded, said as training says it."""
    cache = compile_cache_file(cfg, device, world_size, cfg.profile.mode)
    loaded = load_compile_cache(cache)
    if loaded:
        print(f"  compile cache {cache}: {loaded}", flush=True)
    return cache, loaded


def time_trace_export(prof: torch.profiler.profile, laps: Laps) -> None:
    """Time the profiler's stop and its trace's export apart: both run inside the ``prof.step()`` that ends the window,
    the stop first (on a GPU it waits for the device to finish the steps queued), then the export (torch writes the
    JSON, then gzips it)."""
    export = prof.on_trace_ready

    def timed(profiler) -> None:
        laps.lap("profiler stop")
        print("  writing the trace ...", flush=True)
        export(profiler)
        laps.lap("trace written")

    prof.on_trace_ready = timed


def cache_note(cache: Path | None, loaded: str | None, saved: bool) -> str | None:
    """What the first step found in the compiled step's cache, in a few words; None where nothing compiles."""
    if cache is None:
        return None
    if loaded:
        return f"compile cache {loaded}"
    return "compiled; its cache saved for the next run" if saved else "compiled; no cache saved"


def nonfinite(losses: list[torch.Tensor]) -> list[str]:
    """A warning for the run's card and compare where a profiled step's loss was not finite (read once, after the
    timed steps): such a loss trains nothing, and its times may not be those of the loss it is meant to be."""
    values = torch.stack([loss.detach().float().reshape(()) for loss in losses]).cpu()
    bad = torch.nonzero(~torch.isfinite(values)).flatten().tolist()
    if not bad:
        return []
    return [
        f"the loss is not finite at {len(bad)} of the {len(values)} profiled steps (step {bad[0] + 1}: "
        f"{values[bad[0]].item()}): the times are those of a loss that trains nothing"
    ]


def fill_loader(batches, workers: int) -> LoaderFill:
    """Wait (at most FILL_SECONDS) for the loader's workers to fill its ring: the steps then start from the state of
    a loader that keeps ahead of training, not from its start-up (forking the workers, their first draws). The
    steps themselves are untouched: a loader slower than the step drains the ring and shows in the data wait."""
    start = time.perf_counter()
    waiting, room = batches.fill(FILL_SECONDS)
    fill = LoaderFill(workers, waiting, room, time.perf_counter() - start, FILL_SECONDS)
    print(f"  {fill.describe()}", flush=True)
    return fill


def summarise_run(
    cfg: DictConfig,
    device: torch.device,
    run_dir: Path,
    ran: Stepped,
    noise: Callable[[], Noise],
    laps: Laps,
    warnings: list[str] = (),
    allocator: dict[int, dict] | None = None,
) -> tuple[ProfileRecord, Extract]:
    """summary.json and extract.json.gz of a finished profile run (``ran``: what its steps left; ``noise``: the
    machine's load around it, read once the trace is, whose reading is the load's window after the steps); ``laps``:
    its parts so far, to which the analysis adds its own (the trace read and measured, extract.json.gz written),
    recorded as the record's ``times``; ``warnings`` join the analysis' own; ``allocator``: the caching allocator's
    figures of each step (a GPU's), which the trace's memory is held against."""
    print("  analysing the trace ...", flush=True)
    parsed = load_trace(ran.trace)
    steps = analysis.measure_steps(parsed)
    laps.lap("analysed")
    measured_noise = noise()
    record = ProfileRecord(
        strategy=cfg.profile.strategy,
        mode=cfg.profile.mode,
        device=device_name(device),
        torch=torch.__version__,
        batch_size=cfg.data.batch_size,
        image_size=cfg.data.image_size,
        max_boxes=cfg.data.max_boxes,
        analysis=analysis.summarise(parsed, steps, allocator),
        per_step=steps,
        timed=Timed.of(ran.timed),
        noise=measured_noise,
        preset=cfg.preset,
        sync_regions=bool(cfg.profile.sync_regions and device.type == "cuda"),
        emulated=get_strategy(cfg.profile.strategy).emulated(device),  # its times are an emulator's
        run=run_dir.name,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        trace=str(ran.trace.relative_to(run_dir)),
        config=OmegaConf.to_container(cfg, resolve=True),
        data=DataSource.of(cfg.data),
        loader_fill=ran.fill,
        folder=run_dir,
    )
    record.analysis.warnings += warnings
    steps_extract = extract.build(parsed, steps, extract.about(record))
    write_extract(run_dir, steps_extract)  # what the timelines and TensorBoard's Traces tab draw
    laps.lap("analysed")
    record.times = RunTimes(dict(laps.seconds), ran.compile_cache)
    write_summary(run_dir, record)
    return record, steps_extract
