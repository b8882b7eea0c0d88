"""Faults from the command line: a data worker killed, stopped or raising mid-run, Ctrl-C (once or twice), SIGTERM,
and sizes that cannot fit each end a command in one line with its exit status, never a hang or a traceback, and
leave a state that resumes."""

import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
from conftest import ROOT, child_env, fails_after
from tensorboard.compat.tensorflow_stub.io import gfile
from torch.distributed.checkpoint import filesystem
from train_helpers import TINY as TRAIN_TINY

from detector import data
from detector.cli import main as cli
from detector.config.schema import load_config
from detector.data.host_memory import GIB, MemoryRefusal
from detector.data.loader import DataWorkerFailed, WorkerTraceback
from detector.train.checkpoints import dcp_io
from detector.train.checkpoints import files as checkpoint_files
from detector.train.checkpoints.state import CheckpointError, read_checkpoint
from detector.train.observe.memory_estimate import check_command_memory, check_run_memory, run_memory
from detector.train.run.interrupt import LAUNCHER_LOST, CommandSignals, DeferredInterrupt, Terminated

# the training tests' tiny detector (tests/train_helpers.py), from the command line, with a checkpoint every 3 steps
# The CPU pinned: the runs these tests stop and resume in child processes are the CPU's (CUDA_VISIBLE_DEVICES=""),
# and a resume in this process must be on the same device for its losses to be the uninterrupted run's.
TINY = [*TRAIN_TINY, "device=cpu", "train.checkpoint_every=3"]


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test after 120 s instead of blocking the suite."""
    with fails_after(120):
        yield


def one_error_line(err: str, prefix: str = "error: ") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


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


def start_training(tmp_path, *overrides) -> subprocess.Popen:
    """`python -m detector train` of the tiny detector, in a session of its own (a process group for Ctrl-C)."""
    args = [*TINY, "train.steps=100000", f"train.out_dir={tmp_path}", "data.num_workers=2", *overrides]
    return subprocess.Popen(
        [sys.executable, "-m", "detector", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(CUDA_VISIBLE_DEVICES=""),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground program
    )


def wait_for_step(process: subprocess.Popen, step: int) -> None:
    for line in process.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= step:
            return
    raise AssertionError(f"the run ended before step {step}: {process.wait()} {process.stderr.read()}")


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


# ----------------------------------------------------------------------------- Ctrl-C and SIGTERM


def test_ctrl_c_is_one_line_exit_130_and_the_run_resumes(tmp_path):
    process = start_training(tmp_path)
    wait_for_step(process, 7)  # past the checkpoint of step 6
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)  # reads both pipes: the steps logged since would fill stdout's
    assert process.returncode == 130
    line = one_error_line(err, "interrupted: ")
    assert "the run stopped after step" in line and "train.resume=true" in line
    (kept,) = [int(s) for s in line.split("its last checkpoint is step ")[1].split()[:1]]
    state = read_checkpoint(tmp_path / "default" / "padded")
    assert state["step"] == kept >= 6 and not list((tmp_path / "default" / "padded").glob("*.tmp-*"))
    resume = ["train.steps=100000", f"train.stop_after={kept + 2}", "train.resume=true"]
    assert cli.main(["train", *TINY, f"train.out_dir={tmp_path}", *resume]) == 0
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == kept + 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_within_the_loop_asks_for_a_stop_between_steps_and_a_second_stops_it_at_once(signum):
    """The first signal only sets a flag (no exception inside whatever the loop is calling), which the loop
    reads at the next step; a second raises where it lands; the handlers before are restored."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    expected = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    with DeferredInterrupt() as interrupt:
        assert interrupt.requested is None  # nothing requested yet
        os.kill(os.getpid(), signum)
        time.sleep(0.01)  # Python runs the handler at the next bytecode: no exception here
        assert interrupt.requested == signum
        with pytest.raises(expected) as err:
            os.kill(os.getpid(), signum)
            time.sleep(1)
        assert type(err.value) is expected
        os.kill(os.getpid(), signum)  # the stop is under way: ignored
        time.sleep(0.01)
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_launchers_death_is_one_stop_however_often_linux_signals_it():
    """kill -9 of detector.cli.launch: Linux sends the rank's parent-death signal (LAUNCHER_LOST) each time the rank's
    parent thread ends, two or three times as the launcher's threads end. In the loop that is one stop asked for, as
    SIGTERM's, never the second signal that abandons the stop's checkpoint; a user's SIGTERM after it still is; and
    it asks nothing where a stop is already asked for. Outside the loop the first raises SIGTERM's stop, once."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, LAUNCHER_LOST)}
    with CommandSignals():
        with DeferredInterrupt() as interrupt:
            for _ in range(3):
                os.kill(os.getpid(), LAUNCHER_LOST)
                time.sleep(0.01)
            assert interrupt.requested == signal.SIGTERM
            with pytest.raises(Terminated):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
    with CommandSignals():
        with DeferredInterrupt() as interrupt:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            os.kill(os.getpid(), LAUNCHER_LOST)
            time.sleep(0.01)
            assert interrupt.requested == signal.SIGINT  # Ctrl-C's stop, not escalated
    with pytest.raises(Terminated):
        with CommandSignals():
            os.kill(os.getpid(), LAUNCHER_LOST)
            time.sleep(1)
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_loop_raises_the_stop_it_was_asked_for_and_ignores_later_signals():
    with DeferredInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert isinstance(interrupt.stop(), Terminated)
        os.kill(os.getpid(), signal.SIGINT)  # during the wind-down: ignored
        time.sleep(0.01)


def test_sigterm_stops_the_run_with_a_checkpoint_in_one_line_exit_143_and_it_resumes_exactly(tmp_path):
    """As a scheduler stops a job: SIGTERM to the process group (the data workers ignore it). The run writes a
    checkpoint of the steps so far and says so in one line; resumed, its losses are an uninterrupted run's."""
    process = start_training(tmp_path / "split")
    wait_for_step(process, 7)
    os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 143
    pattern = (
        r"terminated: the run stopped after step (\d+); its last checkpoint is step (\d+) in (\S+): continue with "
    )
    stopped, kept, path = re.fullmatch(pattern + "train.resume=true", one_error_line(err, "terminated: ")).groups()
    assert int(stopped) == int(kept) >= 7 and read_checkpoint(Path(path).parent)["step"] == int(kept)
    run = [*TINY, "train.steps=100000", f"train.stop_after={int(kept) + 2}"]
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'split'}", "train.resume=true"]) == 0
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'straight'}"]) == 0
    resumed = read_checkpoint(tmp_path / "split" / "default" / "padded")["losses"]
    straight = read_checkpoint(tmp_path / "straight" / "default" / "padded")["losses"]
    assert resumed == straight and len(straight) == int(kept) + 2


