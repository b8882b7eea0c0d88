"""A training run of the detector with one GIoU loss strategy (`make train EXPERIMENT=<name>`), from its start-up to
its summary; entry.py enters it (the processes, the run folder's lock).

``Run.go`` reads top to bottom: the step (detector/train/run/step.py, the same step that `make profile` times), the
checkpoint to resume from, the run folder, the loop over the data (``Steps``), the summary. A run writes to
``runs/train/<experiment>/<run>/`` with run = ``<strategy>[+compile][+cuda_graphs][+float8]``, whatever the number
of processes (a run resumes on another number of them, with the same global batch); ``auto[+...]`` for
train.strategy=auto, which chooses its strategy before the first step (auto.py) and is a run of it from there on:

    config.yaml       the merged configuration
    events.out.*      TensorBoard scalars: train/, eval/, time/, memory/, goodput/
    checkpoint.json   the last checkpoint's manifest: model, optimizer, schedule, step, RNG states, data position,
    checkpoint-*/     the loss of every step and the evaluations so far, written by every process in the background
                      and committed atomically, checksummed (checkpoints/state.py, checkpoints/files.py,
                      checkpoints/writer.py)
    summary.json      final loss and metrics, step times, images/s, the loss curve, where the wall clock went
    strategy-auto.json  train.strategy=auto's choice: the candidates' times and memory, the rule (choice.py)
    profile/          with train.profile=true: one torch.profiler window, regions as in `make profile`

Its parts, by package of detector/train: here in run/, the run folder and its lock (folder.py), the data it reads
(rank_data.py), Ctrl-C and SIGTERM (interrupt.py); the checkpoints behind one door (checkpoints/manager.py: which steps
save, a stop's save, the resume, the last checkpoint); what the run allocates, the step's losses and times and the log
line, where the wall clock went and the summary (observe/); the evaluations (evaluate/). This module holds the run and
its loop.

Guarantees:
- Resuming gives the weights, the logged curve and the summary of an uninterrupted run (the loss of
  every step is kept in the checkpoint; log lines fall on multiples of train.log_every).
- A non-finite loss stops the run at the next log line, naming the first bad step, with the last
  good checkpoint kept (train.nonfinite=skip skips such steps' updates instead).
- One process per run folder (a lock, removed at the end); a fresh run moves the folder's earlier run to a
  visible sibling ``<run>-<its start time>/`` and says so (run/folder.py): a re-run never destroys results.
- What cannot fit is refused before it is allocated, in one line with the figures (observe/memory_estimate.py).
- A checkpoint stops the step only while its state is copied to host memory; it is written in the background,
  every process its own part, and logged with its times against the disk's.
- A data worker that dies, raises or delivers nothing for data.worker_timeout seconds stops the run in one
  line naming the last checkpoint, which stays intact. Ctrl-C and SIGTERM stop every process at the same step,
  with a checkpoint of the steps so far (with train.checkpoint_every > 0), in one line; a process that dies stops
  the others at their next step (``PeerLost``).
- Throughput is reported by the wall clock (data waits included); on a GPU with the device time beside it
  and the device's idle time between steps: the part of the host's waits (data, Python) that reached the GPU.

Multi-GPU: under torchrun each rank reads its own block of every global batch and the loss is the
global mean over valid boxes (detector/train/distributed/processes.py); rank 0 (the global one, on several nodes)
evaluates, logs and commits checkpoints (under train.shard_optimizer=fsdp2 every rank takes part in the
evaluation's forward). Every rank writes its own part of a checkpoint, in one process's layout, whatever the
setting or number of processes that resumes it (detector/train/checkpoints/state.py).
"""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from detector.checked import RecordError
from detector.config.device import device_name
from detector.data.loader import DataWorkerDied
from detector.errors import ENVIRONMENT, PeerLost, UserError, said
from detector.train import choice
from detector.train.checkpoints import Verification
from detector.train.checkpoints.manager import RunCheckpoints
from detector.train.distributed import processes as distributed
from detector.train.distributed.processes import Control, DistEnv
from detector.train.evaluate.evaluation import Evaluation
from detector.train.observe import summary
from detector.train.observe.board import Board
from detector.train.observe.profile_window import make_profiler
from detector.train.observe.progress import TIMING_SKIP, Log, throughput
from detector.train.observe.wallclock import FullCollections, WallClock
from detector.train.run import folder as run_folder
from detector.train.run.auto import AUTO, Rank, choose, with_strategy
from detector.train.run.interrupt import DeferredInterrupt, Handlers
from detector.train.run.rank_data import training_batches
from detector.train.run.speed_options import (
    COMPILING,
    compile_cache_file,
    compile_caches,
    load_compile_cache,
    save_compile_cache,
)
from detector.train.run.step import TrainStep


