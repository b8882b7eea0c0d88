"""Nothing lost, nothing silent: checkpoints that cannot be trusted, non-finite losses, resumes, collisions
and honest throughput, each on a detector of a few thousand parameters (CPU, milliseconds a step)."""

import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_helpers import losses, tiny_cfg

from detector import data
from detector.errors import UserError
from detector.losses import STRATEGIES, Strategy
from detector.train.checkpoints import dcp_io
from detector.train.checkpoints import files as checkpoint_files
from detector.train.checkpoints import manager as run_checkpoints
from detector.train.checkpoints import writer as checkpoint_writer
from detector.train.checkpoints.state import CheckpointError, read_checkpoint
from detector.train.observe.progress import StepClock
from detector.train.observe.summary import read
from detector.train.run import folder as run_folder
from detector.train.run.entry import run_training
from detector.train.run.interrupt import Terminated
from detector.train.run.training_loop import NonFiniteLoss, Steps

RUN = ["train.steps=6", "train.checkpoint_every=3"]


def same_losses(resumed: list[float], straight: list[float]) -> None:
    """A resumed run's losses against an uninterrupted run's: the same within float32's rounding. Two fresh CPU runs
    in one process have differed by 1.2e-7 at a step before any resume, under a full suite's load of 12 workers on 16
    cores (the CPU's BLAS may sum in another order); test_training_loop's exact-resume test allows the same."""
    assert len(resumed) == len(straight), (resumed, straight)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-6, atol=0)


def run_dir(tmp_path, strategy="padded"):
    return tmp_path / "default" / strategy


# ----------------------------------------------------------------------------- checkpoints


