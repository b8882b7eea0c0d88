"""`make train EXPERIMENT=<name>`: train the detector with one GIoU loss strategy, or with each in turn.

``train`` reads top to bottom: the run folder, the step (detector/train/step.py, the same step that
`make profile` times), the checkpoint to resume from, data, the loop, the summary. A run writes to
``runs/train/<experiment>/<run>/`` with run = ``<strategy>[+compile][+cuda_graphs][+float8]``, whatever the number
of processes (a run resumes on another number of them, with the same global batch):

    config.yaml       the merged configuration
    events.out.*      TensorBoard scalars: train/, eval/, time/, memory/
    checkpoint.pt     model, optimizer, schedule, step, RNG states, data position, the loss of every
                      step and the evaluations so far (atomic writes with a checksum)
    summary.json      final loss and metrics, step times, images/s, the loss curve
    profile/          with train.profile=true: one torch.profiler window, regions as in `make profile`

Guarantees:
- Resuming gives the weights, the logged curve and the summary of an uninterrupted run (the loss of
  every step is kept in the checkpoint; log lines fall on multiples of train.log_every).
- A non-finite loss stops the run at the next log line, naming the first bad step, with the last
  good checkpoint kept (train.nonfinite=skip skips such steps' updates instead).
- One process per run folder (a lock); a fresh run moves the folder's earlier run to a visible sibling
  ``<run>-<its start time>/`` and says so (detector/runs.py): a re-run never destroys results.
- What cannot fit is refused before it is allocated, in one line with the figures (``check_run_memory``).
- A data worker's death or Ctrl-C stops the run in one line naming the last checkpoint, which stays intact.
- Throughput is reported by the wall clock (data waits included), with the device time beside it and the
  device's idle time between steps: the part of the host's waits (data, Python) that reached the GPU.

Multi-GPU: under torchrun each rank reads its own block of every global batch and the loss is the
global mean over valid boxes (detector/train/distributed.py); rank 0 (the global one, on several nodes)
evaluates, logs and checkpoints (under train.shard_optimizer=fsdp2 every rank takes part in the
evaluation's forward). The other ranks send rank 0 their shares of the state first, so the checkpoint is
one process's, whatever the setting or number of processes that resumes it (detector/train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.tensorboard import SummaryWriter

from detector.config import device_name
from detector.data import build_loader, rank_loader, resolve_workers
from detector.errors import UserError
from detector.loader import GIB, DataWorkerDied, MemoryRefusal, check_memory, default_slots
from detector.model import build_model
from detector.train import distributed, folders
from detector.train.checkpoint import (
    LAYOUT,
    fingerprint,
    load_checkpoint,
    one_linear,
    rng_state,
    save_checkpoint,
    shared_checkpoint,
)
from detector.train.distributed import DistEnv
from detector.train.metrics import evaluate
from detector.train.profile_window import make_profiler
from detector.train.step import TrainStep

TIMING_SKIP = 5  # first steps of a run left out of its step times: compilation, autotuning, graph capture


class NonFiniteLoss(UserError):
    pass


def run_name(tcfg) -> str:
    options = [name for name in ("compile", "cuda_graphs", "float8") if tcfg[name]]
    return "+".join([tcfg.strategy, *options])


def format_eta(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


class StepClock:
    """Each step's device time (CUDA events, read only when the host waits anyway) or host time (CPU), and
    the time the device sat idle since the previous step ended: the only part of a host-side wait (data,
    Python) that costs throughput. The host runs ahead of the GPU, so it may wait for data a long time
    while the GPU is still busy with earlier steps; the idle time says whether that wait reached the GPU.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.last_stop = None  # the previous step's end mark

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks.append([self._now()])

    def stop(self) -> None:
        self.marks[-1].append(self._now())

    def read(self) -> list[tuple[float, float]]:
        """(ms of the step, ms idle before it) of each step since the last read; the first step has no idle time."""
        out = []
        for start, stop in self.marks:
            idle = 0.0 if self.last_stop is None else self._ms(self.last_stop, start)
            out.append((self._ms(start, stop), idle))
            self.last_stop = stop
        self.marks = []
        return out

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class Log:
    """Every step's loss and time; flushed (one host wait) at log lines, checkpoints and evaluations."""

    def __init__(self, device: torch.device, losses: list[float]):
        self.clock = StepClock(device)
        self.losses = losses  # loss of step s at index s - 1, restored on resume
        self.pending: list[torch.Tensor] = []
        self.timings: list[dict] = []  # per step: step, wall_ms, device_ms, idle_ms, data_ms
        self.window_start, self.window_data = time.perf_counter(), []

    def add(self, loss: torch.Tensor, data_seconds: float) -> None:
        self.pending.append(loss.detach())
        self.window_data.append(data_seconds * 1e3)

    def flush(self, step: int) -> list[int]:
        """Read the pending steps (ending at ``step``); returns those whose loss is not finite."""
        if not self.pending:
            return []
        values = torch.stack(self.pending).float().tolist()
        wall_ms = (time.perf_counter() - self.window_start) * 1e3 / len(values)
        first = step - len(values) + 1
        for i, ((ms, idle_ms), data_ms) in enumerate(zip(self.clock.read(), self.window_data, strict=True)):
            self.timings.append(
                {"step": first + i, "wall_ms": wall_ms, "device_ms": ms, "idle_ms": idle_ms, "data_ms": data_ms}
            )
        self.losses += values
        self.pending, self.window_data, self.window_start = [], [], time.perf_counter()
        return [first + i for i, v in enumerate(values) if not math.isfinite(v)]

    def window_mean(self, step: int, log_every: int) -> float:
        """Mean loss of the log window ending at ``step``: (step - log_every, step], the same on resume."""
        window = self.losses[max(0, step - log_every) : step]
        return sum(window) / len(window)

    def history(self, log_every: int, last: int) -> list[tuple[int, float]]:
        steps = [s for s in range(log_every, last + 1, log_every)] + ([last] if last % log_every else [])
        return [(s, self.window_mean(s, log_every)) for s in steps]


