"""Faults from the command line: a data worker killed mid-run, Ctrl-C, and sizes that cannot fit each end a
command in one line with its exit status, never a hang or a traceback, and leave a state that resumes."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, child_env, fails_after
from train_helpers import TINY as TRAIN_TINY

from detector import cli, data
from detector.config import load_config
from detector.loader import GIB, MemoryRefusal
from detector.train import checkpoint
from detector.train.checkpoint import read_checkpoint, save_checkpoint
from detector.train.loop import check_run_memory, run_memory

# the training tests' tiny detector (tests/train_helpers.py), from the command line, with a checkpoint every 3 steps
TINY = [*TRAIN_TINY, "train.checkpoint_every=3"]


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
        r"loaded; the run stopped after step (\d+); its last checkpoint is step (\d+) in \S+checkpoint.pt: continue "
        r"with train.resume=true"
    )
    batch, stopped, kept = map(int, re.fullmatch(pattern, line).groups())
    assert batch == stopped and 4 <= stopped <= 9 and kept == 3 * (stopped // 3)

    monkeypatch.setenv("KILL_WORKER", "0")
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'split'}", "train.resume=true"]) == 0
    straight = read_checkpoint(tmp_path / "straight" / "default" / "padded" / "checkpoint.pt")
    resumed = read_checkpoint(tmp_path / "split" / "default" / "padded" / "checkpoint.pt")
    assert resumed["losses"] == straight["losses"] and len(resumed["losses"]) == 12


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


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
    wait_for_step(process, 2)
    workers = children(process.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    start = time.monotonic()
    _, err = process.communicate(timeout=30)  # reads both pipes: a full one would block the run's last lines
    assert time.monotonic() - start < 10 and process.returncode == 2
    line = one_error_line(err)
    assert f"(pid {workers[1]}) was killed by SIGKILL, exit code -9" in line and "train.resume=true" in line
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)  # a zombie shows until its parent has gone: the other worker ends with it
    assert not [pid for pid in workers if Path(f"/proc/{pid}/status").exists() and alive(pid)]


def alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_is_one_line_exit_130_and_the_run_resumes(tmp_path):
    process = start_training(tmp_path)
    wait_for_step(process, 7)  # past the checkpoint of step 6
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)  # reads both pipes: the steps logged since would fill stdout's
    assert process.returncode == 130
    line = one_error_line(err, "interrupted: ")
    assert "the run stopped after step" in line and "train.resume=true" in line
    (kept,) = [int(s) for s in line.split("its last checkpoint is step ")[1].split()[:1]]
    state = read_checkpoint(tmp_path / "default" / "padded" / "checkpoint.pt")
    assert state["step"] == kept >= 6 and not list((tmp_path / "default" / "padded").glob("*.tmp-*"))
    resume = ["train.steps=100000", f"train.stop_after={kept + 2}", "train.resume=true"]
    assert cli.main(["train", *TINY, f"train.out_dir={tmp_path}", *resume]) == 0
    assert read_checkpoint(tmp_path / "default" / "padded" / "checkpoint.pt")["step"] == kept + 2


def test_ctrl_c_within_the_loop_stops_it_between_steps_and_a_second_at_once():
    """The first SIGINT only sets a flag (no KeyboardInterrupt inside whatever the loop is calling), which the
    loop's check raises at the next step; a second raises where it lands; the handler before is restored."""
    from detector.train.loop import DeferredInterrupt

    before = signal.getsignal(signal.SIGINT)
    with DeferredInterrupt() as interrupt:
        interrupt.check()  # nothing requested yet
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # Python runs the handler at the next bytecode: no exception here
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_of_any_command_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    assert cli.main(["strategies"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_while_a_checkpoint_is_written_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 3})

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"step": 6})
    assert read_checkpoint(path) == {"step": 3} and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


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
    monkeypatch.setattr("detector.loader.available_memory", lambda: 23 * GIB)
    with pytest.raises(MemoryRefusal) as err:
        check_run_memory(cfg, 1, torch.device("cpu"))
    message = str(err.value)
    assert f"needs at least {sum(need.values()) / GIB:.1f} GiB of memory" in message
    assert "the loader's ring of batch slots 30.5 GiB" in message and "has 23.0 GiB available" in message
    small = load_config(["preset=cpu"])
    check_run_memory(small, 1, torch.device("cpu"))  # the CPU preset fits


def test_the_loader_refuses_a_ring_that_cannot_fit(monkeypatch):
    monkeypatch.setattr("detector.loader.available_memory", lambda: GIB)
    cfg = load_config(["preset=cpu", "data.batch_size=1000000", "data.image_size=64", "data.num_workers=0"])
    with pytest.raises(MemoryRefusal, match=r"ring of 2 slots for batches of \[1000000, 1, 64, 64\] uint8 needs 7.6"):
        next(iter(data.build_loader(cfg.data, "padded", "cpu")))


def test_on_a_gpu_the_model_is_checked_against_its_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * GIB, 80 * GIB))  # no GPU here: mocked
    cfg = load_config(["preset=seed_scale"])  # the ~1.1 B-parameter detector: 17.5 GB of state
    with pytest.raises(MemoryRefusal, match=r"needs at least \d+\.\d GiB on cuda:0 .* but it has 4.0 GiB free"):
        check_run_memory(cfg, 1, torch.device("cuda:0"))
