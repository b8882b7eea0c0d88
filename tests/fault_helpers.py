"""What the command-line fault tests share (tests/train/run/test_data_worker_faults.py, test_interrupt.py,
test_write_failures.py, tests/train/observe/test_memory_estimate.py): the tiny detector as `train` runs it from the
command line, the one line a fault ends a command in, and a `train` in a child process followed step by step."""

import signal
import subprocess
import sys

from conftest import ROOT, child_env
from train_helpers import TINY as TRAIN_TINY

# the training tests' tiny detector (tests/train_helpers.py), from the command line, with a checkpoint every 3 steps
# The CPU pinned: the runs these tests stop and resume in child processes are the CPU's (CUDA_VISIBLE_DEVICES=""),
# and a resume in this process must be on the same device for its losses to be the uninterrupted run's.
TINY = [*TRAIN_TINY, "device=cpu", "train.checkpoint_every=3"]


def one_error_line(err: str, prefix: str = "error: ") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


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