def damage(run: Path, how: str) -> Path:
    """Damage the committed checkpoint of ``run`` as ``how`` says; the file damaged."""
    manifest = run / "checkpoint.json"
    folder = run / json.loads(manifest.read_text())["folder"]
    where = {"manifest": manifest, "part": folder / "__0_0.distcp", "meta": folder / "meta.json"}
    path = (where | {"metadata": folder / ".metadata"})[how.split()[0]]
    raw = bytearray(path.read_bytes())
    kind = how.split()[1]
    if kind == "overwritten":
        raw[len(raw) // 2 : len(raw) // 2 + 4096] = b"\xff" * min(4096, len(raw) - len(raw) // 2)
    elif kind == "zeroed":
        raw[len(raw) // 2 : len(raw) // 2 + 4096] = bytes(min(4096, len(raw) - len(raw) // 2))
    elif kind == "truncated":
        raw = raw[: len(raw) // 2]
    elif kind == "garbage":
        raw = bytearray(b"not a checkpoint at all\n" * 100)
    elif kind == "empty":
        raw = bytearray()
    elif kind == "edited":  # a well-formed manifest, one value changed
        raw = bytearray(bytes(raw).replace(b'"step": 3', b'"step": 4'))
    elif kind == "missing":
        path.unlink()
        return path
    path.write_bytes(bytes(raw))
    return path


DAMAGES = [
    f"{where} {kind}"
    for where in ("part", "meta", "metadata")
    for kind in ("overwritten", "zeroed", "truncated", "missing")
]
DAMAGES += ["manifest garbage", "manifest empty", "manifest edited", "manifest truncated"]


@pytest.fixture(scope="module")
def stopped_once(tmp_path_factory):
    """A run of RUN stopped after its checkpoint of step 3, trained once for the module: its out_dir."""
    out = tmp_path_factory.mktemp("stopped")
    run_training(tiny_cfg(out, *RUN, "train.stop_after=3"))
    return out


@pytest.fixture
def stopped(stopped_once, tmp_path):
    """``tmp_path`` holding a copy of that run (resume's checks ignore train.out_dir, a run control), to damage."""
    shutil.copytree(stopped_once, tmp_path, symlinks=True, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The summary of a run of RUN not interrupted, trained once for the module: the losses a resume must match."""
    return run_training(tiny_cfg(tmp_path_factory.mktemp("straight"), *RUN))[0]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(stopped, tmp_path, how):
    path = damage(run_dir(tmp_path), how)
    with pytest.raises(CheckpointError) as err:
        run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))
    message = str(err.value)
    assert str(path) in message and "train.resume=false" in message and "\n" not in message, message


def test_an_intact_checkpoint_reads_back(stopped, tmp_path):
    state = read_checkpoint(run_dir(tmp_path))
    assert state["step"] == 3 and len(state["losses"]) == 3


@pytest.fixture
def verifying(monkeypatch):
    """The threads that check a checkpoint's files, one name a call of checkpoint_files.verify."""
    threads, verify = [], checkpoint_files.verify

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return verify(*args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "verify", recorded)
    return threads


def test_the_checks_begun_before_the_model_is_built_serve_the_resume(tmp_path, verifying, capsys, straight):
    run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))
    assert verifying == []  # a fresh run checks nothing
    cfg = tiny_cfg(tmp_path, *RUN)
    with run_folder.early_check(cfg, None) as checks:
        assert checks is not None and checks.manifest.step == 3
        again = run_training(cfg, None, checks)[0]
    assert verifying == ["checkpoint-verify"], verifying  # once, in the background: the resume took its outcome
    assert again.resumed_at == 3
    same_losses(again.losses, straight.losses)
    assert f"resuming {run_dir(tmp_path)} at step 3" in capsys.readouterr().out


def test_checks_the_command_found_none_to_begin_are_not_begun_again_by_the_run(
    stopped, tmp_path, verifying, monkeypatch
):
    """The command begins the checks (None: it found no checkpoint to continue); the run takes that answer, and
    begins its own only where its caller began none (a run from Python)."""
    begun = []
    monkeypatch.setattr(checkpoint_files.Verification, "start", classmethod(lambda cls, *a: begun.append(a)))
    run_training(tiny_cfg(tmp_path, *RUN), None, None)  # as the command passes what early_check found
    assert begun == [] and verifying == ["MainThread"]  # the resume checked the files itself, once
    run_training(tiny_cfg(tmp_path / "python", *RUN))  # from Python: begun here (none found: a fresh folder)
    assert len(begun) == 1


def test_checks_of_a_checkpoint_replaced_since_they_began_are_not_taken(stopped, tmp_path, verifying):
    checks = checkpoint_files.Verification.start(run_dir(tmp_path), steps=6)
    later = dataclasses.replace(checks.manifest, step=4)  # as if a save of step 4 had committed since
    assert checks.result(later) is False and not checks.thread.is_alive()
    assert checkpoint_files.Verification.start(run_dir(tmp_path), steps=3) is None  # a complete run continues nothing


def test_no_checks_begin_where_the_run_will_not_continue_and_cancelled_ones_stop(stopped_once, tmp_path, verifying):
    with run_folder.early_check(tiny_cfg(tmp_path, *RUN), None) as checks:
        assert checks is None  # no checkpoint
    shutil.copytree(stopped_once, tmp_path, symlinks=True, dirs_exist_ok=True)  # the run stopped after step 3
    with run_folder.early_check(tiny_cfg(tmp_path, *RUN, "train.resume=false"), None) as checks:
        assert checks is None
    (run_dir(tmp_path) / "checkpoint.json").write_text("{")  # unreadable: the resume says so, in its turn
    with run_folder.early_check(tiny_cfg(tmp_path, *RUN), None) as checks:
        assert checks is None


def test_cancelled_checks_stop_at_the_next_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_files, "CHUNK", 4096)  # a checkpoint of many chunks
    run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))
    hashed, release, digest = [], threading.Event(), checkpoint_files.chunk_digest

    def slow(path, start, size):
        hashed.append(start)
        release.wait(10)
        return digest(path, start, size)

    monkeypatch.setattr(checkpoint_files, "chunk_digest", slow)
    checks = checkpoint_files.Verification.start(run_dir(tmp_path), steps=6)
    while not hashed:
        time.sleep(0.01)
    checks.stopped.set()
    release.set()
    checks.cancel()
    chunks = sum(len(entry.chunks) for entry in checks.manifest.files.values())
    assert len(hashed) <= checkpoint_files.HASHERS < chunks, (len(hashed), chunks)
    assert isinstance(checks.error, checkpoint_files.Cancelled)


