"""`make train EXPERIMENT=<name>`: train the detector with one GIoU loss strategy.

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

Its parts, each a module here: the run folder and its lock (folders.py), what the run allocates (memory.py),
the data it reads (batches.py), the step's losses and times and the log line (progress.py), the evaluations
(evaluation.py), Ctrl-C and SIGTERM (interrupt.py), the summary (summary.py); this module holds the loop.

Guarantees:
- Resuming gives the weights, the logged curve and the summary of an uninterrupted run (the loss of
  every step is kept in the checkpoint; log lines fall on multiples of train.log_every).
- A non-finite loss stops the run at the next log line, naming the first bad step, with the last
  good checkpoint kept (train.nonfinite=skip skips such steps' updates instead).
- One process per run folder (a lock, removed at the end); a fresh run moves the folder's earlier run to a
  visible sibling ``<run>-<its start time>/`` and says so (folders.py): a re-run never destroys results.
- What cannot fit is refused before it is allocated, in one line with the figures (memory.py).
- A data worker that dies, raises or delivers nothing for data.worker_timeout seconds stops the run in one
  line naming the last checkpoint, which stays intact. Ctrl-C and SIGTERM stop it between two steps with a
  checkpoint of the steps so far (with train.checkpoint_every > 0, on one process), in one line.
- Throughput is reported by the wall clock (data waits included); on a GPU with the device time beside it
  and the device's idle time between steps: the part of the host's waits (data, Python) that reached the GPU.

Multi-GPU: under torchrun each rank reads its own block of every global batch and the loss is the
global mean over valid boxes (detector/train/distributed.py); rank 0 (the global one, on several nodes)
evaluates, logs and checkpoints (under train.shard_optimizer=fsdp2 every rank takes part in the
evaluation's forward). The other ranks send rank 0 their shares of the state first, so the checkpoint is
one process's, whatever the setting or number of processes that resumes it (detector/train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.tensorboard import SummaryWriter

from detector.config import device_name
from detector.errors import UserError
from detector.loader import DataWorkerDied
from detector.train import distributed, folders, summary
from detector.train.batches import training_batches
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
from detector.train.evaluation import Evaluation
from detector.train.interrupt import DeferredInterrupt
from detector.train.memory import check_run_memory
from detector.train.profile_window import make_profiler
from detector.train.progress import Log, format_eta, log_scalars, step_times, throughput
from detector.train.step import TrainStep


class NonFiniteLoss(UserError):
    pass


def run_name(tcfg) -> str:
    options = [name for name in ("compile", "cuda_graphs", "float8") if tcfg[name]]
    return "+".join([tcfg.strategy, *options])


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


class Run:
    """A training run: its folder, its step function, where it resumes and how it ends; ``go`` reads straight
    down. Its progress through the steps is ``Steps``'s."""

    def __init__(self, cfg: DictConfig, experiment: str, env: DistEnv, device: torch.device, run_dir: Path):
        self.cfg, self.tcfg, self.experiment, self.env, self.device = cfg, cfg.train, experiment, env, device
        self.run_dir, self.checkpoint_path = run_dir, run_dir / "checkpoint.pt"
        self.say = print if env.is_main else (lambda *args, **kwargs: None)
        self.global_batch = cfg.data.batch_size * env.world_size
        self.expected = fingerprint(cfg, env.world_size)

    def go(self) -> dict:
        self.step_fn = TrainStep(self.cfg, self.device, self.env.world_size)
        # rank 0 evaluates; under FSDP2 every rank runs the forward with it, since each forward gathers the shards
        evaluates = self.env.is_main or bool(self.step_fn.shard and self.step_fn.shard.collective_forward)
        saved = self.resume()
        complete = saved["step"] >= self.tcfg.steps
        if complete:
            self.say(f"{self.run_dir} is complete ({saved['step']} steps): nothing to resume")
        elif self.env.is_main:
            folders.start(self.run_dir, self.cfg, fresh=not saved["step"], say=self.say)
        self.steps = Steps(self, saved, evaluates and not complete)
        if complete:
            return self.finish_complete()
        try:
            with DeferredInterrupt() as interrupt:
                self.steps.loop(interrupt)
        except (DataWorkerDied, KeyboardInterrupt) as err:  # one line: what stopped the run, and how to go on
            raise type(err)(self.stopped(err)) from err.__cause__  # the cause: a worker's traceback, for --debug
        finally:
            if self.steps.writer:
                self.steps.writer.close()  # the scalars so far; a resume purges those past its checkpoint
        return self.finish()

    def stopped(self, err: BaseException) -> str:
        """``err``'s message, then where the run stopped and what to continue it from."""
        kept = "no checkpoint was written (train.checkpoint_every)"
        if self.steps.checkpoint_step > 0:
            kept = f"its last checkpoint is step {self.steps.checkpoint_step} in {self.checkpoint_path}: continue "
            kept += "with train.resume=true"
        return "; ".join(filter(None, [str(err), f"the run stopped after step {self.steps.step}", kept]))

    def resume(self) -> dict:
        """The checkpoint's saved state (model, optimizer, ... restored), or a fresh start's."""
        if self.tcfg.resume and shared_checkpoint(self.checkpoint_path, self.env.world_size):
            state = load_checkpoint(self.checkpoint_path, self.step_fn, self.expected, self.global_batch)
            self.say(f"resuming {self.run_dir} at step {state['step']}")
            return state
        if self.tcfg.resume:
            self.say(f"train.resume=true but {self.checkpoint_path} does not exist: starting from step 0")
        return {"step": 0, "losses": [], "evals": []}

    def finish(self) -> dict:
        result = summary.summary(self)
        if self.env.is_main:
            summary.write(self.run_dir / "summary.json", result)
            if self.tcfg.profile:
                self.say(f"profiler window: trace in {self.run_dir / 'profile'}/ (make compare / make tensorboard)")
            self.say(summary.done_line(self.run_dir, result, self.device))
        return result

    def finish_complete(self) -> dict:
        """A complete run: its summary, rebuilt from the checkpoint if a kill came before it was written."""
        path = self.run_dir / "summary.json"
        result = summary.read(path)
        if result is None:
            result = summary.summary(self)
            if self.env.is_main:
                summary.write(path, result)
                self.say(f"wrote the missing {path} from the checkpoint")
        return result