def throughput(timings: list[dict], global_batch: int, skip_until: int) -> dict:
    """Median step times and images/s, by the wall clock and by the device, past the first steps."""
    timed = [t for t in timings if t["step"] > skip_until] or timings
    if not timed:
        keys = ("step_ms", "device_step_ms", "device_idle_ms", "data_wait_ms", "images_per_s", "device_images_per_s")
        return dict.fromkeys(keys) | {"timed_steps": 0}

    def median(key: str) -> float:
        return statistics.median(t[key] for t in timed)

    wall, device = median("wall_ms"), median("device_ms")
    return {
        "step_ms": wall,  # wall clock per step, data wait included
        "device_step_ms": device,
        "device_idle_ms": median("idle_ms"),  # between steps: what data and host cost the GPU
        "data_wait_ms": median("data_ms"),  # the host's wait; overlapped when the host is ahead
        "images_per_s": global_batch / wall * 1e3,
        "device_images_per_s": global_batch / device * 1e3,
        "timed_steps": len(timed),
    }


# ----------------------------------------------------------------------------- one training run


def train(cfg: DictConfig, experiment: str, env: DistEnv, device: torch.device) -> dict:
    """One training run of ``cfg.train.strategy``; returns its summary (also written to summary.json)."""
    tcfg = cfg.train
    global_batch = cfg.data.batch_size * env.world_size
    if tcfg.steps * global_batch > tcfg.eval_start:
        raise UserError(
            f"{tcfg.steps} steps x {global_batch} images reach past train.eval_start={tcfg.eval_start}: "
            "training would see held-out images"
        )
    check_run_memory(cfg, env.world_size, device)
    run_dir = Path(tcfg.out_dir) / experiment / run_name(tcfg)
    with folders.locked(run_dir) if env.is_main else contextlib.nullcontext():
        if env.is_main:
            folders.reveal_hidden(run_dir)
        return Run(cfg, experiment, env, device, run_dir).go()


