"""train.strategy=auto: the strategy a run trains with, chosen before its first step by timing the candidates in the
very step it will train with (step.py's TrainStep, built as the run builds it), and kept for the next run of the same
settings. The record of a choice, its rule and its line are choice.py's.

A run comes by its strategy in the first of these ways that applies (``choose``):

1. resumed: an unfinished run of this configuration in the run folder continues with the strategy its checkpoint holds;
2. kept: the choice of these settings in ``<train.out_dir>/strategy-auto/`` (``kept_file``) is taken at once;
3. measured: the candidates, ``train.auto_candidates`` or else the ``TOP`` strategies that the ranking puts first
   among those that train here (neither unavailable, nor emulated, nor refused by the speed options), are timed in
   one TrainStep built as the run builds it (``measure``: the model is compiled without the loss, so the candidates
   share its compiled graphs and the step differs by the loss alone), its loss swapped for each in turn: ``WARM``
   steps of the run's first batches in the candidate's layout (the first candidate's first compiles and is waited
   for), then timed as `make profile` times its steps (``time_steps``: CUDA events on a GPU), with the step's peak
   memory rise on a GPU. Each must compute, on the model's first prediction, the loss the first computes: auto
   chooses among ways of computing one loss, not among losses. The fastest trains; where others' [q1–q3] overlap
   its, the rule of choice.decide.

The ranking is the command's (`make shapes`' prediction from the boxes' counts, detector/lab/shapes.py): the library
imports no lab, so the command hands it in (``Rank``). Measuring is bounded: at most ``TIMED`` timed steps a
candidate, fewer where the run is short, so that all the candidates' steps stay near ``SHARE`` of the run's, and
never fewer than ``LEAST``. The run then builds its own TrainStep from the seed: it trains as a run of the chosen
strategy would.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from detector.checked import RecordError
from detector.config.device import device_name, synchronize
from detector.data import to_device
from detector.data.annotations import SYNTHETIC
from detector.errors import UserError, said
from detector.losses import get_strategy
from detector.train import choice as records
from detector.train.checkpoints.manager import fingerprint, same_run, saved_strategy
from detector.train.choice import Candidate, Choice
from detector.train.distributed.processes import Control, DistEnv, count_valid, global_mean
from detector.train.run.graphed import GraphedStep
from detector.train.run.rank_data import rank_loader
from detector.train.run.speed_options import digest, speed_option_refusal, step_settings
from detector.train.run.step import TrainStep, time_steps

AUTO = "auto"
TOP = 3  # candidates from the ranking: the prediction is a model of a few timed cases, its first few are close
WARM = 2  # steps before the timed ones: the first compiles (and cuDNN benchmarks); the second runs as the rest
TIMED = 10  # timed steps a candidate, as make profile's profile.timed
LEAST = 3  # a median and two quartiles
SHARE = 0.02  # of the run's steps, that all the candidates' steps take at most where the run is long enough
FILL_SECONDS = 10.0  # the wait for the loader's ring before the timed steps, as the profile's (its own is 30 s)
AGREES = 1e-2  # relative: two candidates' loss on one bf16 prediction; their own arithmetic differs by far less


@dataclass
class Ranking:
    """The strategies in the order the command predicts them fastest for the run's data, and how it predicted."""

    strategies: list[str]
    source: str


Rank = Callable[[DictConfig, torch.device], Ranking]


def with_strategy(cfg: DictConfig, name: str) -> DictConfig:
    """A copy of ``cfg`` whose train.strategy is ``name``."""
    cfg = copy.deepcopy(cfg)
    cfg.train.strategy = name
    return cfg