# ----------------------------------------------------------------------------- non-finite losses


@pytest.fixture
def nan_from_step_4(monkeypatch):
    """A strategy whose loss turns NaN from its 4th call on (as a diverging run's does)."""
    padded, calls = STRATEGIES["padded"], []

    def loss(pred, targets):
        calls.append(1)
        value = padded.fn(pred, targets)
        return value * float("nan") if len(calls) >= 4 else value

    monkeypatch.setitem(STRATEGIES, "nan_from_4", Strategy("nan_from_4", "padded", loss, "test: NaN from call 4"))
    return "nan_from_4"


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_good_checkpoint(tmp_path, nan_from_step_4):
    cfg = tiny_cfg(tmp_path, *RUN, f"train.strategy={nan_from_step_4}")
    with pytest.raises(NonFiniteLoss, match="not finite at step 4.*last good checkpoint is step 3"):
        run_training(cfg)
    state = read_checkpoint(run_dir(tmp_path, nan_from_step_4))
    assert state["step"] == 3 and all(torch.isfinite(p).all() for p in state["model"].values())


def test_nonfinite_skip_skips_those_updates_and_finishes(tmp_path, nan_from_step_4, capsys):
    cfg = tiny_cfg(tmp_path, *RUN, f"train.strategy={nan_from_step_4}", "train.nonfinite=skip")
    summary = run_training(cfg)[0]
    assert summary.steps == 6 and "skipped the update of step(s) [4]" in capsys.readouterr().out
    state = read_checkpoint(run_dir(tmp_path, nan_from_step_4))
    assert all(torch.isfinite(p).all() for p in state["model"].values())


# ----------------------------------------------------------------------------- resumes


def test_a_resumed_run_logs_the_curve_of_an_uninterrupted_one(tmp_path):
    run = ["train.steps=6", "train.checkpoint_every=1", "train.log_every=2"]
    straight = run_training(tiny_cfg(tmp_path / "straight", *run))[0]
    run_training(tiny_cfg(tmp_path / "split", *run, "train.stop_after=3"))  # stops inside a log window
    resumed = run_training(tiny_cfg(tmp_path / "split", *run, "train.resume=true"))[0]
    assert [s for s, _ in resumed.history] == [2, 4, 6]
    torch.testing.assert_close(losses([resumed.to_json()]), losses([straight.to_json()]), rtol=1e-6, atol=0)


def test_a_run_killed_before_its_summary_is_finished_by_resume(tmp_path):
    complete = run_training(tiny_cfg(tmp_path, *RUN))[0]
    (run_dir(tmp_path) / "summary.json").unlink()  # killed after the final checkpoint, before the summary
    again = run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))[0]
    assert again.final_loss == complete.final_loss and again.history == complete.history
    assert json.loads((run_dir(tmp_path) / "summary.json").read_text())["steps"] == 6


# ----------------------------------------------------------------------------- collisions


def test_a_second_process_on_one_run_folder_is_refused(tmp_path):
    with run_folder.locked(run_dir(tmp_path)):
        with pytest.raises(UserError, match="is in use by pid"):
            run_training(tiny_cfg(tmp_path, *RUN))


def test_the_lock_file_is_removed_when_the_run_ends_however_it_ends(tmp_path, nan_from_step_4):
    lock = run_dir(tmp_path).with_name("padded.lock")
    run_training(tiny_cfg(tmp_path, *RUN))
    assert run_dir(tmp_path).is_dir() and not lock.exists()
    with pytest.raises(NonFiniteLoss):
        run_training(tiny_cfg(tmp_path, *RUN, f"train.strategy={nan_from_step_4}"))
    assert not run_dir(tmp_path, nan_from_step_4).with_name(f"{nan_from_step_4}.lock").exists()


