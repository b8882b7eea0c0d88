"""A training run's checkpoints as its loop sees them, behind one door (``RunCheckpoints``): the resume, which steps
save, the save before a stop, each save's line and scalars, and the one "last checkpoint" that the run's lines and
its summary name.

- Which steps save: those of ``train.checkpoint_every`` (cadence.py: ``auto`` is decided at the first log line past
  the first steps, in one line), the last step and ``train.stop_after``'s.
- A stop that Ctrl-C or SIGTERM asked for first waits for the save under way, then saves the steps since, where the
  last save's time says it fits in ``STOP_SECONDS``; process 0 decides, for every process.
- The resume (``resume``): the checkpoint this run continues, its state restored into the run's step, or a fresh
  start; every process reads its own rows, and one that finds them damaged stops every process, with its line.
- ``last_step``: the step the run can continue from, the one the manifest names (process 0's ``Checkpointer`` commits
  it), or the one the run resumed from. The stop's line, the non-finite loss's and summary.json's ``checkpoint_step``
  read it; the stop's line first abandons a save it did not wait for, so that the step it names stays the manifest's.

The saves themselves (staging memory, the writer thread, the commit, a save's line) are checkpoints/writer.py's.

Besides the door, what reads a checkpoint's state outside a run, handed on from state.py: the configuration's
``fingerprint``, ``same_run`` and ``saved_strategy`` (train.strategy=auto's resume), ``read_model`` and ``layout``
(export).
"""

from __future__ import annotations

import time

import torch.distributed as dist
from omegaconf import OmegaConf

from detector.train.checkpoints import files
from detector.train.checkpoints.cadence import Cadence
from detector.train.checkpoints.state import (
    BytesRead,
    CheckpointError,
    fingerprint,
    layout,
    load_checkpoint,
    param_groups,
    read_model,
    rng_state,
    same_run,
    saved_strategy,
    shared_checkpoint,
    state_pieces,
)
from detector.train.checkpoints.writer import Checkpointer, Save, token
from detector.train.distributed import processes as distributed
from detector.train.observe import summary
from detector.train.observe.board import Board
from detector.train.observe.progress import TIMING_SKIP, Log, throughput

__all__ = ["BytesRead", "RunCheckpoints", "fingerprint", "layout", "read_model", "same_run", "saved_strategy"]

STOP_SECONDS = 20.0  # a stop's last save must be done within this (torchrun kills 30 s after its SIGTERM)