@pytest.mark.parametrize("apart", [0.05, 0.3])
def test_ctrl_c_twice_prints_the_one_line_and_nothing_after(tmp_path, apart):
    """The second Ctrl-C lands in the checkpoint, the workers' or the writer's closing, or the interpreter's exit
    (atexit): ignored, since the stop is under way; nothing but the one line is printed."""
    process = start_training(tmp_path)
    wait_for_step(process, 3)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(apart)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)
    line = one_error_line(err, "interrupted: ")
    assert process.returncode == 130 and "the run stopped after step" in line
    # the checkpoint the line names is the one the manifest commits (a save the second signal cut short never is)
    kept = re.search(r"its last checkpoint is step (\d+) in (\S+checkpoint.json)", line)
    if kept:
        assert read_checkpoint(Path(kept[2]).parent)["step"] == int(kept[1]), line
    else:
        assert "no checkpoint was written" in line and not list(tmp_path.rglob("checkpoint.json")), line
        assert "train.checkpoint_every" not in line, line  # checkpoints were on: the line says what became of them


def test_sigterm_of_any_command_is_one_line_and_exit_143(monkeypatch, capsys):
    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # the command's own handler turns it into Terminated
        time.sleep(5)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "run", terminated)
    assert cli.main(["strategies"]) == 143
    assert capsys.readouterr().err == "terminated\n" and signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_of_any_command_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    assert cli.main(["strategies"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.fixture(scope="module")
def stopped_once(tmp_path_factory):
    """`train` of TINY's 6 steps stopped after step 3 (its checkpoint), trained once for the module: its out_dir."""
    out = tmp_path_factory.mktemp("stopped")
    assert cli.main(["train", *TINY, "train.steps=6", f"train.out_dir={out}", "train.stop_after=3"]) == 0
    return out


@pytest.fixture
def stopped(stopped_once, tmp_path):
    """``tmp_path`` holding a copy of that run (resume's checks ignore train.out_dir, a run control)."""
    shutil.copytree(stopped_once, tmp_path, symlinks=True, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("where", ["the data", "the checksums", "the manifest"])
def test_a_save_stopped_anywhere_keeps_the_previous_checkpoint(stopped, tmp_path, monkeypatch, where, capsys):
    """The writer of step 6's save fails (a full disk, a kill) while DCP writes its files, while they are checksummed
    or while the manifest is replaced: the manifest still names step 3's checkpoint, which resumes; the run says what
    failed, in one line."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3
    owner, name = {
        "the data": (dcp_io.Writer, "write_data"),
        "the checksums": (checkpoint_files, "file_entry"),
        "the manifest": (checkpoint_files, "commit"),
    }[where]

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(owner, name, failing)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "No space left on device" in line and "the last checkpoint is step 3" in line, line
    monkeypatch.undo()
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == 3
    summary = cli.main(["train", *run, "train.resume=true", "train.stop_after=4"])
    assert summary == 0 and read_checkpoint(tmp_path / "default" / "padded")["step"] == 4


# ----------------------------------------------------------------------------- a thread's failure


def test_a_full_disk_in_a_writer_thread_of_dcps_is_the_saves_line_and_no_traceback(
    stopped, tmp_path, monkeypatch, capsys
):
    """DCP writes a save's second file in a thread of its own, whose exception Python's hook printed as a traceback
    (`Exception in thread Thread-3 (_write_files_from_queue)`) while DCP carried on without its items. The save fails
    in the run's one line, naming its step and the checkpoint kept; --debug prints the thread's traceback too."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3
    write = filesystem._write_files_from_queue

    def _write_files_from_queue(*args, **kwargs):  # the name Python gives DCP's thread, after its target
        if threading.current_thread().name != "checkpoint-writer":  # DCP's own thread, not the save's
            args[1].get_nowait()  # a file of the save taken from the queue, then the disk is full
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_files_from_queue", _write_files_from_queue)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: the checkpoint of step 6 could not be written ([Errno 28] No space left on device); the last "
        f"checkpoint is step 3 in {tmp_path / 'default' / 'padded' / 'checkpoint.json'}"
    )
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == 3  # never committed without its items
    hook = threading.excepthook
    with pytest.raises(CheckpointError) as debug:
        cli.main(["train", "--debug", *run, "train.resume=true"])
    assert "in _write_files_from_queue" in "".join(traceback.format_exception(debug.value.__cause__))
    assert threading.excepthook is hook  # restored after a command called in a process


def fail_tensorboard(monkeypatch, after: int, err: OSError) -> None:
    """TensorBoard's event writer fails with ``err`` in its thread (as on a full disk) from its ``after``-th write."""
    writes = []

    def failing(self, filename, content, mode):
        writes.append(filename)
        if len(writes) > after:
            raise err
        return write(self, filename, content, mode)

    write = gfile.LocalFileSystem._write
    monkeypatch.setattr(gfile.LocalFileSystem, "_write", failing)


def test_tensorboards_writer_failing_in_its_thread_stops_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """A full disk under TensorBoard's event writer: its thread printed a traceback, then the loop's next write raised
    its exception again, which was the run's whole line: `error: [Errno 28] No space left on device`."""
    run = [*TINY, "train.steps=12", f"train.out_dir={tmp_path}"]
    fail_tensorboard(monkeypatch, 40, OSError(28, "No space left on device"))
    assert cli.main(["train", *run]) == 2
    err = capsys.readouterr().err
    pattern = (
        rf"error: TensorBoard's event file in {tmp_path / 'default' / 'padded'} could not be written \(\[Errno 28\] No "
        r"space left on device\); the run stopped after step (\d+); its last checkpoint is step (\d+) in \S+"
        r"checkpoint.json: continue with train.resume=true"
    )
    stopped, kept = map(int, re.fullmatch(pattern, one_error_line(err)).groups())
    assert 3 <= kept <= stopped and kept % 3 == 0  # the line names the checkpoint the manifest does
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == kept


def test_a_run_folder_tensorboard_may_not_write_in_is_a_path_not_bytes(stopped, tmp_path, monkeypatch, capsys):
    """A resume into a folder made immutable (chattr +i): TensorBoard's writer, which names its file in bytes, failed
    in its thread with a traceback, and the line was `[Errno 1] Operation not permitted: b'.../events.out...'`."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3
    folder = tmp_path / "default" / "padded"

    def refused(self, filename, content, mode):
        raise PermissionError(1, "Operation not permitted", filename)  # bytes, as TensorBoard's GFile gives it

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", refused)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert re.fullmatch(
        rf"error: \[Errno 1\] Operation not permitted: '{folder}/events\.out\.tfevents\.\S+'; the run stopped after "
        rf"step 3; its last checkpoint is step 3 in {folder / 'checkpoint.json'}: continue with train.resume=true",
        line,
    ), line


def test_tensorboards_writer_failing_as_a_save_fails_leaves_the_saves_line(stopped, tmp_path, monkeypatch, capsys):
    """A full disk fails the save, then TensorBoard's writer as the run closes it: its exception replaced the save's
    line with `error: [Errno 28] No space left on device`."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3

    def full(*args, **kwargs):
        fail_tensorboard(monkeypatch, 0, OSError(28, "No space left on device"))  # from now on
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_io.Writer, "write_data", full)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: the checkpoint of step 6 could not be written ([Errno 28] No space left on device)")
    assert "the last checkpoint is step 3" in line


def test_a_threads_failure_nothing_said_is_one_warning_line_as_the_command_ends(monkeypatch, capsys):
    """Where no line of the command says it (the command ended well), and never a traceback."""

    def raises_in_a_thread(*args):
        thread = threading.Thread(target=lambda: 1 / 0, name="eval-picture")
        thread.start()
        thread.join()
        return 0

    monkeypatch.setattr(cli, "run", raises_in_a_thread)
    assert cli.main(["strategies"]) == 0
    assert capsys.readouterr().err == (
        "warning: thread eval-picture ended with ZeroDivisionError: division by zero (its traceback: --debug)\n"
    )


# ----------------------------------------------------------------------------- sizes that cannot fit


def test_a_batch_that_cannot_fit_is_refused_before_anything_is_allocated(capsys):
    start = time.monotonic()
    assert cli.main(["train", "--experiment", "cpu_smoke", "data.batch_size=100000000", "train.steps=2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert time.monotonic() - start < 30
    assert "this run needs at least" in line and "GiB available (MemAvailable)" in line
    assert "the loader's ring of batch slots" in line and "lower data.batch_size" in line


def test_the_estimate_names_each_part_and_the_memory_available(monkeypatch):
    cfg = load_config(["preset=cpu", "data.batch_size=2000000", "data.image_size=64", "data.num_workers=1"])
    need = run_memory(cfg, 1, torch.device("cpu"))
    assert need["the loader's ring of batch slots"] == 4 * 2_000_000 * 64 * 64  # 2 slots a worker, 2 more
    assert need["the held-out images"] == 4 * 2_000_000 * 64 * 64  # train.eval_batches batches
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 23 * GIB)
    with pytest.raises(MemoryRefusal) as err:
        check_run_memory(cfg, 1, torch.device("cpu"))
    message = str(err.value)
    assert f"needs at least {sum(need.values()) / GIB:.1f} GiB of memory" in message
    assert "the loader's ring of batch slots 30.5 GiB" in message and "has 23.0 GiB available" in message
    assert "of which a command may take 2/3, 15.3 GiB" in message
    small = load_config(["preset=cpu"])
    check_run_memory(small, 1, torch.device("cpu"))  # the CPU preset fits


def test_the_loader_refuses_a_ring_that_cannot_fit(monkeypatch):
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: GIB)
    cfg = load_config(["preset=cpu", "data.batch_size=1000000", "data.image_size=64", "data.num_workers=0"])
    # 7.6 GiB of images and 0.5 of target areas (64 slots of 4 uint8 coordinates an image)
    with pytest.raises(
        MemoryRefusal, match=r"of 2 slots for batches of \[1000000, 1, 64, 64\] uint8 and their targets needs 8.1"
    ):
        next(iter(data.build_loader(cfg.data, "padded", "cpu")))


def test_on_a_gpu_the_model_is_checked_against_its_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * GIB, 80 * GIB))  # no GPU here: mocked
    cfg = load_config(["preset=seed_scale"])  # the ~1.1 B-parameter detector: 17.5 GB of state
    with pytest.raises(MemoryRefusal, match=r"needs at least \d+\.\d GiB on cuda:0 .* but it has 4.0 GiB free"):
        check_run_memory(cfg, 1, torch.device("cuda:0"))


