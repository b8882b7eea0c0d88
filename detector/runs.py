"""Run folders that never collide and never lose a user's results.

- ``new_run_dir``: a fresh, timestamped folder per profile run (``<parent>/<YYYYmmdd-HHMMSS>``), so a
  running TensorBoard picks up re-runs and older runs stay comparable.
- ``locked``: one process at a time per run folder (a lock file beside it); a second one is refused
  with the pid of the first.
- ``replacing``: a fresh training run in a folder that holds an older one moves the older one aside
  and deletes it only once the new run has finished; if the new run fails, the older one stays.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from detector.errors import UserError


def new_run_dir(parent: Path) -> Path:
    """Create and return ``parent/<YYYYmmdd-HHMMSS>`` (with a -2, -3 ... suffix if that second is taken)."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in ["", *(f"-{i}" for i in range(2, 1000))]:
        path = parent / f"{stamp}{suffix}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"{parent}: too many runs started in one second")


@contextlib.contextmanager
def locked(run_dir: Path):
    """Hold ``<run_dir>.lock`` for the duration; refuse if another process holds it."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir.with_name(run_dir.name + ".lock")
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise UserError(
                f"{run_dir} is in use by {holder}: wait for it to finish, or give this run another "
                "train.out_dir or experiment"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def replacing(run_dir: Path, say=print):
    """A fresh ``run_dir``; an older one there is kept aside until the body has finished without error."""
    old = None
    if run_dir.exists():
        old = run_dir.with_name(f".{run_dir.name}.previous-{time.time_ns()}")
        os.replace(run_dir, old)
    run_dir.mkdir(parents=True)
    try:
        yield run_dir
    except BaseException:
        if old is not None:
            say(f"the previous run of {run_dir} is kept in {old}")
        raise
    if old is not None:
        shutil.rmtree(old)