class NonFiniteLoss(UserError):
    pass


class FilesRefused(UserError):
    """A write of the run that the machine's files refused (a full disk, a folder made read-only): its OSError, where
    the run stopped and the checkpoint it continues from, in one line."""


class Run:
    """A training run: its folder, its step function, where it resumes and how it ends; ``go`` reads straight
    down. Its progress through the steps is ``Steps``'s."""

    def __init__(
        self,
        cfg: DictConfig,
        experiment: str,
        env: DistEnv,
        device: torch.device,
        run_dir: Path,
        checks: Verification | None = None,
        rank: Rank | None = None,
    ):
        self.cfg, self.tcfg, self.experiment, self.env, self.device = cfg, cfg.train, experiment, env, device
        self.run_dir, self.checks = run_dir, checks
        self.say = print if env.is_main else (lambda *args, **kwargs: None)
        self.global_batch = cfg.data.batch_size * env.world_size
        self.wall = WallClock()
        self.rank, self.choice = rank, None  # train.strategy=auto's ranking (the command's) and choice

    def go(self) -> summary.TrainingSummary:
        wall = self.wall
        with wall.startup("control group"):
            self.control = Control(self.env)
        if self.tcfg.strategy == AUTO:
            with wall.startup("strategy auto"):
                self.choose_strategy()
        with wall.startup("model and optimizer"):
            self.step_fn = TrainStep(self.cfg, self.device, self.env.world_size)
        # rank 0 evaluates; under FSDP2 every rank runs the forward with it, since each forward gathers the shards
        evaluates = self.env.is_main or bool(self.step_fn.shard and self.step_fn.shard.collective_forward)
        self.checkpoints = RunCheckpoints(self)
        with wall.startup("resume"):
            saved = self.checkpoints.resume()
        complete = saved["step"] >= self.tcfg.steps
        if complete:
            self.say(f"{self.run_dir} is complete ({saved['step']} steps): nothing to resume")
        elif self.env.is_main:
            with wall.startup("run folder"):
                run_folder.start(self.run_dir, self.cfg, fresh=not saved["step"], say=self.say)
                if self.choice is not None and self.choice.source != "resumed":
                    self.choice.write(self.run_dir / choice.RUN_FILE)
        self.steps = Steps(self, saved, evaluates and not complete)
        if complete:
            return self.finish_complete()
        try:
            self.run_steps()
            result = self.finish()
        except BaseException:
            self.close(failed=True)
            raise
        self.close(failed=False)
        return result

    def choose_strategy(self) -> None:
        """train.strategy=auto: the strategy the run trains with (auto.py), said in one line; from here on the run is
        a run of that strategy (its checkpoint's fingerprint holds it: a resume continues with it), in its own
        folder."""
        self.choice = choose(self.cfg, self.device, self.env, self.control, self.run_dir, self.rank, self.say)
        self.say(self.choice.line(), flush=True)
        self.cfg = with_strategy(self.cfg, self.choice.strategy)
        self.tcfg = self.cfg.train

    def run_steps(self) -> None:
        """The loop, a signal only asking for a stop between two steps (``DeferredInterrupt``); whatever it raises
        leaves as the run's ending (``ending``)."""
        try:
            with DeferredInterrupt() as interrupt:
                self.steps.loop(interrupt)
        except BaseException as err:
            ending = self.ending(err)
            if ending is err:
                raise
            raise ending from err.__cause__ or err  # --debug: the cause
        finally:
            self.wall.stop_loop()

    def close(self, failed: bool) -> None:
        """However the loop ended: the control group, the held-out set's workers, TensorBoard's writer. Its writer's
        failure (its thread's, a full disk) never hides the line of a run that ``failed``; after a complete run it is
        the line."""
        self.control.close()
        self.steps.evaluation.end()  # its last picture, before the writer closes
        try:
            self.steps.board.close()  # the scalars so far; a resume purges those past its checkpoint
        except Exception as err:
            if failed:  # the same full disk, mostly: the run's line is the one (--debug: the writer's traceback)
                return
            if not (isinstance(err, OSError) and err.errno in ENVIRONMENT):
                raise
            where = f"TensorBoard's event file in {self.run_dir} could not be written ({said(err)})"
            raise FilesRefused(f"{where}; the run itself completed: {self.run_dir / summary.SUMMARY}") from err

    def ending(self, err: BaseException) -> BaseException:
        """What a run ends with when its loop raised ``err``, its checkpoints seen to:

        - a stop every process agreed on (Ctrl-C, SIGTERM): the save under way and the stop's own are written; one
          line saying where it stopped and what continues it (``agreed``: every process ends at this step);
        - a second signal, a lost process, a dead data worker: the same line; the save under way is abandoned where
          waiting for it could hang (a second signal, a lost process), so the line names what the manifest does;
        - a step's collective whose peer is gone: that process's loss (``PeerLost``);
        - a write the machine's files refused (TensorBoard's event file on a full disk or in a folder made
          read-only): the same line, after the save under way (``FilesRefused``);
        - anything else (a non-finite loss, a user's error, a bug): itself, after the save under way is committed, so
          that the last good checkpoint it names is on disk.
        """
        if self.env.world_size > 1 and isinstance(err, RuntimeError) and not isinstance(err, UserError):
            lost = distributed.lost_peer(err)
            if lost is not None:
                err = lost
        if not isinstance(err, (DataWorkerDied, KeyboardInterrupt, PeerLost)):
            if isinstance(err, OSError) and err.errno in ENVIRONMENT:
                # a refused write, TensorBoard's mostly: its writer raises the same error at every later write, which
                # the saves' times (logged as the save under way finishes) would raise in place of the run's line
                self.steps.board.refuse()
            self.steps.checkpoints.close(wait=True)
            if isinstance(err, OSError) and err.errno in ENVIRONMENT:  # TensorBoard's event file, a full disk
                what = said(err)
                if err.filename is None and from_tensorboard(err):  # its thread's failure, raised again here
                    what = f"TensorBoard's event file in {self.run_dir} could not be written ({what})"
                return FilesRefused(self.stopped(what, wait=True))
            return err
        agreed = isinstance(err, KeyboardInterrupt) and self.steps.stopping
        Handlers.stopping |= isinstance(err, PeerLost)  # torchrun's SIGTERM follows: nothing after our line
        stopped = type(err)(self.stopped(said(err), wait=agreed or isinstance(err, DataWorkerDied)))
        stopped.agreed = agreed
        return stopped

    def stopped(self, what: str, wait: bool) -> str:
        """``what`` stopped the run, then where it stopped and what to continue it from."""
        checkpoints = self.steps.checkpoints
        checkpoints.close(wait=wait)
        return "; ".join(filter(None, [what, f"the run stopped after step {self.steps.step}", checkpoints.kept()]))

    def finish(self) -> summary.TrainingSummary:
        with self.wall.part("checkpoints"):
            self.steps.checkpoints.close(wait=True)  # the final checkpoint, committed before the summary says so
        result = summarise(self)
        if self.env.is_main:
            result.write(self.run_dir / summary.SUMMARY)
            if self.tcfg.profile:
                self.say(f"profiler window: trace in {self.run_dir / 'profile'}/ (make compare / make tensorboard)")
            self.say(summary.done_line(self.run_dir, result, self.device))
        return result

    def finish_complete(self) -> summary.TrainingSummary:
        """A complete run: its summary, rebuilt from the checkpoint if a kill came before it was written."""
        path = self.run_dir / summary.SUMMARY
        try:
            return summary.read(path)
        except RecordError:  # missing (killed before it), or not one this version reads
            result = summarise(self)
        if self.env.is_main:
            result.write(path)
            self.say(f"wrote the missing {path} from the checkpoint")
        return result