def choose(
    cfg: DictConfig,
    device: torch.device,
    env: DistEnv,
    control: Control,
    run_dir: Path,
    rank: Rank | None,
    say=print,
) -> Choice:
    """The strategy ``cfg`` (train.strategy=auto) trains with in ``run_dir``, and why (see the module docstring).
    Process 0 decides; every process times the candidates (their steps are collective) and takes its choice."""
    started = time.perf_counter()
    plan = control.broadcast(plan_choice(cfg, device, env, run_dir, rank, say) if env.is_main else None)
    if isinstance(plan, Choice):
        return plan
    planned = time.perf_counter() - started
    names, ranking = plan
    timed = timed_steps(cfg.train.steps, len(names))
    say(
        f"strategy auto: timing {', '.join(names)} in the training step, {WARM} warm-up and {timed} timed steps each "
        f"(candidates: {ranking})",
        flush=True,
    )
    measured, first_call = measure(cfg, names, device, env, timed, say)
    left_out = [f"{name}: out of memory on {device}" for name, found in measured.items() if found is None]
    measured = [found for found in measured.values() if found is not None]
    if not measured:
        raise UserError(f"train.strategy=auto: every candidate ran out of memory on {device} ({', '.join(names)})")
    agree(measured, device)
    strategy, rule = records.decide([c for c, _ in measured])
    made = Choice(
        strategy=strategy,
        rule=rule,
        candidates=[c for c, _ in measured],
        ranking=ranking,
        timed_steps=timed,
        warm_steps=WARM,
        short_run=timed < TIMED,
        seconds=time.perf_counter() - started,
        ranking_seconds=planned if rank is not None and not cfg.train.auto_candidates else 0.0,
        compile_seconds=first_call,
        device=device_name(device),
        torch=torch.__version__,
        left_out=left_out,
    )
    made = control.broadcast(made)  # process 0's times decide
    if env.is_main:
        made.write(kept_file(cfg, device, env.world_size))
    return made


def plan_choice(cfg: DictConfig, device: torch.device, env: DistEnv, run_dir: Path, rank: Rank | None, say):
    """The choice where the run has one already (resumed, kept), else (the candidates to time, where they came from)."""
    found = resumed(cfg, run_dir, env.world_size)
    if found:
        return found
    file = kept_file(cfg, device, env.world_size)
    if file.is_file():
        try:
            kept = records.read(file)
        except RecordError as err:
            say(f"strategy auto: the kept choice is not used ({err}): measuring again")
        else:
            reason = refusal(kept.strategy, cfg, device, env.world_size)
            if not reason:
                kept.source, kept.file = "kept", str(file)
                return kept
            say(f"strategy auto: the kept choice {kept.strategy} cannot train here ({reason}): measuring again")
    return candidates(cfg, device, env.world_size, rank)


def resumed(cfg: DictConfig, run_dir: Path, world_size: int) -> Choice | None:
    """The choice of the unfinished run in ``run_dir`` that this run continues (train.resume: auto, of this very
    configuration; true, any: the resume refuses another's in its own line), from the strategy its checkpoint holds;
    its measure from the run folder's record where it is there."""
    found = saved_strategy(run_dir) if cfg.train.resume != "false" else None
    if found is None or found[0] == AUTO:
        return None
    name, step = found
    if cfg.train.resume == "auto":
        chosen = with_strategy(cfg, name)
        same = same_run(run_dir, fingerprint(chosen, world_size), cfg.data.batch_size * world_size)
        if not 0 < same < cfg.train.steps:
            return None
    try:
        made = records.read(run_dir / records.RUN_FILE)
    except RecordError:  # the folder's record lost: the strategy alone, from the checkpoint
        made = Choice(name, records.FASTER, [], "", 0, 0, False, 0.0, 0.0, "?", torch.__version__)
    made.strategy, made.source, made.resumed_at = name, "resumed", step
    return made


def candidates(cfg: DictConfig, device: torch.device, world_size: int, rank: Rank | None) -> tuple[list[str], str]:
    """(the candidates to time, where they came from): train.auto_candidates, each of which must train here, or the
    ranking's first TOP of those that train here, not emulated. One line for a candidate that cannot, and for none."""
    named = list(dict.fromkeys(cfg.train.auto_candidates))
    if named:
        for name in named:
            reason = refusal(name, cfg, device, world_size)
            if reason:
                raise UserError(f"train.auto_candidates: {name} cannot train here: {reason}")
        return named, "train.auto_candidates"
    if rank is None:
        raise UserError(
            "train.strategy=auto has no candidates: name them in train.auto_candidates, or run it with `python -m "
            "detector train` (make train), which ranks the strategies by make shapes' prediction"
        )
    ranking = rank(cfg, device)
    usable = [n for n in ranking.strategies if not refusal(n, cfg, device, world_size, emulated=True)]
    if not usable:
        ranked = ", ".join(ranking.strategies) or "none"
        raise UserError(
            f"train.strategy=auto: no candidate trains here (the ranking's: {ranked}; each unavailable, emulated or "
            "refused by the speed options on this device): name them in train.auto_candidates, or set train.strategy"
        )
    return usable[:TOP], f"the {min(TOP, len(usable))} first of {ranking.source}"


