"""Several processes as users live them, on gloo: a stop that every process agrees on, a process that dies, SIGTERM
under torchrun (detector.cli.launch), and a resume that continues exactly."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import ROOT, child_env
from train_helpers import TINY, spawn_two

from detector.errors import PeerLost, UserError
from detector.train.checkpoints.state import read_checkpoint
from detector.train.distributed.processes import Control, DistEnv, shared_folder

RUN = [*TINY, "device=cpu", "data.num_workers=0", "train.checkpoint_every=3"]


# ----------------------------------------------------------------------------- the control group


def _votes(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    control = Control(DistEnv(rank, 2, True))
    decided = [control.stop_vote(rank == 1 and step == 3) for step in range(6)]  # rank 1 alone is asked, at 3
    token = control.broadcast(f"token of rank {rank}")
    Path(out, f"rank{rank}.json").write_text(json.dumps({"decided": decided, "token": token}))
    dist.barrier()
    dist.destroy_process_group()


def test_every_process_stops_at_the_same_step_when_one_is_asked(tmp_path):
    spawn_two(_votes, str(tmp_path), timeout=60)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["decided"] == [False] * 4 + [True, False], rank  # asked at 3: decided at the next step, by both
        assert result["token"] == "token of rank 0"


def _loses_a_peer(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    control = Control(DistEnv(rank, 2, True))
    # both ends of the control group connected before rank 1 dies: a death while gloo still connects it is
    # new_group's "Connection closed by peer" on rank 0, not the lost peer this test is about
    dist.barrier()
    control.stop_vote(False)
    if rank == 1:
        os._exit(0)  # as a killed process: no goodbye to the group
    start, found = time.monotonic(), "no error"
    try:
        for _ in range(100):
            control.stop_vote(False)
            time.sleep(0.05)
    except PeerLost as err:
        found = str(err)
    Path(out, "rank0.txt").write_text(f"{time.monotonic() - start:.1f} {found}")
    os._exit(0)


def test_a_process_that_dies_stops_the_others_at_their_next_step(tmp_path):
    spawn_two(_loses_a_peer, str(tmp_path), timeout=60)
    seconds, found = (tmp_path / "rank0.txt").read_text().split(" ", 1)
    assert found.startswith("another process of this run stopped") and float(seconds) < 5, found


# ----------------------------------------------------------------------------- under torchrun


def launch(out: Path, *overrides: str) -> subprocess.Popen:
    """`make train NPROC=2`'s command, in a session of its own, its ranks on gloo; its temporary files in out/tmp."""
    args = ["-m", "detector.cli.launch", "--standalone", "--nproc_per_node=2", "-m", "detector", "train"]
    args += [*RUN, f"train.out_dir={out}", *overrides]
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TMPDIR=str(out / "tmp")),
        start_new_session=True,
    )


def wait_for_step(process: subprocess.Popen, step: int) -> None:
    for line in process.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= step:
            return
    raise AssertionError(f"the run ended before step {step}: {process.wait()} {process.stderr.read()}")


def wait_for_line(process: subprocess.Popen, start: str) -> None:
    for line in process.stdout:
        if line.startswith(start):
            return
    raise AssertionError(f"the run ended before {start!r}: {process.wait()} {process.stderr.read()}")


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of ``rank`` among the launcher's children (by its RANK variable)."""
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no rank {rank} under {launcher}")


def one_line(err: str, prefix: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_a_rank_killed_is_one_line_naming_it_and_the_checkpoint_and_the_resume_continues_exactly(tmp_path):
    straight = launch(tmp_path / "straight", "train.steps=12")
    out, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err
    # the launcher's folder and torchrun's log folder (which torchrun itself leaves at every launch) are gone
    assert not list((tmp_path / "straight" / "tmp").iterdir())

    process = launch(tmp_path / "split", "train.steps=12")
    wait_for_line(process, "checkpoint step 6:")  # committed
    victim = rank_pid(process.pid, 1)
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1 and time.monotonic() - start < 35  # torchrun's grace at most
    line = one_line(err, "failed: ")
    pattern = (
        rf"failed: rank 1 of 2 \(pid {victim}\) was killed by SIGKILL, and torchrun stopped the others; its last "
        r"checkpoint is step (\d+) in (\S+checkpoint.json): continue with (.+)"
    )
    kept, manifest, command = re.fullmatch(pattern, line).groups()
    assert int(kept) >= 6 and read_checkpoint(Path(manifest).parent)["step"] == int(kept)

    again = subprocess.run(
        shlex.split(command), capture_output=True, text=True, cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES="")
    )
    assert again.returncode == 0 and f"resuming {Path(manifest).parent} at step {kept}" in again.stdout, again.stderr
    summaries = [
        json.loads(next((tmp_path / name).rglob("summary.json")).read_text()) for name in ("split", "straight")
    ]
    assert summaries[0]["losses"] == summaries[1]["losses"] and len(summaries[1]["losses"]) == 12  # gloo: to the bit


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)])
def test_two_signals_of_two_kinds_end_with_the_first_ones_word_and_its_status(tmp_path, first, second):
    """A scheduler's SIGTERM, then a user's Ctrl-C (or the other way round), to the whole group: every process stops
    on the first, and the line's word and the exit status are both the first's (torchrun's own is its last)."""
    process = launch(tmp_path, "train.steps=100000")
    wait_for_step(process, 7)
    os.killpg(process.pid, first)
    time.sleep(0.2)
    os.killpg(process.pid, second)
    _, err = process.communicate(timeout=60)
    word = {signal.SIGTERM: "terminated: ", signal.SIGINT: "interrupted: "}[first]
    line = one_line(err, word)
    assert process.returncode == 128 + first, (process.returncode, line)
    match = re.search(r"its last checkpoint is step (\d+) in (\S+):", line)
    if match:  # the line names the checkpoint the manifest commits
        assert read_checkpoint(Path(match[2]).parent)["step"] == int(match[1]), line


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_sigterm_under_torchrun_checkpoints_every_rank_and_ends_in_one_line_with_143(tmp_path):
    """As a scheduler preempts a job: SIGTERM to torchrun, which sends it to every rank and kills them 30 s later.
    The ranks agree on a step, checkpoint it and end, each with 143; the run says so in one line."""
    process = launch(tmp_path, "train.steps=100000")
    wait_for_step(process, 7)
    ranks = [rank_pid(process.pid, rank) for rank in (0, 1)]
    process.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143 and time.monotonic() - start < 30, err
    pattern = (
        r"terminated: the run stopped after step (\d+); its last checkpoint is step (\d+) in (\S+): continue with "
    )
    stopped, kept, path = re.fullmatch(pattern + "train.resume=true", one_line(err, "terminated: ")).groups()
    assert stopped == kept and read_checkpoint(Path(path).parent)["step"] == int(kept)
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]  # none left for torchrun's SIGKILL