class Steps:
    """A run's progress through its steps: the loop, and between two steps the log line, the evaluation and the
    checkpoint when due. It holds the step, every step's loss and time (``Log``) and the evaluations, all restored on
    resume, and the run's checkpoints (``RunCheckpoints``: which steps save, the last checkpoint)."""

    def __init__(self, run: Run, saved: dict, evaluates: bool):
        self.run, self.cfg, self.tcfg, self.say = run, run.cfg, run.tcfg, run.say
        self.step = self.resumed_at = saved["step"]
        self.log = Log(run.device, saved["losses"])
        with run.wall.startup("held-out set"):
            self.evaluation = Evaluation(run.cfg, run.device, run.global_batch, saved["evals"], evaluates, self.step)
        self.board = Board()  # TensorBoard's: process 0's writes, once the loop starts
        self.checkpoints = run.checkpoints
        self.stopping = False  # a stop that every process agreed on is under way

    def loop(self, interrupt: DeferredInterrupt) -> None:
        tcfg, cfg, run, wall = self.tcfg, self.cfg, self.run, self.run.wall
        # closed as the loop ends, however it ends: the workers stop before the run's last line
        with contextlib.closing(self.start_loader()) as batches:
            if run.env.is_main:
                with wall.startup("TensorBoard"):
                    self.board = Board(run.run_dir, purge_step=self.step + 1 if self.step else None)
                if run.choice is not None:
                    self.board.text("strategy auto", run.choice.table(), self.step)
            self.checkpoints.start(self.board)
            profiling = tcfg.profile and run.env.is_main
            profile_dir = run.run_dir / "profile"
            profiler = make_profiler(cfg.profile, profile_dir, run.device, tcfg.strategy) if profiling else None
            if run.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(run.device)
            with wall.startup("compile cache"):
                self.compile_cache = compile_cache_file(cfg, run.device, run.env.world_size)
                loaded = load_compile_cache(self.compile_cache)
            self.say(announcement(run, self.step))
            if loaded:
                self.say(f"compile cache {self.compile_cache}: {loaded}")
            wall.start_loop()
            self.say(wall.startup_line() + self.checkpoints.note())
            with profiler or contextlib.nullcontext(), FullCollections(lambda: self.step) as collections:
                try:
                    self.steps_loop(batches, interrupt, profiler, profiling)
                finally:
                    gc.unfreeze()  # a later run in this process (the sweep's) collects this one's objects
            if collections.line():
                self.say(collections.line())
        run.step_fn.wait_weights()  # the last update's all-gather, before anything reads the weights

    def start_loader(self):
        """The training batches from where the run stands, their workers started now: they draw the first batches
        while the rest of the start-up runs; the held-out set's workers with them."""
        run = self.run
        with run.wall.startup("loader"):
            loader = training_batches(self.cfg, run.step_fn.strategy.layout, run.device, run.env, self.step)
            batches = iter(loader)
            batches.started()
            if self.evaluation.held_out is not None:
                # its workers forked now too, before the run starts threads of its own (TensorBoard's writer, the
                # checkpoints'), which a fork copies mid-lock; they draw while the start-up and the steps run
                self.evaluation.held_out.start()
                if run.env.is_main:  # the process that writes TensorBoard draws the pictures: forked with them
                    self.evaluation.start_painter()
        return batches

    def steps_loop(self, batches, interrupt: DeferredInterrupt, profiler, profiling: bool) -> None:
        tcfg, cfg, run = self.tcfg, self.cfg, self.run
        while self.step < tcfg.steps:
            if run.control.stop_vote(interrupt.requested is not None):
                self.stopping = True
                interrupt.requested = interrupt.requested or signal.SIGTERM  # asked of another process
                self.save_before_stop()
                raise interrupt.stop()
            index = self.step - self.resumed_at  # this process's step count: the profiler window
            run.step_fn.regions.active = profiling and index >= cfg.profile.wait
            with run.wall.part("data"):
                started = time.perf_counter()
                batch = next(batches)
                data_seconds = time.perf_counter() - started
            run.wall.waited_for_data(data_seconds)
            first = index == 0
            compiling = first and (tcfg.compile or run.device.type == "cuda")
            if compiling:
                self.say(f"compiling: step {self.step + 1} waits for {COMPILING} ({compile_caches()})", flush=True)
            step_started = time.perf_counter()
            self.log.clock.start()
            loss = run.step_fn(batch)
            self.log.clock.stop()
            if first:  # compilation and the first launches: waited for, so that the first step is all of it
                loss.item()
                self.log.first_done = time.perf_counter()
                took = self.log.first_done - step_started
                run.wall.add("first step", took)
                if compiling:
                    self.say(f"compiled: step {self.step + 1} took {took:.1f} s", flush=True)
                    if run.env.is_main:
                        save_compile_cache(self.compile_cache)
                # what the start-up and the first step made lives as long as the run: the collector no longer walks
                # it, which made a full collection among the steps a pause of a fraction of a second (wallclock.py)
                gc.freeze()
            self.log.add(loss, data_seconds)
            self.step += 1
            if profiler:
                profiler.step()
            self.checkpoints.poll()
            if self.after_step():
                break

    def save_before_stop(self) -> None:
        """Before a stop that Ctrl-C or SIGTERM asked for: a checkpoint of the steps so far, where the settings and
        the time allow (``RunCheckpoints.stop_saves``), its losses checked first."""
        if self.checkpoints.stop_saves(self.step):
            self.check_finite(self.log.flush(self.step))
            self.checkpoints.save(self.step, self.log.losses, self.evaluation.evals, alone=True)
            self.checkpoints.close(wait=True)

    def after_step(self) -> bool:
        """Log, evaluate and checkpoint when due; True when the run stops here (train.stop_after)."""
        tcfg, step, step_fn, wall = self.tcfg, self.step, self.run.step_fn, self.run.wall
        last = step == tcfg.steps or step == tcfg.stop_after
        log_due = step % tcfg.log_every == 0 or last
        eval_due = self.evaluation.active and (step % tcfg.eval_every == 0 or last)
        checkpoint_due = self.checkpoints.due(step)
        # the first step's losses and time read at once (the host waited for it already): its window is its own, and
        # the first log line's step time is the steps' after it, not the compilation's share of the window
        first = step == self.resumed_at + 1
        self.evaluation.watch(self.say)  # a few system calls: a held-out worker's death is said within a step
        if log_due or eval_due or checkpoint_due or first:
            # a user's backward first (read where the host waits anyway): its NaN gradient makes the next losses NaN
            step_fn.strategy.nonfinite_gradient()
            self.check_finite(self.log.flush(step))
        if log_due:
            self.log_line()
            self.checkpoints.decide_cadence(self.log)
        started = time.perf_counter()
        if eval_due:
            with wall.part("evaluations"):
                self.evaluation(step, step_fn.model, step_fn.autocast, self.board, self.say)
        if checkpoint_due:
            self.checkpoints.save(step, self.log.losses, self.evaluation.evals)
        self.log.exclude(time.perf_counter() - started)  # the steps' times are the steps' alone
        if step == tcfg.stop_after:
            self.checkpoints.close(wait=True)
            self.say(f"stopping after step {step} (train.stop_after); continue with train.resume=true")
        return step == tcfg.stop_after

    def check_finite(self, bad_steps: list[int]) -> None:
        if not bad_steps:
            return
        if self.tcfg.nonfinite == "skip":
            self.say(f"skipped the update of step(s) {bad_steps}: non-finite loss (train.nonfinite=skip)")
            return
        self.checkpoints.close(wait=True)
        raise NonFiniteLoss(
            f"the loss is not finite at step {bad_steps[0]} (lr {self.run.step_fn.scheduler.get_last_lr()[0]:.2e}): "
            f"stopped; {self.checkpoints.last_good()}. Lower train.lr, or set train.nonfinite=skip to skip such steps"
        )

    def log_line(self) -> None:
        lr = float(self.run.step_fn.scheduler.get_last_lr()[0])
        tcfg = self.tcfg
        line, scalars = self.log.line(self.step, tcfg.steps, tcfg.log_every, self.resumed_at, lr, self.run.global_batch)
        self.say(line, flush=True)
        self.board.scalars(scalars, self.step)


