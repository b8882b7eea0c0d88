"""A data worker that dies (exits, kill -9), raises or is stopped (kill -STOP) mid-run ends `train` in one line
naming the worker and the last checkpoint, exit status 2, never a hang or a traceback, and leaves no process
behind; train.resume=true then continues it (detector/train/run/training_loop.py with detector/data/loader.py)."""

import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import fails_after
from fault_helpers import TINY, one_error_line, start_training, wait_for_step

from detector import data
from detector.cli import main as cli
from detector.data.loader import DataWorkerFailed, WorkerTraceback
from detector.train.checkpoints.state import read_checkpoint


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test after 120 s instead of blocking the suite."""
    with fails_after(120):
        yield


# ----------------------------------------------------------------------------- a data worker dies


def test_a_worker_that_dies_mid_run_stops_it_in_one_line_and_resume_finishes_it(tmp_path, monkeypatch, capsys):
    """A worker exits as it starts batch 9 (handed out once step 3 and its checkpoint are done: 6 slots): exit
    status 2, one line naming the worker, its exit code and the last checkpoint; train.resume=true then gives
    the losses of a run that never failed."""
    run = [*TINY, "train.steps=12", "data.num_workers=2"]
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'straight'}"]) == 0
    draw = data.FaceSampler.draw_batch

    def dies_at_batch_9(self, indices, out):
        if indices[0] == 9 * 4 and os.environ.get("KILL_WORKER") == "1":
            os._exit(7)
        return draw(self, indices, out)

    monkeypatch.setattr(data.FaceSampler, "draw_batch", dies_at_batch_9)  # the forked workers inherit it
    monkeypatch.setenv("KILL_WORKER", "1")
    capsys.readouterr()
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'split'}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    pattern = (
        r"error: data worker [12] of 2 \(pid \d+\) exited unexpectedly with code 7, before batch (\d+) of 12 was "
        r"loaded; the run stopped after step (\d+); its last checkpoint is step (\d+) in \S+checkpoint.json: continue "
        r"with train.resume=true"
    )
    batch, stopped, kept = map(int, re.fullmatch(pattern, line).groups())
    assert batch == stopped and 4 <= stopped <= 9 and kept == 3 * (stopped // 3)

    monkeypatch.setenv("KILL_WORKER", "0")
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'split'}", "train.resume=true"]) == 0
    straight = read_checkpoint(tmp_path / "straight" / "default" / "padded")
    resumed = read_checkpoint(tmp_path / "split" / "default" / "padded")
    assert resumed["losses"] == straight["losses"] and len(resumed["losses"]) == 12


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def data_workers(pid: int, training: int) -> tuple[list[int], list[int]]:
    """The run's ``training`` loader workers and the held-out set's one (TINY's train.eval_batches=1), started after
    them: the later pid, while it lives (it stops once its batch is drawn). The newest child, forked after both, is
    the process that draws the evaluations' pictures (train/evaluate/evaluation.py ``Painter``), no data worker."""
    found = sorted(children(pid))
    assert training + 1 <= len(found) <= training + 2, found
    return found[:training], found[training:-1]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers through Linux's /proc")
def test_kill_9_of_a_data_worker_during_make_train_ends_it_within_seconds(tmp_path):
    """The issue's trial: kill -9 of one data worker of a running `train` (it blocked the run for good in 2 of 3)."""
    process = start_training(tmp_path, "data.batch_size=32", "data.max_boxes=256", "data.tail_fraction=1.0")
    wait_for_step(process, 4)  # past the checkpoint of step 3: the line names it
    training, held_out = data_workers(process.pid, 2)
    workers = training + held_out
    os.kill(training[1], signal.SIGKILL)
    start = time.monotonic()
    _, err = process.communicate(timeout=30)  # reads both pipes: a full one would block the run's last lines
    assert time.monotonic() - start < 10 and process.returncode == 2
    line = one_error_line(err)
    assert f"(pid {training[1]}) was killed by SIGKILL, exit code -9" in line and "train.resume=true" in line
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)  # a zombie shows until its parent has gone: the other workers end with it
    assert not [pid for pid in workers if Path(f"/proc/{pid}/status").exists() and alive(pid)]


def alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def break_batch(monkeypatch, batch: int) -> None:
    """The data workers (not the main process) raise ValueError drawing the run's batch ``batch`` (of 4 images)."""
    draw = data.FaceSampler.draw_batch

    def broken(self, indices, out):
        if indices[0] == batch * 4 and multiprocessing.parent_process() is not None:  # in a worker only
            raise ValueError(f"sample {batch * 4} is broken")
        return draw(self, indices, out)

    monkeypatch.setattr(data.FaceSampler, "draw_batch", broken)  # the forked workers inherit it


def test_a_worker_that_raises_stops_the_run_in_one_line_with_its_exception_and_the_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """The exception in the line, exit status 2; with --debug the worker's own traceback, as the error's cause."""
    break_batch(monkeypatch, 9)
    run = [*TINY, "train.steps=12", "data.num_workers=2", f"train.out_dir={tmp_path}"]
    assert cli.main(["train", *run]) == 2
    line = one_error_line(capsys.readouterr().err)
    pattern = (
        r"error: data worker [12] of 2 \(pid \d+\) raised ValueError: sample 36 is broken drawing batch 9 of 12 "
        r"\(its traceback: --debug\); the run stopped after step (\d+); its last checkpoint is step (\d+) in "
        r"\S+checkpoint.json: continue with train.resume=true"
    )
    stopped, kept = map(int, re.fullmatch(pattern, line).groups())
    assert 3 <= stopped <= 9 and kept == 3 * (stopped // 3)
    with pytest.raises(DataWorkerFailed) as err:
        cli.main(["train", "--debug", *run])
    assert isinstance(err.value.__cause__, WorkerTraceback)
    assert 'raise ValueError(f"sample {batch * 4} is broken")' in str(err.value.__cause__)  # the worker's own line


def test_a_resumed_run_that_saves_nothing_names_the_checkpoint_it_resumed_from(tmp_path, monkeypatch, capsys):
    """train.checkpoint_every=0 after a resume: the stop's line names the checkpoint the run continues from, the one
    its summary names (RunCheckpoints.last_step), not 'no checkpoint was written'."""
    run = [*TINY, "train.steps=12", "data.num_workers=2", f"train.out_dir={tmp_path}"]
    assert cli.main(["train", *run, "train.stop_after=3"]) == 0
    break_batch(monkeypatch, 6)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true", "train.checkpoint_every=0"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert re.search(
        r"the run stopped after step [3-6]; its last checkpoint is step 3 in \S+checkpoint.json: continue with "
        r"train.resume=true$",
        line,
    ), line


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers through Linux's /proc")
def test_a_stopped_data_worker_ends_the_run_in_one_line_naming_it_after_the_timeout(tmp_path):
    """kill -STOP of the worker: it delivers nothing, and the run would wait for it for good. After
    data.worker_timeout seconds without a batch: exit status 2, one line naming the worker, its state and the
    batch, and no process left behind (the stopped worker is killed)."""
    process = start_training(tmp_path, "data.num_workers=1", "data.worker_timeout=2")
    wait_for_step(process, 2)
    (worker,), held_out = data_workers(process.pid, 1)
    os.kill(worker, signal.SIGSTOP)
    start = time.monotonic()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and 2 <= time.monotonic() - start < 20
    pattern = (
        rf"error: data worker 1 of 1 \(pid {worker}, stopped by a signal, as kill -STOP does\) delivered nothing "
        r"for [2-9] s, while (waiting for a task|(drawing|sending) batch (\d+) of 100000), with batch (\d+) due "
        r"\(data.worker_timeout=2\): stopped or stuck; the run stopped after step (\d+); its last checkpoint is step "
        r"\d+ in \S+: continue with train.resume=true"
    )
    named = re.fullmatch(pattern, one_error_line(err))  # stopped as it drew a batch, or as it waited for one
    assert named and int(named[4]) == int(named[5]) and named[3] in (None, named[4]), err
    deadline = time.monotonic() + 10
    while any(map(alive, [worker, *held_out])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker) and not any(map(alive, held_out))