def refusal(name: str, cfg: DictConfig, device: torch.device, world_size: int, emulated: bool = False) -> str | None:
    """Why strategy ``name`` cannot train with ``cfg`` on ``device`` (or, with ``emulated``, runs in an emulator
    there, whose times are not the code's); None where it can."""
    strategy = get_strategy(name)
    reason = strategy.unavailable(device) or speed_option_refusal(strategy, cfg.train, world_size, device)
    return reason or (strategy.emulated(device) if emulated else None)


def timed_steps(steps: int, count: int) -> int:
    """Timed steps a candidate: TIMED, fewer where ``count`` candidates' steps would take more than SHARE of the
    run's ``steps``, at least LEAST."""
    return max(LEAST, min(TIMED, int(SHARE * steps / count) - WARM))


def measure(
    cfg: DictConfig, names: list[str], device: torch.device, env: DistEnv, timed: int, say=print
) -> tuple[dict[str, tuple[Candidate, float] | None], float]:
    """({candidate: (its timed steps, its loss on the reference prediction)}, the seconds of the step's first call):
    one TrainStep, built and compiled once as the run builds it, its loss swapped for each candidate in turn (the
    model is compiled without the loss, so every candidate runs the same compiled graphs: the step's time and memory
    differ by the loss alone), each over the run's first batches in its own layout. Every candidate's batches are
    drawn while the model builds and compiles (``candidate_batches``): the candidates wait for no loader. None for a
    candidate whose step runs out of the GPU's memory (padded's B·M slots over crowds). One line where a candidate
    fails otherwise; the step and its batches freed after."""
    step = reference = None
    found: dict[str, tuple[Candidate, float] | None] = {}
    drawn = {}
    first_call = 0.0
    try:
        for name in names:
            drawn[name] = candidate_batches(cfg, name, device, env, WARM + timed)
        step = TrainStep(with_strategy(cfg, names[0]), device, env.world_size)
        for name in names:
            started = time.perf_counter()
            step.strategy = get_strategy(name)
            step.graph = GraphedStep(step) if cfg.train.cuda_graphs else None  # a graph holds the loss it captured
            batches = drawn[name]
            try:
                first = next(batches)
                if reference is None:  # the model's first forward: it compiles where the run compiles
                    reference = reference_prediction(step, first)
                loss = candidate_loss(step, reference, first)
                step(first)
                if not first_call:  # the step's first call: its compile, which the run's own first step then skips
                    synchronize(device)
                    first_call = time.perf_counter() - started
                for _ in range(WARM - 1):
                    step(next(batches))
                step.strategy.nonfinite_gradient()
                for waiting in drawn.values():  # every ring full: no worker draws beside the timed steps
                    waiting.fill(FILL_SECONDS)
                candidate = Candidate(name, *time_candidate(step, batches, timed, device))
                found[name] = candidate, loss
                say(f"  {name:<18} {candidate.times()} ms a step, {time.perf_counter() - started:.1f} s", flush=True)
            except torch.cuda.OutOfMemoryError:
                found[name] = None
                step.optimizer.zero_grad(set_to_none=True)
                say(f"  {name:<18} out of memory on {device}", flush=True)
            except Exception as err:  # a loss of the user's that raises (one line already), a kernel this device lacks
                what = said(err) if isinstance(err, UserError) else f"{type(err).__name__}: {said(err)}"
                raise UserError(
                    f"train.strategy=auto: candidate {name} failed in the training step on {device}: {what}"
                ) from err
            finally:
                batches.close()
                free(device)
    finally:
        for batches in drawn.values():
            batches.close()
        del step, reference, drawn
        free(device)
    return found, first_call