def test_a_lock_file_removed_by_its_holder_while_another_opened_it_is_not_a_lock(tmp_path, monkeypatch):
    """The holder removes its file before it unlocks: a process that had opened the old file and locks it then
    holds nothing, so it opens the new file, which a third process may hold (and then it is refused)."""
    run = run_dir(tmp_path)
    lock_path = run.with_name("padded.lock")
    real_open, opened = open, []

    def open_then_lose_the_race(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        if path == lock_path and not opened:  # the first open: another run ends and a third one starts here
            opened.append(file)
            lock_path.unlink()
            third = real_open(lock_path, "a+")
            run_folder.fcntl.flock(third, run_folder.fcntl.LOCK_EX | run_folder.fcntl.LOCK_NB)
            third.write("pid 4242")
            third.flush()
            opened.append(third)
        return file

    monkeypatch.setattr("builtins.open", open_then_lose_the_race)
    with pytest.raises(UserError, match="is in use by pid 4242"):
        with run_folder.locked(run):
            pass
    assert opened[0].closed
    opened[1].close()


def visible_runs(folder) -> dict[str, int]:
    """Run folder name -> steps of its summary (0 without one); a hidden entry fails the test."""
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    runs_ = {}
    for p in folder.iterdir():
        if p.is_dir():
            summary = p / "summary.json"
            runs_[p.name] = json.loads(summary.read_text())["steps"] if summary.exists() else 0
    return runs_


def test_a_re_run_keeps_every_earlier_run_visible_and_says_where(tmp_path, capsys):
    folder = run_dir(tmp_path).parent
    run_training(tiny_cfg(tmp_path, *RUN))  # 6 steps
    run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))  # a fresh run, stopped (or killed) after step 3
    out = capsys.readouterr().out
    (earlier,) = [name for name in visible_runs(folder) if name != "padded"]
    assert earlier.startswith("padded-") and visible_runs(folder) == {earlier: 6, "padded": 3}
    assert f"{run_dir(tmp_path)} held an earlier run (6 steps, final loss " in out
    assert f"moved to {folder / earlier}/ (nothing is deleted)" in out

    run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))  # a resume continues in place
    assert "held an earlier run" not in capsys.readouterr().out
    assert visible_runs(folder) == {earlier: 6, "padded": 6}
    run_training(tiny_cfg(tmp_path, *RUN))  # and a third run keeps both
    assert sorted(visible_runs(folder).values()) == [6, 6, 6]


def test_a_fresh_run_that_fails_leaves_the_earlier_run_where_it_said(tmp_path, nan_from_step_4, capsys):
    run = [*RUN, f"train.strategy={nan_from_step_4}"]
    run_training(tiny_cfg(tmp_path, *run, "train.nonfinite=skip"))  # 6 steps; the strategy's NaNs from now on
    with pytest.raises(NonFiniteLoss):
        run_training(tiny_cfg(tmp_path, *run))
    folder = run_dir(tmp_path, nan_from_step_4).parent
    (earlier,) = [name for name in visible_runs(folder) if name != nan_from_step_4]
    assert visible_runs(folder)[earlier] == 6 and f"moved to {folder / earlier}/" in capsys.readouterr().out


def test_hidden_runs_of_earlier_versions_are_given_a_visible_name(tmp_path, capsys):
    run_training(tiny_cfg(tmp_path, *RUN))
    folder = run_dir(tmp_path)
    folder.rename(folder.with_name(f".{folder.name}.previous-1795617542820514288"))  # as the old `replacing` left it
    run_training(tiny_cfg(tmp_path, *RUN))
    assert "was hidden in .padded.previous-1795617542820514288/: moved to" in capsys.readouterr().out
    assert sorted(visible_runs(folder.parent).values()) == [6, 6]


