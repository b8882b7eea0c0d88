"""The tiny training configuration the training tests share (tests/train/, tests/cli/test_launch.py), and two processes
of a worker for the tests of several processes."""

import gc
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from detector.config.schema import load_config
from detector.train.distributed import processes as distributed

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


# a short run of it with a checkpoint halfway: what a resume, a stop or a failure is tried on
RUN = ["train.steps=6", "train.checkpoint_every=3"]


def tiny_cfg(out_dir, *overrides):
    return load_config([*TINY, f"train.out_dir={out_dir}", *overrides], announce=None)


def run_dir(tmp_path, strategy="padded"):
    return tmp_path / "default" / strategy


def losses(summaries) -> list[float]:
    return [loss for s in summaries for _, loss in s["history"]]


def spawn_two(worker, *args, timeout: float = 240.0) -> None:
    """Run worker(rank, *args) in 2 processes, then end the process group the worker left (``end_group``); fail, not
    hang, if they are not done within ``timeout`` s (collectives issued in a different order on the two ranks wait
    for each other forever)."""
    context = mp.spawn(_then_end_group, args=(worker, *args), nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the 2 DDP processes of {worker.__name__} did not finish in {timeout:.0f} s (a hang)")


def _then_end_group(rank: int, worker, *args) -> None:
    distributed.before_groups()  # as make train's set-up does before it makes its group (the worker makes it here)
    worker(rank, *args)
    end_group()


def end_group() -> None:
    """Destroy this process's process group, if any, as `make train` does (distributed.teardown), and check that
    gloo's threads have ended with it.

    Why: a gloo thread drops its reference to a finished collective after the caller's wait() has returned; where it
    is the last one, freeing the collective's tensors takes the GIL, and a thread that asks for the GIL while the
    interpreter finalizes is ended by CPython inside a C++ destructor: std::terminate ("terminate called without an
    active exception"), SIGABRT, whenever that thread runs late (a loaded machine). destroy_process_group joins those
    threads only where it drops the group's last reference: whatever still holds the group (a model's DDP, a
    sharing's reference cycles, a cache of torch's) must be freed first, and teardown does so."""
    if dist.is_initialized():
        distributed.teardown(distributed.DistEnv(owns_group=True))
    left = gloo_threads()
    assert not left, f"gloo's threads {left} outlive destroy_process_group; held by: {group_holders() or 'C++ alone'}"


def group_holders() -> list[str]:
    """The Python objects that still reference a process group, each with the types of what holds it in turn."""
    holders = []
    for obj in gc.get_objects():
        if any(type(ref).__name__.startswith("ProcessGroup") for ref in gc.get_referents(obj)):
            owners = {type(owner).__qualname__ for owner in gc.get_referrers(obj) if owner is not holders}
            holders.append(f"{type(obj).__qualname__} (in {', '.join(sorted(owners)) or 'nothing tracked'})")
    return holders


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (pt_gloo_runloop, gloo_tcp_loop); none where /proc cannot tell."""
    names = []
    for task in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(task.read_text().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return [name for name in names if "gloo" in name]
