"""The tiny training configuration the training tests share (tests/train/, tests/test_faults.py), and two processes
of a worker for the tests of several processes."""

import time

import pytest
import torch.multiprocessing as mp

from detector.config import load_config

# A detector of a few thousand parameters on 32 px images: a step takes milliseconds.
TINY = [
    "preset=cpu",
    "data.image_size=32",
    "data.max_boxes=16",
    "data.batch_size=4",
    "data.tail_fraction=0.0",
    "model.channels=[4,8]",
    "model.hidden=32",
    "train.lr=0.01",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.eval_batches=1",
]


def tiny_cfg(out_dir, *overrides):
    return load_config([*TINY, f"train.out_dir={out_dir}", *overrides], announce=None)


def losses(summaries) -> list[float]:
    return [loss for s in summaries for _, loss in s["history"]]


def spawn_two(worker, *args, timeout: float = 240.0) -> None:
    """Run worker(rank, *args) in 2 processes; fail, not hang, if they are not done within ``timeout`` s
    (collectives issued in a different order on the two ranks wait for each other forever)."""
    context = mp.spawn(worker, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the 2 DDP processes of {worker.__name__} did not finish in {timeout:.0f} s (a hang)")