def from_tensorboard(err: BaseException) -> bool:
    """Whether ``err`` was raised in TensorBoard's writer: its thread's exception, which the writer raises again at
    the loop's next write, holds the thread's frames."""
    frames = err.__traceback__
    while frames is not None:
        if "tensorboard" in frames.tb_frame.f_code.co_filename:
            return True
        frames = frames.tb_next
    return False


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


def summarise(run: Run) -> summary.TrainingSummary:
    """The run's summary (summary.py): what it trained, its losses and times, evaluations, wall clock, checkpoints."""
    steps, device = run.steps, run.device
    step, log, evals = steps.step, steps.log, steps.evaluation.evals
    wall = run.wall.account(steps.checkpoints.written_seconds(), images=(step - steps.resumed_at) * run.global_batch)
    wall.add_scalars(steps.board, step)
    return summary.TrainingSummary(
        experiment=run.experiment,
        run=run.run_dir.name,
        strategy=run.step_fn.strategy.name,
        device=device_name(device),
        world_size=run.env.world_size,
        global_batch=run.global_batch,
        steps=step,
        resumed_at=steps.resumed_at,
        final_loss=log.window_mean(step, run.tcfg.log_every) if log.losses else math.nan,
        eval=evals[-1][1] if evals else {},
        **throughput(log.timings, run.global_batch, skip_until=steps.resumed_at + TIMING_SKIP),
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        history=log.history(run.tcfg.log_every, step),
        losses=log.losses,  # every step's, read at log lines: per-step comparisons need no train.log_every=1
        evals=evals,
        checkpoint_step=steps.checkpoints.last_step,
        eval_step=steps.evaluation.step,
        wall_clock=wall,
        checkpoints=steps.checkpoints.record(),
        auto=run.choice,
    )
