"""A checkpoint's save off the step's path (detector/train/checkpoints/writer.py, manager.py): the step waits for the
copy to host memory alone, the write goes on in the background (in more threads and at the step's priority for the
last save, which the run waits for), a save that waits for the previous one is timed apart from the wait, and a stop
that cannot save its step in time says why; on a disk made slow on purpose."""

import os
import re
import signal
import threading
import time

import pytest
from train_helpers import run_dir, tiny_cfg

from detector.train.checkpoints import dcp_io
from detector.train.checkpoints import files as checkpoint_files
from detector.train.checkpoints import manager as run_checkpoints
from detector.train.checkpoints import writer as checkpoint_writer
from detector.train.checkpoints.state import read_checkpoint
from detector.train.run.entry import run_training
from detector.train.run.interrupt import Terminated
from detector.train.run.training_loop import Steps


def slow_disk(monkeypatch, seconds: float) -> None:
    """Every save's write takes ``seconds`` more."""
    real = dcp_io.Writer.write_data

    def slow(self, plan, planner):
        time.sleep(seconds)
        return real(self, plan, planner)

    monkeypatch.setattr(dcp_io.Writer, "write_data", slow)


def test_a_checkpoint_waits_only_for_its_copy_and_the_slow_disk_is_the_background_s(tmp_path, monkeypatch):
    """A disk that takes a second a save: the step waits for the copy to host memory alone, the write goes on
    beside the next steps, and the run's end waits for the last save to be committed."""
    slow_disk(monkeypatch, 1.0)
    summary = run_training(tiny_cfg(tmp_path, "train.steps=8", "train.checkpoint_every=4", "data.num_workers=0"))[0]
    first, last = summary.checkpoints.saves
    assert first.step == 4 and last.step == 8
    assert first.blocked_s < 0.5 and first.written_s >= 1.0
    assert read_checkpoint(run_dir(tmp_path))["step"] == 8  # committed before the run said done


def test_the_last_save_which_the_run_waits_for_writes_with_more_threads_at_the_steps_priority(tmp_path, monkeypatch):
    """A save beside the steps writes in 2 threads at a lower priority, leaving the cores to the loader and the step;
    the run's last save, which the run waits for with nothing beside it, writes in ALONE_THREADS at the step's, and
    reads back the same."""
    seen = []
    real = dcp_io.Writer.write_data

    def watched(self, plan, planner):
        seen.append((self.thread_count, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(self, plan, planner)

    monkeypatch.setattr(dcp_io.Writer, "write_data", watched)
    monkeypatch.setattr(checkpoint_writer, "ALONE_THREADS", 3)  # the machine's own may be 2, like the background's
    base = os.getpriority(os.PRIO_PROCESS, 0)
    summary = run_training(tiny_cfg(tmp_path, "train.steps=8", "train.checkpoint_every=4", "data.num_workers=0"))[0]
    assert [s.step for s in summary.checkpoints.saves] == [4, 8]
    assert seen == [(2, max(base, checkpoint_files.BACKGROUND_NICE)), (3, base)]
    assert len(list(run_dir(tmp_path).glob("*/__0_*.distcp"))) == 3  # the last save's folder: the earlier one replaced
    assert read_checkpoint(run_dir(tmp_path))["step"] == 8


def test_a_save_that_waits_for_the_previous_one_is_timed_apart_from_the_wait(tmp_path, monkeypatch):
    """Saves every 2 steps on a disk of 1.5 s a save: each waits for the one before; the wait is the step's (blocked),
    the write after it the save's own (written, which the disk's time is held against), and the device's idle time
    before the next step leaves out what the save's wait took (on the CPU, idle is the host's time between steps)."""
    slow_disk(monkeypatch, 1.5)
    run = ["train.steps=6", "train.checkpoint_every=2", "data.num_workers=0", "train.eval_every=1000"]
    summary = run_training(tiny_cfg(tmp_path, *run))[0]
    saves = summary.checkpoints.saves
    assert [s.step for s in saves] == [2, 4, 6]
    for save in saves[1:]:
        assert save.blocked_s > 0.75, save  # the previous save's 1.5 s, less the two steps between
        assert 1.5 <= save.written_s < 2.5, save  # its own write alone, not the wait before it too
    assert summary.device_idle_ms < 500  # the waits (over 0.75 s each, at every other step) are not idle time


def test_a_stop_that_cannot_save_its_step_in_time_says_why_in_its_line(tmp_path, monkeypatch):
    """SIGTERM at step 6 while the save of step 4 still writes (a disk of 2 s a save): the stop waits for it, and a save
    of step 6 after it would pass the time a stop gives itself (STOP_SECONDS, 1 s here): the line names step 4 and
    says why step 6 was not saved, instead of leaving the README's promise silently unkept."""
    slow_disk(monkeypatch, 2.0)
    monkeypatch.setattr(run_checkpoints, "STOP_SECONDS", 1.0)
    real = Steps.after_step

    def terminate_at_6(self):
        stop = real(self)
        if self.step == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's: the loop stops after this step
        return stop

    monkeypatch.setattr(Steps, "after_step", terminate_at_6)
    run = ["train.steps=20", "train.checkpoint_every=4", "data.num_workers=0", "train.eval_every=1000"]
    with pytest.raises(Terminated) as stopped:
        run_training(tiny_cfg(tmp_path, *run))
    line = str(stopped.value)
    assert "the run stopped after step 6; its last checkpoint is step 4 in" in line
    why = re.search(
        r"\(step 6 was not saved: the save of step 4 was still writing \(([\d.]+) s more\) and a save takes "
        r"([\d.]+) s, past the 1 s a stop gives itself before a launcher's SIGKILL",
        line,
    )
    assert why and float(why.group(2)) >= 2.0, line
    assert read_checkpoint(run_dir(tmp_path))["step"] == 4