# ----------------------------------------------------------------------------- throughput


def test_throughput_is_wall_clock_with_the_device_time_beside_it(tmp_path, monkeypatch):
    draw = data.FaceSampler.draw_batch  # what the loader calls

    def slow(self, indices, out):
        time.sleep(0.01 * len(indices))  # a data pipeline that cannot keep up
        return draw(self, indices, out)

    monkeypatch.setattr(data.FaceSampler, "draw_batch", slow)
    summary = run_training(tiny_cfg(tmp_path, "train.steps=8", "train.checkpoint_every=0", "data.num_workers=0"))[0]
    assert summary.data_wait_ms > 30  # 4 images x 10 ms
    assert summary.step_ms >= summary.device_step_ms + summary.data_wait_ms * 0.9
    assert summary.images_per_s < summary.device_images_per_s
    # on the CPU nothing runs ahead: the whole wait is idle time between steps
    assert summary.device_idle_ms >= summary.data_wait_ms * 0.9


def test_a_cpu_run_logs_no_device_or_idle_figures(tmp_path, capsys):
    """On the CPU the host is the device: its time is the wall clock's, and nothing sits idle waiting for it."""
    run_training(tiny_cfg(tmp_path, "device=cpu", "train.steps=4", "train.log_every=2", "train.checkpoint_every=0"))
    out = capsys.readouterr().out.replace(str(tmp_path), "<tmp>")  # whose name holds the test's, "...device..."
    lines = [line for line in out.splitlines() if line.startswith(("step ", "done: "))]
    assert len(lines) == 3 and not [line for line in lines if "device" in line or "idle" in line], lines
    assert re.fullmatch(
        r"step +2/4  loss \d\.\d{4}  lr \S+  step +\d+\.\d ms \(data wait \d+\.\d\) .* eta \S+", lines[0]
    )
    assert re.fullmatch(
        r"done: \S+  final loss \d\.\d{4}  median step \d+\.\d ms  \d+ img/s by the wall clock", lines[2]
    )


def test_the_step_clock_reports_the_idle_time_between_steps():
    clock = StepClock(torch.device("cpu"))
    for pause in (0.0, 0.03, 0.0):
        time.sleep(pause)
        clock.start()
        clock.stop()
    (_, first), (_, after_pause), (_, back_to_back) = clock.read()
    assert first == 0.0  # nothing before the first step
    assert after_pause >= 30 > back_to_back
    clock.start()
    clock.stop()
    assert clock.read()[0][1] < 30  # measured from the last step of the previous read
    time.sleep(0.05)
    clock.set_aside(0.05)  # an evaluation's time, timed on its own
    clock.start()
    clock.stop()
    assert 0.0 <= clock.read()[0][1] < 30  # the idle time before that step less it, never below zero


# ----------------------------------------------------------------------------- the run as lived


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