def candidate_batches(cfg: DictConfig, name: str, device: torch.device, env: DistEnv, count: int):
    """The run's first ``count`` batches in candidate ``name``'s layout, their workers started now: a ring of a slot
    a batch (of workers no more than batches), so that every batch is drawn and waits while the step is built and
    compiled, and no worker draws while a candidate is timed."""
    loader = rank_loader(cfg.data, get_strategy(name).layout, device, env.rank, env.world_size, 0, count)
    loader = dataclasses.replace(loader, workers=min(loader.workers, count), slots=count)
    batches = iter(loader)
    batches.started()
    return batches


def free(device: torch.device) -> None:
    """A GPU's memory of what was freed back to the device: the next candidate's step, then the run's own model and
    optimizer, take its place (the CPU's tensors go with their last reference)."""
    if device.type == "cuda":
        gc.collect()  # what a reference cycle holds (a traceback's frames, a compiled graph's) freed now
        torch.cuda.empty_cache()


def reference_prediction(step: TrainStep, batch) -> torch.Tensor:
    """The model's prediction for ``batch`` before any step, detached: every candidate's loss is computed on it."""
    images, _ = to_device(batch, step.device)
    with step.autocast:
        return step.net(images).detach()


def candidate_loss(step: TrainStep, pred: torch.Tensor, batch) -> float:
    """The candidate's global mean loss on ``pred`` and its layout's targets of ``batch`` (the same samples for every
    candidate), as the step computes it."""
    _, targets = to_device(batch, step.device)
    pred = pred.clone().requires_grad_()  # as the model's output is: a strategy may keep what its backward needs
    return global_mean(step.strategy(pred, targets), count_valid(targets, step.device), step.world_size)[1].item()


def time_candidate(step: TrainStep, batches, count: int, device: torch.device) -> tuple[list[float], int | None]:
    """The ms of ``count`` steps, timed as the profile times them, and the step's peak memory rise over them: the
    bytes allocated at the peak above those allocated before (the model's, the optimizer's); None on the CPU, whose
    allocator keeps no peak."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    step_ms = time_steps(step, step, batches, count, device)
    return step_ms, torch.cuda.max_memory_allocated(device) - before if cuda else None


def agree(measured: list[tuple[Candidate, float]], device: torch.device) -> None:
    """Every candidate's loss on the reference prediction is finite and the first candidate's, within AGREES: one
    prediction and one batch make one loss, whichever way it is computed. One line naming the first that does not."""
    (base, expected), *others = measured
    for candidate, loss in [(base, expected), *others]:
        if not torch.isfinite(torch.tensor(loss)):
            raise UserError(
                f"train.strategy=auto: candidate {candidate.strategy}'s loss is {loss} at the first step on {device}"
            )
        if abs(loss - expected) > AGREES * abs(expected) + 1e-6:
            raise UserError(
                f"train.strategy=auto: candidate {candidate.strategy} computes another loss: {loss:.6g} at the first "
                f"step where {base.strategy}'s is {expected:.6g} (the same model and batch); auto chooses among ways "
                "of computing one loss: name candidates of one loss in train.auto_candidates"
            )


# ----------------------------------------------------------------------------- the choice kept for these settings


KEPT_FOLDER = "strategy-auto"  # under train.out_dir, beside the compile cache's folder (speed_options.py)


def settings_key(cfg: DictConfig, device: torch.device, world_size: int) -> dict:
    """What the choice depends on: the device, torch, the model and data configuration (the loader's own settings
    aside), the boxes' source (an annotation file by its path, size and time), the step's speed options and the
    candidates asked for."""
    data = {k: v for k, v in OmegaConf.to_container(cfg.data).items() if k not in ("num_workers", "worker_timeout")}
    if cfg.data.boxes != SYNTHETIC:
        path = Path(cfg.data.boxes.partition(":")[2]).resolve()
        stat = path.stat() if path.is_file() else None
        kind = cfg.data.boxes.partition(":")[0]
        data["boxes"] = [kind, str(path), stat.st_size if stat else None, stat.st_mtime_ns if stat else None]
    return step_settings(cfg, device, world_size) | {"data": data, "candidates": list(cfg.train.auto_candidates)}


def kept_file(cfg: DictConfig, device: torch.device, world_size: int) -> Path:
    """``<train.out_dir>/strategy-auto/<digest of settings_key>.json``."""
    return Path(cfg.train.out_dir) / KEPT_FOLDER / f"{digest(settings_key(cfg, device, world_size))}.json"