def test_a_margin_is_kept_below_the_memory_available(monkeypatch):
    """16 GiB asked with 22 GiB available heads for the out-of-memory killer: refused; with 25 GiB it fits."""
    cfg = load_config(["preset=cpu", "data.image_size=64", "data.num_workers=0", "data.batch_size=70000"])
    need = sum(run_memory(cfg, 1, torch.device("cpu")).values())
    assert 15 * GIB < need < 16.5 * GIB  # about 16 GiB, most of it the activations
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 22 * GIB)
    with pytest.raises(MemoryRefusal, match=r"this run needs at least 1\d\.\d GiB .* has 22\.0 GiB available"):
        check_run_memory(cfg, 1, torch.device("cpu"))
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 25 * GIB)
    check_run_memory(cfg, 1, torch.device("cpu"))


@pytest.mark.parametrize(
    "command", [["profile", "profile.timed=0"], ["bench", "step"], ["train", "train.steps=2", "train.eval_batches=1"]]
)
def test_each_command_refuses_what_cannot_fit_in_one_line_before_allocating_it(command, tmp_path, monkeypatch, capsys):
    """16 GiB of activations with 12 GiB available: refused with the figures by profile, bench step and train alike,
    before a model is built or a folder written."""
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 12 * GIB)
    where = {"profile": "profile.out_dir", "bench": "bench.out", "train": "train.out_dir"}[command[0]]
    start = time.monotonic()
    size = ["device=cpu", "preset=cpu", "data.image_size=64", "data.batch_size=80000", "data.length=100000000"]
    assert cli.main([*command, *size, f"{where}={tmp_path / 'out'}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert time.monotonic() - start < 60 and not (tmp_path / "out").exists()
    subject = {"profile": "this profile", "bench": "bench step", "train": "this run"}[command[0]]
    assert re.match(rf"error: {subject} needs at least \d+\.\d GiB of memory \(", line), line
    assert re.search(r"the activations of a batch 1\d\.\d GiB.* has 12\.0 GiB available \(MemAvailable\)", line), line
    assert "lower data.batch_size" in line


@pytest.mark.parametrize("command", [["profile"], ["bench", "step"]])
def test_a_batch_larger_than_the_data_is_one_line(command, tmp_path, capsys):
    where = {"profile": "profile.out_dir", "bench": "bench.out"}[command[0]]
    out = f"{where}={tmp_path / 'out'}"
    assert cli.main([*command, "preset=cpu", "data.batch_size=2000000", "data.image_size=64", out]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: data.batch_size=2000000 is larger than data.length=1000000: not one batch can be drawn; lower "
        "data.batch_size or raise data.length"
    )
    if command == ["profile"]:  # 5 + 5 + 10 + 10 batches of the profiler's schedule and the timed steps
        assert cli.main(["profile", "preset=cpu", "data.batch_size=10", "data.length=100", out]) == 2
        assert one_error_line(capsys.readouterr().err) == (
            "error: this profile reads 30 batches of data.batch_size=10 images (300), more than data.length=100: "
            "raise data.length"
        )
    assert not (tmp_path / "out").exists()


def test_on_a_gpu_a_profile_is_checked_against_its_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * GIB, 80 * GIB))  # no GPU here: mocked
    cfg = load_config(["preset=seed_scale"])  # 17.5 GB of weights, gradients and AdamW's moments
    with pytest.raises(MemoryRefusal, match=r"this profile needs at least \d+\.\d GiB on cuda:0 \(the model with"):
        check_command_memory(cfg, torch.device("cuda:0"), "profile", batches=30)
    forward = load_config(["preset=seed_scale", "profile.mode=forward", "data.batch_size=64"])  # weights only
    check_command_memory(forward, torch.device("cuda:0"), "profile", batches=30)