def run_memory(cfg: DictConfig, world_size: int, device: torch.device) -> dict[str, int]:
    """Bytes a process of this run needs at least, by what needs them, before any of it is allocated."""
    data, batch_pixels = cfg.data, cfg.data.batch_size * cfg.data.image_size**2
    with torch.device("meta"):  # the exact parameter count, without memory
        parameters = sum(p.numel() for p in build_model(cfg.model, data, world_size).parameters())
    # fp32 weights and gradients, and AdamW's two moments (shared out under a sharded optimizer: at least 1/N each)
    model = parameters * (8 + 8 // world_size)
    return {
        "the loader's ring of batch slots": default_slots(resolve_workers(data.num_workers)) * batch_pixels,
        "the model with its gradients and optimizer state": model,
        "the activations of a batch": data.batch_size * activations_per_image(cfg, device),
        "the held-out images": cfg.train.eval_batches * world_size * batch_pixels,
    }


def activations_per_image(cfg: DictConfig, device: torch.device) -> int:
    """Bytes of an image's activations that the forward keeps for the backward, at least: the float input, each
    conv block's output, its pooled output, the pool's int64 indices and the ReLU's output (a fused block keeps its
    pooled output only, a block under train.fused_pool its pooled output and a byte per pooled value), and the
    head's hidden layer; more is allocated on the way."""
    size = 2 if cfg.autocast else 4  # bf16 under autocast
    cuda = device.type == "cuda"
    fused, fused_pool = (cfg.train.fused_blocks, cfg.train.fused_pool) if cuda else (0, False)
    side, total = cfg.data.image_size, cfg.data.image_size**2 * 4
    for block, channels in enumerate(cfg.model.channels):
        pooled = channels * (side // 2) ** 2
        if block < fused:
            total += pooled * size
        elif fused_pool:
            total += pooled * (size + 1)
        else:
            total += channels * side**2 * size + pooled * (2 * size + 8)
        side //= 2
    return total + cfg.model.hidden * 2 * size + cfg.data.max_boxes * 4 * 4


def check_run_memory(cfg: DictConfig, world_size: int, device: torch.device) -> None:
    """Refuse, in one line with the figures, a run that cannot fit in the host's (and the GPU's) memory."""
    need = run_memory(cfg, world_size, device)
    hint = "lower data.batch_size, data.image_size, train.eval_batches or the model's size"
    ring, held_out = "the loader's ring of batch slots", "the held-out images"
    host = need if device.type != "cuda" else {ring: need[ring]}  # on a GPU the rest lives on the device
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the processes of this host share its memory
    # every process has its ring, model and activations; the main process alone holds the held-out images
    total = sum(size * (1 if what == held_out else processes) for what, size in host.items())
    each = f" each of {processes} processes:" if processes > 1 else ""
    parts = ", ".join(f"{what} {size / GIB:.1f} GiB" for what, size in host.items())
    check_memory("this run needs at least", total, hint, f" ({each}{parts})")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        on_device = {what: size for what, size in need.items() if what != ring}
        if sum(on_device.values()) > free:
            parts = ", ".join(f"{what} {size / GIB:.1f} GiB" for what, size in on_device.items())
            raise MemoryRefusal(
                f"this run needs at least {sum(on_device.values()) / GIB:.1f} GiB on {device} ({parts}), but it "
                f"has {free / GIB:.1f} GiB free: {hint}"
            )


class DeferredInterrupt:
    """Ctrl-C (SIGINT) within the loop: the first stops the run at the next step's start (``check``), a second at
    once. A KeyboardInterrupt raised anywhere could land inside a library's bookkeeping, as TensorBoard's
    writer handing a scalar to its thread (``Queue.put``): that thread then never woke, and closing the writer
    waited for it for good. On the main thread only (Python delivers signals there)."""

    def __enter__(self):
        self.requested, self.previous = False, None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class Run:
    """A training run's state and its phases, each a short method; ``go`` reads straight down."""

    def __init__(self, cfg: DictConfig, experiment: str, env: DistEnv, device: torch.device, run_dir: Path):
        self.cfg, self.tcfg, self.experiment, self.env, self.device = cfg, cfg.train, experiment, env, device
        self.run_dir, self.checkpoint_path = run_dir, run_dir / "checkpoint.pt"
        self.say = print if env.is_main else (lambda *args, **kwargs: None)
        self.global_batch = cfg.data.batch_size * env.world_size
        self.expected = fingerprint(cfg, env.world_size)
        self.writer = None  # TensorBoard's, on the main process, once the loop starts

    def go(self) -> dict:
        tcfg = self.tcfg
        self.step_fn = TrainStep(self.cfg, self.device, self.env.world_size)
        # rank 0 evaluates; under FSDP2 every rank runs the forward with it, since each forward gathers the shards
        self.evaluates = self.env.is_main or bool(self.step_fn.shard and self.step_fn.shard.collective_forward)
        saved = self.resume()
        self.step, self.resumed_at, self.evals = saved["step"], saved["step"], saved["evals"]
        self.log = Log(self.device, saved["losses"])
        self.checkpoint_step = self.eval_step = saved["step"] if saved["step"] else -1
        if self.step >= tcfg.steps:
            self.say(f"{self.run_dir} is complete ({self.step} steps): nothing to resume")
            return self.finish_complete()
        if self.env.is_main:
            if not self.resumed_at:  # a fresh run: an earlier one in the folder is kept, visibly
                folders.set_aside(self.run_dir, self.say)
            OmegaConf.save(self.cfg, self.run_dir / "config.yaml")
        try:
            self.loop()
        except (DataWorkerDied, KeyboardInterrupt) as err:  # one line: what stopped the run, and how to go on
            raise type(err)(self.stopped(err)) from None
        finally:
            if self.writer:
                self.writer.close()  # the scalars so far; a resume purges those past its checkpoint
        return self.finish()

    def stopped(self, err: BaseException) -> str:
        """``err``'s message, then where the run stopped and what to continue it from."""
        kept = "no checkpoint was written (train.checkpoint_every)"
        if self.checkpoint_step > 0:
            kept = f"its last checkpoint is step {self.checkpoint_step} in {self.checkpoint_path}: continue with "
            kept += "train.resume=true"
        return "; ".join(filter(None, [str(err), f"the run stopped after step {self.step}", kept]))

    def resume(self) -> dict:
        """The checkpoint's saved state (model, optimizer, ... restored), or a fresh start's."""
        if self.tcfg.resume and shared_checkpoint(self.checkpoint_path, self.env.world_size):
            state = load_checkpoint(self.checkpoint_path, self.step_fn, self.expected, self.global_batch)
            self.say(f"resuming {self.run_dir} at step {state['step']}")
            return state
        if self.tcfg.resume:
            self.say(f"train.resume=true but {self.checkpoint_path} does not exist: starting from step 0")
        return {"step": 0, "losses": [], "evals": []}

    def loop(self) -> None:
        tcfg, cfg, env = self.tcfg, self.cfg, self.env
        layout = self.step_fn.strategy.layout
        start, steps = self.step * self.global_batch, tcfg.steps - self.step
        loader = rank_loader(cfg.data, layout, self.device, env.rank, env.world_size, start, steps)
        self.eval_set = self.held_out_set() if self.evaluates else []
        self.writer = (
            SummaryWriter(str(self.run_dir), purge_step=self.step + 1 if self.step else None) if env.is_main else None
        )
        profiling = tcfg.profile and env.is_main
        profiler = (
            make_profiler(cfg.profile, self.run_dir / "profile", self.device, tcfg.strategy) if profiling else None
        )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.announce()
        self.run_start = time.perf_counter()
        batches = iter(loader)
        with profiler or contextlib.nullcontext(), DeferredInterrupt() as interrupt:
            while self.step < tcfg.steps:
                interrupt.check()
                index = self.step - self.resumed_at  # this process's step count: the profiler window
                self.step_fn.regions.active = profiling and index >= cfg.profile.wait
                started = time.perf_counter()
                batch = next(batches)
                data_seconds = time.perf_counter() - started
                self.log.clock.start()
                loss = self.step_fn(batch)
                self.log.clock.stop()
                self.log.add(loss, data_seconds)
                self.step += 1
                if profiler:
                    profiler.step()
                if self.after_step():
                    break
        self.step_fn.wait_weights()  # the last update's all-gather, before anything reads the weights
        del batches

    def held_out_set(self) -> list:
        """eval_batches global batches from train.eval_start: the same images whatever the number of processes."""
        length = self.tcfg.eval_batches * self.global_batch
        return list(build_loader(self.cfg.data, "padded", self.device, start=self.tcfg.eval_start, length=length))

    def announce(self) -> None:
        tcfg, cfg = self.tcfg, self.cfg
        parameters = sum(p.numel() for p in self.step_fn.model.parameters())
        self.say(
            f"training {self.run_dir.name} ({self.step_fn.strategy.description}) on {device_name(self.device)} "
            f"x {self.env.world_size}: steps {self.step + 1}-{tcfg.steps}, batch {cfg.data.batch_size} x "
            f"{self.env.world_size} of {cfg.data.image_size}px, {parameters:,} parameters, "
            f"autocast {'bf16' if cfg.autocast else 'off'}"
            + (f", {self.step_fn.shard.description}" if self.step_fn.shard else "")
        )

    def after_step(self) -> bool:
        """Log, evaluate and checkpoint when due; True when the run stops here (train.stop_after)."""
        tcfg, step = self.tcfg, self.step
        last = step == tcfg.steps or step == tcfg.stop_after
        log_due = step % tcfg.log_every == 0 or last
        eval_due = self.evaluates and (step % tcfg.eval_every == 0 or last)
        # every rank: a sharded optimizer's state is gathered to rank 0, which writes the file
        checkpoint_due = (
            tcfg.checkpoint_every and (step % tcfg.checkpoint_every == 0 or step == tcfg.steps)
        ) or step == tcfg.stop_after
        if log_due or eval_due or checkpoint_due:
            self.check_finite(self.log.flush(step))
        if log_due:
            self.log_line()
        if eval_due:
            self.evaluate()
        if checkpoint_due:
            self.save()
        if step == tcfg.stop_after:
            self.say(f"stopping after step {step} (train.stop_after); continue with train.resume=true")
        return step == tcfg.stop_after

    def check_finite(self, bad_steps: list[int]) -> None:
        if not bad_steps:
            return
        if self.tcfg.nonfinite == "skip":
            self.say(f"skipped the update of step(s) {bad_steps}: non-finite loss (train.nonfinite=skip)")
            return
        kept = f"the last good checkpoint is step {self.checkpoint_step} in {self.checkpoint_path}"
        if self.checkpoint_step < 1:
            kept = "no checkpoint was written"
        raise NonFiniteLoss(
            f"the loss is not finite at step {bad_steps[0]} (lr {self.step_fn.scheduler.get_last_lr()[0]:.2e}): "
            f"stopped; {kept}. Lower train.lr, or set train.nonfinite=skip to skip such steps"
        )

    def log_line(self) -> None:
        tcfg, step, log = self.tcfg, self.step, self.log
        loss = log.window_mean(step, tcfg.log_every)
        recent = [t for t in log.timings if t["step"] > step - tcfg.log_every]  # this window's steps
        rate = throughput(recent, self.global_batch, skip_until=0)
        eta = (time.perf_counter() - self.run_start) / (step - self.resumed_at) * (tcfg.steps - step)
        lr = self.step_fn.scheduler.get_last_lr()[0]
        self.say(
            f"step {step:6d}/{tcfg.steps}  loss {loss:.4f}  lr {float(lr):.2e}  step {rate['step_ms']:8.1f} ms "
            f"(device {rate['device_step_ms']:.1f}, idle {rate['device_idle_ms']:.1f}; host data wait "
            f"{rate['data_wait_ms']:.1f})  "
            f"{rate['images_per_s']:9.0f} img/s  eta {format_eta(eta)}",
            flush=True,
        )
        if self.writer:
            scalars = {"train/loss": loss, "train/lr": float(lr), "time/step_ms": rate["step_ms"]}
            scalars |= {"time/device_step_ms": rate["device_step_ms"], "time/data_wait_ms": rate["data_wait_ms"]}
            scalars |= {"time/device_idle_ms": rate["device_idle_ms"]}
            scalars |= {"time/images_per_s": rate["images_per_s"]}
            if self.device.type == "cuda":
                scalars["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def evaluate(self) -> None:
        metrics = evaluate(self.step_fn.model, self.eval_set, self.device, self.step_fn.autocast)
        self.evals.append((self.step, metrics))
        self.eval_step = self.step
        self.say(
            f"eval   {self.step:6d}  mean IoU {metrics['mean_iou']:.3f}  recall@0.5 {metrics['recall50']:.3f}  "
            f"(mean box: {metrics['trivial_mean_iou']:.3f}, {metrics['trivial_recall50']:.3f})  "
            f"loss {metrics['loss']:.4f}  on {metrics['boxes']} boxes",
            flush=True,
        )
        for name, value in metrics.items():
            if name != "boxes" and self.writer:
                self.writer.add_scalar(f"eval/{name}", value, self.step)

    def save(self) -> None:
        """Write the checkpoint (rank 0); every rank calls it, to send its share of a sharded optimizer."""
        step_fn = self.step_fn
        step_fn.wait_weights()
        model, optimizer = step_fn.model_state(), step_fn.optimizer_state()  # every rank: shards onto rank 0
        if not self.env.is_main:
            return
        model, optimizer = one_linear(step_fn.model, model, optimizer)  # any number of processes resumes it
        state = {
            "layout": LAYOUT,
            "step": self.step,
            "model": model,
            "optimizer": optimizer,
            "scheduler": step_fn.scheduler.state_dict(),
            "rng": rng_state(),
            "data": {"next_index": self.step * self.global_batch, "global_batch": self.global_batch},
            "losses": self.log.losses,
            "evals": self.evals,
            "fingerprint": self.expected,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }
        save_checkpoint(self.checkpoint_path, state)
        self.checkpoint_step = self.step

    def summary(self) -> dict:
        step, log = self.step, self.log
        return {
            "experiment": self.experiment,
            "run": self.run_dir.name,
            "strategy": self.step_fn.strategy.name,
            "device": device_name(self.device),
            "world_size": self.env.world_size,
            "global_batch": self.global_batch,
            "steps": step,
            "resumed_at": self.resumed_at,
            "final_loss": log.window_mean(step, self.tcfg.log_every) if log.losses else math.nan,
            "eval": self.evals[-1][1] if self.evals else {},
            **throughput(log.timings, self.global_batch, skip_until=self.resumed_at + TIMING_SKIP),
            "peak_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30
            if self.device.type == "cuda"
            else None,
            "history": log.history(self.tcfg.log_every, step),
            "losses": log.losses,  # every step's, read at log lines: per-step comparisons need no train.log_every=1
            "evals": self.evals,
            "checkpoint_step": self.checkpoint_step,
            "eval_step": self.eval_step,
        }

    def finish(self) -> dict:
        summary = self.summary()
        if self.env.is_main:
            write_atomically(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            self.writer.close()
            if self.tcfg.profile:
                self.say(f"profiler window: trace in {self.run_dir / 'profile'}/ (make compare / make tensorboard)")
            self.say(
                f"done: {self.run_dir}  final loss {summary['final_loss']:.4f}  median step "
                f"{summary['step_ms']:.1f} ms  {summary['images_per_s']:.0f} img/s by the wall clock "
                f"({summary['device_images_per_s']:.0f} by device time; device idle between steps "
                f"{summary['device_idle_ms']:.1f} ms)"
            )
        return summary

    def finish_complete(self) -> dict:
        """A complete run: its summary, rebuilt from the checkpoint if a kill came before it was written."""
        path = self.run_dir / "summary.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # missing (killed before it), or written by a version without atomic writes
            pass
        summary = self.summary()
        if self.env.is_main:
            write_atomically(path, json.dumps(summary, indent=2))
            self.say(f"wrote the missing {path} from the checkpoint")
        return summary


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, whenever the process is stopped (Ctrl-C, kill)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- experiments and sweeps


@contextlib.contextmanager
def training_processes(cfg: DictConfig):
    """(this process's DistEnv, its device) for the runs inside the block; the process group is torn down after."""
    env, device = distributed.setup(cfg)
    try:
        yield env, device
    finally:
        distributed.teardown(env)


def experiment_name(experiment: str | None) -> str:
    """The run folder's experiment: the YAML file's stem, ``default`` without one."""
    return Path(experiment).stem if experiment else "default"


def run_training(cfg: DictConfig, experiment: str | None = None) -> list[dict]:
    """`python -m detector train`: one run of ``train.strategy``; returns [its summary]. ``train.strategy=all`` is
    the strategy sweep (detector/lab/sweep.py)."""
    if cfg.train.strategy == "all":
        raise UserError("train.strategy=all is the strategy sweep: run it with `python -m detector train` (make train)")
    with training_processes(cfg) as (env, device):
        return [train(cfg, experiment_name(experiment), env, device)]