def test_a_run_folder_that_not_every_process_sees_is_refused_before_the_first_step(tmp_path):
    """Every process writes its part of a checkpoint into the run folder: a second node that sees another disk there
    (its own) is refused in one line, and process 0's mark is removed."""

    class OtherDisk:  # rank 1 finds nothing where rank 0 left its mark
        def broadcast(self, value):
            return value

        def gather(self, value):
            return [value, False]

    with pytest.raises(UserError, match=r"rank\(s\) \[1\] do not see the run folder .* every node shares"):
        shared_folder(tmp_path, "mark", OtherDisk(), is_main=True)
    assert not list(tmp_path.iterdir())


BOOM_FILE = """
import os

from detector.losses import giou_loss_reference


def boom(pred, targets):
    boom.calls += 1
    if os.environ["RANK"] == "1" and boom.calls == 5:
        raise RuntimeError("boom on rank 1 at step 5")
    return giou_loss_reference(pred, targets)


boom.calls = 0
boom.layout = "padded"
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_a_rank_that_raises_ends_every_rank_in_one_line_naming_it(tmp_path):
    """The most common way a rank dies: an exception on one rank alone, while the other waits for it inside the step's
    collective. Both end within seconds, and one line names the rank, its error, the checkpoint and the command."""
    (tmp_path / "boom_loss.py").write_text(BOOM_FILE)
    env = child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    args = ["-m", "detector.cli.launch", "--standalone", "--nproc_per_node=2", "-m", "detector", "train"]
    args += [*RUN, "train.steps=1000", "train.strategy=boom_loss:boom", f"train.out_dir={tmp_path / 'out'}"]
    start = time.monotonic()
    process = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    elapsed = time.monotonic() - start
    line = one_line(process.stderr, "error: rank 1 of 2 (pid ")
    assert process.returncode == 2 and elapsed < 60, (process.returncode, elapsed, process.stderr)
    assert (
        "failed: strategy 'boom_loss:boom' raised RuntimeError: boom on rank 1 at step 5 (boom_loss.py, line 10)"
        in line
    )
    assert re.search(
        r"torchrun stopped the others; its last checkpoint is step 3 in \S+checkpoint.json: continue with ", line
    )


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through Linux's /proc")
def test_ranks_never_outlive_their_launcher(tmp_path):
    """kill -9 of the launcher, which can do nothing about it: its ranks get SIGTERM (the parent-death signal), agree on
    a step, checkpoint it and end; their line names the checkpoint the manifest commits."""
    process = launch(tmp_path, "train.steps=100000")
    wait_for_step(process, 7)
    ranks = [rank_pid(process.pid, rank) for rank in (0, 1)]
    threading.Thread(target=process.stdout.read, daemon=True).start()  # the ranks' lines: never a full pipe
    process.kill()
    process.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in ranks if alive(pid)]
    kept = re.search(
        r"its last checkpoint is step (\d+) in (\S+checkpoint.json)", one_line(process.stderr.read(), "terminated: ")
    )
    assert int(kept[1]) >= 3 and read_checkpoint(Path(kept[2]).parent)["step"] == int(kept[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped by whoever adopted it, does not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_the_launcher_takes_the_first_stop_signal_and_ignores_the_next_while_the_ranks_stop():
    """Ctrl-C twice to `make train NPROC=2`: torchrun's handler raised its exception at the second Ctrl-C too, inside
    its wait for the stopping ranks, which broke the wait off and ended the launch without rank 0's line (2 in 13 tries
    with the two 0.02-0.05 s apart). The launcher's handler takes the first stop signal and ignores the next ones."""
    import signal

    from detector.cli.launch import stop_once

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = []

    def torchruns(signum, frame):
        seen.append(signum)
        raise RuntimeError("torchrun's SignalException")

    try:
        handler = stop_once(torchruns)
        for s in before:
            signal.signal(s, handler)
        with pytest.raises(RuntimeError):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C: ignored
        os.kill(os.getpid(), signal.SIGTERM)  # and a scheduler's SIGTERM after it
        time.sleep(0.05)
        assert seen == [signal.SIGINT]
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in before)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