def test_the_summary_says_where_the_wall_clock_went(tmp_path):
    summary = run_training(tiny_cfg(tmp_path, "train.steps=6", "train.checkpoint_every=3", "data.num_workers=0"))[0]
    wall = summary.wall_clock
    assert set(wall.seconds) == {"start-up", "first step", "steps", "data", "evaluations", "checkpoints", "end"}
    assert wall.data_stalls[1] == 6 and 0 <= wall.data_stalls[0] <= 6  # every step's wait for its batch counted
    assert wall.total_s == pytest.approx(sum(wall.seconds.values()))
    assert wall.seconds["start-up"] > 0 and wall.seconds["first step"] > 0 and wall.seconds["steps"] > 0
    assert 0 < wall.goodput < 1 and wall.goodput == pytest.approx(wall.seconds["steps"] / wall.total_s)
    assert wall.images_per_s_lived == pytest.approx(6 * 4 / wall.total_s)
    assert [s.step for s in summary.checkpoints.saves] == [3, 6]
    assert read(run_dir(tmp_path)) == summary  # summary.json is the record, read back the same
    # the start-up's parts: from the process's start to the run, then each part the run timed, and the rest
    parts = wall.startup
    assert list(parts)[0] == "interpreter and imports" and parts["interpreter and imports"] > 0
    assert {"model and optimizer", "loader", "held-out set", "checkpoint staging", "other"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(wall.seconds["start-up"])
    scalars = EventAccumulator(str(run_dir(tmp_path))).Reload().Tags()["scalars"]
    assert {"goodput/share", "goodput/start_up_s", "checkpoint/blocked_s", "checkpoint/written_s"} <= set(scalars)


def test_the_same_command_again_continues_an_unfinished_run(stopped, tmp_path, capsys, straight):
    # stopped: as a run killed after its checkpoint of step 3
    again = run_training(tiny_cfg(tmp_path, *RUN))[0]
    assert (
        f"resuming {run_dir(tmp_path)} at step 3 (its checkpoint, this configuration; train.resume=false starts afresh)"
        in capsys.readouterr().out
    )
    assert again.resumed_at == 3
    same_losses(again.losses, straight.losses)


def test_another_configuration_or_resume_false_moves_the_unfinished_run_aside_and_says_how_to_continue_it(
    tmp_path, capsys
):
    for fresh in (["train.lr=0.02"], ["train.resume=false"]):
        run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))
        capsys.readouterr()
        summary = run_training(tiny_cfg(tmp_path, *RUN, *fresh))[0]
        line = next(line for line in capsys.readouterr().out.splitlines() if "held an earlier run" in line)
        assert "It was unfinished: to continue it instead" in line and "its config.yaml" in line, line
        assert summary.resumed_at == 0


def test_the_eta_and_the_first_log_lines_step_come_from_the_steps_after_the_first(tmp_path, monkeypatch, capsys):
    """A first step of 2 s (a cold compile) must not make the ETA of 30 steps of milliseconds read 10 s, nor the
    first log line's step time read its share of the window (400 ms): the first step is timed apart."""
    from detector.train.run.step import TrainStep

    real, calls = TrainStep.__call__, []

    def first_slow(self, batch):
        if not calls:
            time.sleep(2.0)
        calls.append(1)
        return real(self, batch)

    monkeypatch.setattr(TrainStep, "__call__", first_slow)
    run = ["device=cpu", "train.steps=30", "train.log_every=5", "train.checkpoint_every=0", "data.num_workers=0"]
    run_training(tiny_cfg(tmp_path, *run))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step      5/30"))
    minutes, seconds = re.search(r"eta (\d+)m(\d+)s", line).groups()
    assert int(minutes) * 60 + int(seconds) < 3, line  # 25 steps of a few ms, not 25 x (2 s / 5)
    assert float(re.search(r"step +([\d.]+) ms", line).group(1)) < 300, line  # the steps 2-5, not 2 s / 5


def test_the_eta_is_not_stretched_by_an_evaluation(tmp_path, monkeypatch, capsys):
    """An evaluation of 2 s at step 10 lies inside the next log window: the ETA of the steps after it is theirs. (The
    evaluations after it, at 20, 30 and 40, come after the line read: they take their own time.)"""
    from detector.train.evaluate.evaluation import Evaluation

    real = Evaluation.__call__

    def slow(self, step, *args, **kwargs):
        if step == 10:
            time.sleep(2.0)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(Evaluation, "__call__", slow)
    run = ["device=cpu", "train.steps=40", "train.log_every=5", "train.eval_every=10", "data.num_workers=0"]
    run_training(tiny_cfg(tmp_path, *run, "train.checkpoint_every=0"))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step     15/40"))
    minutes, seconds = re.search(r"eta (\d+)m(\d+)s", line).groups()
    assert int(minutes) * 60 + int(seconds) < 5, line  # 25 steps of ms, not 25 x (2 s / 5); evals at 20-40 not in it


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