class Steps:
    """A run's progress through its steps: the loop, and between two steps the log line, the evaluation and the
    checkpoint when due. It holds the step, every step's loss and time (``Log``), the evaluations and the last
    checkpoint's step, all restored on resume."""

    def __init__(self, run: Run, saved: dict, evaluates: bool):
        self.run, self.cfg, self.tcfg, self.say = run, run.cfg, run.tcfg, run.say
        self.step = self.resumed_at = saved["step"]
        self.log = Log(run.device, saved["losses"])
        self.checkpoint_step = saved["step"] if saved["step"] else -1
        self.evaluation = Evaluation(
            run.cfg, run.device, run.global_batch, saved["evals"], evaluates, self.checkpoint_step
        )
        self.writer = None  # TensorBoard's, on the main process, once the loop starts

    def loop(self, interrupt: DeferredInterrupt) -> None:
        tcfg, cfg, run = self.tcfg, self.cfg, self.run
        loader = training_batches(cfg, run.step_fn.strategy.layout, run.device, run.env, self.step)
        if run.env.is_main:
            self.writer = SummaryWriter(str(run.run_dir), purge_step=self.step + 1 if self.step else None)
        profiling = tcfg.profile and run.env.is_main
        profiler = make_profiler(cfg.profile, run.run_dir / "profile", run.device, tcfg.strategy) if profiling else None
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)
        self.say(announcement(run, self.step))
        self.start = time.perf_counter()
        # closed as the loop ends, however it ends: the workers stop before the run's last line
        with contextlib.closing(iter(loader)) as batches, profiler or contextlib.nullcontext():
            while self.step < tcfg.steps:
                if interrupt.requested is not None:
                    self.save_before_stop()
                    raise interrupt.stop()
                index = self.step - self.resumed_at  # this process's step count: the profiler window
                run.step_fn.regions.active = profiling and index >= cfg.profile.wait
                started = time.perf_counter()
                batch = next(batches)
                data_seconds = time.perf_counter() - started
                self.log.clock.start()
                loss = run.step_fn(batch)
                self.log.clock.stop()
                self.log.add(loss, data_seconds)
                self.step += 1
                if profiler:
                    profiler.step()
                if self.after_step():
                    break
        run.step_fn.wait_weights()  # the last update's all-gather, before anything reads the weights

    def save_before_stop(self) -> None:
        """A checkpoint of the steps so far, before a stop that Ctrl-C or SIGTERM asked for, where the settings
        allow: checkpoints on (train.checkpoint_every), and one process (several would first have to agree on
        the step to stop at)."""
        if self.tcfg.checkpoint_every and self.run.env.world_size == 1 and self.step > max(self.checkpoint_step, 0):
            self.check_finite(self.log.flush(self.step))
            self.save()

    def after_step(self) -> bool:
        """Log, evaluate and checkpoint when due; True when the run stops here (train.stop_after)."""
        tcfg, step, step_fn = self.tcfg, self.step, self.run.step_fn
        last = step == tcfg.steps or step == tcfg.stop_after
        log_due = step % tcfg.log_every == 0 or last
        eval_due = self.evaluation.active and (step % tcfg.eval_every == 0 or last)
        # every rank: a sharded optimizer's state is gathered to rank 0, which writes the file
        checkpoint_due = (
            tcfg.checkpoint_every and (step % tcfg.checkpoint_every == 0 or step == tcfg.steps)
        ) or step == tcfg.stop_after
        if log_due or eval_due or checkpoint_due:
            self.check_finite(self.log.flush(step))
        if log_due:
            self.log_line()
        if eval_due:
            self.evaluation(step, step_fn.model, step_fn.autocast, self.say, self.writer)
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
        kept = f"the last good checkpoint is step {self.checkpoint_step} in {self.run.checkpoint_path}"
        if self.checkpoint_step < 1:
            kept = "no checkpoint was written"
        raise NonFiniteLoss(
            f"the loss is not finite at step {bad_steps[0]} (lr {self.run.step_fn.scheduler.get_last_lr()[0]:.2e}): "
            f"stopped; {kept}. Lower train.lr, or set train.nonfinite=skip to skip such steps"
        )

    def log_line(self) -> None:
        tcfg, step, log, device = self.tcfg, self.step, self.log, self.run.device
        loss = log.window_mean(step, tcfg.log_every)
        recent = [t for t in log.timings if t["step"] > step - tcfg.log_every]  # this window's steps
        rate = throughput(recent, self.run.global_batch, skip_until=0)
        eta = (time.perf_counter() - self.start) / (step - self.resumed_at) * (tcfg.steps - step)
        lr = float(self.run.step_fn.scheduler.get_last_lr()[0])
        self.say(
            f"step {step:6d}/{tcfg.steps}  loss {loss:.4f}  lr {lr:.2e}  {step_times(rate, device.type == 'cuda')}  "
            f"{rate['images_per_s']:9.0f} img/s  eta {format_eta(eta)}",
            flush=True,
        )
        if self.writer:
            for tag, value in log_scalars(rate, loss, lr, device).items():
                self.writer.add_scalar(tag, value, step)

    def save(self) -> None:
        """Write the checkpoint (rank 0); every rank calls it, to send its share of a sharded optimizer."""
        step_fn = self.run.step_fn
        step_fn.wait_weights()
        model, optimizer = step_fn.model_state(), step_fn.optimizer_state()  # every rank: shards onto rank 0
        if self.run.env.is_main:
            save_checkpoint(
                self.run.checkpoint_path, checkpoint_state(self, *one_linear(step_fn.model, model, optimizer))
            )
            self.checkpoint_step = self.step