class RunCheckpoints:
    """The checkpoints of ``run`` (training_loop.py's ``Run``: its folder, processes, step and clock), the one door
    the loop goes through: ``resume`` before the first step (the run's state restored, or a fresh start),
    ``start`` with the loop, then ``due`` and ``save`` between steps, ``close`` at its end."""

    def __init__(self, run):
        self.run, self.tcfg = run, run.tcfg
        self.expected = fingerprint(run.cfg, run.env.world_size)  # the run's configuration, which a resume must match
        self.path = files.manifest_path(run.run_dir)  # what the run's lines name as where it can continue from
        self.resumed = 0  # the step the run resumed from (0: a fresh run), which ``resume`` sets
        self.cadence = Cadence(run.tcfg.checkpoint_every, run.tcfg.steps)
        self.checkpointer: Checkpointer | None = None  # once the loop starts, where the run checkpoints
        self.board = Board()  # TensorBoard's, from the loop's start (process 0's writes): each save's times
        self.unsaved: str | None = None  # why a stop did not save the step it stopped at, for its line

    def resume(self) -> dict:
        """The checkpoint's saved state (model, optimizer, ... restored into the run's step), or a fresh start's; its
        step is the one the run resumes from. train.resume=auto continues the folder's unfinished run of this very
        configuration, and says so; true continues any (and refuses another configuration's in one line); false starts
        afresh."""
        run = self.run
        mode, found = self.tcfg.resume, shared_checkpoint(run.run_dir, run.env.world_size)
        earlier = files.earlier_format(run.run_dir) if found and mode != "false" else None
        if earlier:
            raise CheckpointError(earlier)
        if found and mode == "auto":
            step = same_run(run.run_dir, self.expected, run.global_batch)
            found = 0 < step < self.tcfg.steps  # another configuration's, or a complete run: a fresh one starts
        if not found or mode == "false":
            if run.checks is not None:
                run.checks.cancel()
            if mode == "true":
                run.say(f"train.resume=true but {run.run_dir} holds no checkpoint: starting from step 0")
            return {"step": 0, "losses": [], "evals": []}
        group = run.control.group
        try:
            state = load_checkpoint(run.run_dir, run.step_fn, self.expected, run.global_batch, group, run.checks)
            error = None
        except CheckpointError as err:
            state, error = None, str(err)
        # every process reads its own rows: one that finds them damaged stops every process, with its line
        errors = [error]
        if run.env.world_size > 1:
            errors = [None] * run.env.world_size
            dist.all_gather_object(errors, error, group=group)
        first = next((e for e in errors if e), None)
        if first:
            raise CheckpointError(first)
        how = "" if mode == "true" else " (its checkpoint, this configuration; train.resume=false starts afresh)"
        run.say(f"resuming {run.run_dir} at step {state['step']}{how}")
        self.resumed = state["step"]
        return state

    def start(self, board: Board) -> None:
        """Where train.checkpoint_every or train.stop_after asks for saves: the staging memory, allocated now and
        page-locked while the first steps run, and the disk's probe where the cadence waits for it."""
        run, self.board = self.run, board
        if not (self.tcfg.checkpoint_every or self.tcfg.stop_after):
            return
        with run.wall.startup("checkpoint staging"):
            mark = distributed.shared_folder(run.run_dir, token(), run.control, run.env.is_main)
            env = run.env
            self.checkpointer = Checkpointer(run.run_dir, env.rank, env.world_size, run.device, mark, self.resumed)
            self.checkpointer.prepare(state_pieces(run.step_fn), probe=self.cadence.auto and env.is_main)

    def note(self) -> str:
        """The start-up line's note of a cadence still to be decided."""
        if self.checkpointer is None or not self.cadence.undecided:
            return ""
        return "; checkpoints: every minute of steps or more, as the disk allows (set after the first steps)"

    @property
    def last_step(self) -> int:
        """The step of the checkpoint the run can continue from (-1: none): the checkpointer's, which every save
        commits, or the one the run resumed from."""
        return self.checkpointer.committed_step if self.checkpointer else (self.resumed or -1)

    # -------------------------------------------------------------------- between two steps

    def due(self, step: int) -> bool:
        """Whether ``step`` saves: at the cadence, the last step and train.stop_after's."""
        if self.checkpointer is None:
            return False
        return self.cadence.due(step) or step == self.tcfg.steps or step == self.tcfg.stop_after

    def decide_cadence(self, log: Log) -> None:
        """train.checkpoint_every=auto, at a log line until decided: the steps between saves, from process 0's step
        time (the log windows after the first, which holds the compilation) and a save's write time (its disk probe
        done), the same on every process (cadence.py); one line says it. Until then, no save is due."""
        if self.checkpointer is None or not self.cadence.undecided:
            return
        run, saver, figures = self.run, self.checkpointer, None
        steady = log.since(max(log.first_line, self.resumed + TIMING_SKIP))
        if run.env.is_main and steady and saver.write_estimate(wait=False) is not None:
            figures = (throughput(steady, run.global_batch, skip_until=0)["step_ms"] / 1e3, saver.write_estimate())
        figures = run.control.broadcast(figures)
        if figures is not None:
            self.cadence.decide(*figures)
            run.say(self.cadence.describe(*figures, saver.state_bytes(), saver.disk_speed))

    def save(self, step: int, losses: list, evals: list, alone: bool = False) -> None:
        """Start a checkpoint of ``step``: every process copies its part to host memory (the step's only wait) and
        writes it in the background; process 0 commits it (``Checkpointer``). ``losses`` and ``evals``: the run's
        record so far, which the checkpoint keeps. The run's last step's save, train.stop_after's and ``alone`` (a
        stop's) are waited for: they write with every thread the machine gives them."""
        run = self.run
        alone = alone or step in (self.tcfg.steps, self.tcfg.stop_after)
        with run.wall.part("checkpoints"):
            pieces = state_pieces(run.step_fn)
            meta = checkpoint_meta(run, self.expected, step, losses, evals) if run.env.is_main else None
            save = self.checkpointer.save(step, pieces, meta, alone=alone)
        self.board.scalar("checkpoint/blocked_s", save.blocked, step)

    def stop_saves(self, step: int) -> bool:
        """Before a stop that Ctrl-C or SIGTERM asked for (of any process), where train.checkpoint_every saves: the
        save under way finished, then whether one of the steps since (up to ``step``) is saved, where the last save's
        time says it fits in ``STOP_SECONDS``. Process 0 decides, for all."""
        if self.checkpointer is None or not self.tcfg.checkpoint_every:
            return False
        start = time.perf_counter()
        current = self.checkpointer.current
        under_way = current.step if current is not None and not current.done.is_set() else None
        self.close(wait=True, final=False)
        saver = self.checkpointer
        last = saver.saves[-1].written if saver.saves else 0.0
        waited = time.perf_counter() - start
        fits = self.run.control.broadcast(step > max(saver.started_step, 0) and waited + last < STOP_SECONDS)
        if step > max(saver.started_step, 0) and not fits:
            before = f"the save of step {under_way} was still writing ({waited:.1f} s more) and " if under_way else ""
            self.unsaved = (
                f"step {step} was not saved: {before}a save takes {last:.1f} s, past the {STOP_SECONDS:.0f} s a stop "
                "gives itself before a launcher's SIGKILL (torchrun's and Kubernetes' come 30 s after SIGTERM)"
            )
        return fits

    def poll(self) -> None:
        """Log the checkpoints committed since the last step."""
        if self.checkpointer is not None:
            self.logged(self.checkpointer.poll())

    def close(self, wait: bool, final: bool = True) -> None:
        """Wait for the save under way (``wait``) and log it, or abandon it; with ``final``, no more saves after it."""
        if self.checkpointer is not None:
            try:
                if final:
                    self.checkpointer.close(wait)
                elif wait:
                    self.checkpointer.wait()
            finally:
                self.logged(self.checkpointer.poll())

    def logged(self, saves: list[Save]) -> None:
        for save in saves:
            if self.run.env.is_main and save.error is None:
                self.run.say(self.checkpointer.line(save), flush=True)
                self.board.scalar("checkpoint/written_s", save.written, save.step)

    # -------------------------------------------------------------------- what the run's lines and summary say

    def kept(self) -> str:
        """The stop line's end: where the run can continue from (a save under way is abandoned or waited for by now:
        the manifest's checkpoint), and the setting that continues it."""
        saver = self.checkpointer
        if saver is not None:
            saver.abandon()  # no save commits after this line: the step it names is the manifest's
        step, unsaved = self.last_step, f" ({self.unsaved})" if self.unsaved else ""
        if step >= 1:
            return f"its last checkpoint is step {step} in {self.path}{unsaved}: continue with train.resume=true"
        if saver is None or not self.tcfg.checkpoint_every:
            return "no checkpoint was written (train.checkpoint_every)"
        if saver.started_step > 0:  # a second signal abandoned the stop's save
            return f"no checkpoint was written (the save of step {saver.started_step} was abandoned)"
        return "no checkpoint was written yet"

    def last_good(self) -> str:
        """The non-finite loss's line: the checkpoint the run can continue from, all of whose steps were finite."""
        if self.last_step < 1:
            return "no checkpoint was written"
        return f"the last good checkpoint is step {self.last_step} in {self.path}"

    def written_seconds(self) -> float:
        """The saves' writes, in the background beside the steps."""
        return sum(s.written or 0.0 for s in self.checkpointer.saves) if self.checkpointer else 0.0

    def record(self) -> summary.Checkpoints | None:
        """What the run's summary keeps of its saves (process 0's), where it saved."""
        return summary.Checkpoints.parse(self.checkpointer.record(), "checkpoints") if self.checkpointer else None


def checkpoint_meta(run, expected: dict, step: int, losses: list, evals: list) -> dict:
    """What a checkpoint of ``step`` holds besides the model's and the optimizer's tensors: the schedule, the step, the
    RNG states, the data position, the run's record so far and its configuration (``expected``: its fingerprint)."""
    return {
        "step": step,
        "param_groups": param_groups(run.step_fn.optimizer),
        "scheduler": run.step_fn.scheduler.state_dict(),
        "rng": rng_state(),
        "data": {"next_index": step * run.global_batch, "global_batch": run.global_batch},
        "losses": list(losses),
        "evals": list(evals),
        "fingerprint": expected,
        "config": OmegaConf.to_container(run.cfg, resolve=True),
    }