def announcement(run: Run, step: int) -> str:
    """The run's first line: what trains, on what, from which step, with which options."""
    cfg, step_fn = run.cfg, run.step_fn
    parameters = sum(p.numel() for p in step_fn.model.parameters())
    return (
        f"training {run.run_dir.name} ({step_fn.strategy.description}) on {device_name(run.device)} "
        f"x {run.env.world_size}: steps {step + 1}-{cfg.train.steps}, batch {cfg.data.batch_size} x "
        f"{run.env.world_size} of {cfg.data.image_size}px, {parameters:,} parameters, "
        f"autocast {'bf16' if cfg.autocast else 'off'}" + (f", {step_fn.shard.description}" if step_fn.shard else "")
    )


def checkpoint_state(steps: Steps, model: dict, optimizer: dict | None) -> dict:
    """What a checkpoint holds: the model and optimizer (as one process's, whatever the number of processes
    that resumes it), the schedule, the step, the RNG states, the data position and the run's record so far."""
    run = steps.run
    return {
        "layout": LAYOUT,
        "step": steps.step,
        "model": model,
        "optimizer": optimizer,
        "scheduler": run.step_fn.scheduler.state_dict(),
        "rng": rng_state(),
        "data": {"next_index": steps.step * run.global_batch, "global_batch": run.global_batch},
        "losses": steps.log.losses,
        "evals": steps.evaluation.evals,
        "fingerprint": run.expected,
        "config": OmegaConf.to_container(run.cfg, resolve=True),
    }


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
