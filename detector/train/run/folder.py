"""A training run's folder, which never loses a user's results.

- ``locked``: one process at a time per run folder (a lock file beside it, removed when the run ends); a
  second one is refused with the pid of the first.
- ``set_aside``: a fresh training run in a folder that holds an earlier one moves the earlier one to a
  visible sibling, ``<run>-<YYYYmmdd-HHMMSS of its start>``, and says so in one line. Nothing is deleted
  and nothing is hidden: a re-run never destroys results, and a folder set aside is a run TensorBoard
  shows beside the new one. (Earlier versions hid them as ``.<run>.previous-<n>``; ``reveal_hidden``
  gives those their visible name.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from detector.checked import RecordError
from detector.errors import UserError
from detector.train import checkpoints
from detector.train.observe import summary


def run_name(tcfg) -> str:
    """The run folder's name: the strategy and the speed options that change what is measured."""
    options = [name for name in ("compile", "cuda_graphs", "float8") if tcfg[name]]
    return "+".join([tcfg.strategy, *options])


def experiment_name(experiment: str | None) -> str:
    """The run folder's experiment: the YAML file's stem, ``default`` without one."""
    return Path(experiment).stem if experiment else "default"


def run_path(cfg, experiment: str | None) -> Path:
    """Where a training run of ``cfg`` under ``experiment`` (its YAML file; None: none) keeps its files."""
    return Path(cfg.train.out_dir) / experiment_name(experiment) / run_name(cfg.train)


@contextlib.contextmanager
def early_check(cfg, experiment: str | None):
    """The checks of the checkpoint a `train` command will likely continue (train.resume not false, a checkpoint of an
    unfinished run in its folder), begun now in the background and stopped when the command ends; None where there
    is none. The resume takes their outcome (``checkpoints.Verification``)."""
    checks = None
    if cfg.train.resume != "false":
        checks = checkpoints.Verification.start(run_path(cfg, experiment), cfg.train.steps)
    try:
        yield checks
    finally:
        if checks is not None:
            checks.cancel()


@contextlib.contextmanager
def locked(run_dir: Path):
    """Hold ``<run_dir>.lock`` for the duration, and remove it after; refuse if another process holds it."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir.with_name(run_dir.name + ".lock")
    lock = acquire(lock_path, run_dir)
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # before the lock is released: whoever takes it next makes a new file
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def acquire(lock_path: Path, run_dir: Path):
    """The open lock file, locked; a UserError naming the holder if another process has it. A file that its
    holder removed while we waited to lock it is no lock: then the new one is taken."""
    while True:
        lock = open(lock_path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise UserError(
                f"{run_dir} is in use by {holder}: wait for it to finish, or give this run another "
                "train.out_dir or experiment"
            ) from None
        try:
            if os.stat(lock_path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()


def start(run_dir: Path, cfg, fresh: bool, say=print) -> None:
    """Ready ``run_dir`` for a run: a fresh one sets an earlier run aside (``set_aside``); config.yaml is written."""
    if fresh:
        set_aside(run_dir, say)
    OmegaConf.save(cfg, run_dir / "config.yaml")


def set_aside(run_dir: Path, say=print) -> Path | None:
    """Move the earlier run in ``run_dir`` (if it holds anything) to a visible sibling named by its start and
    say where, and for an unfinished run with a checkpoint how to continue it instead; ``run_dir`` is then an
    empty folder. Returns where the earlier run went, or None."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not any(run_dir.iterdir()):
        return None
    aside = free_name(run_dir, started(run_dir))
    os.replace(run_dir, aside)
    run_dir.mkdir()
    line = f"{run_dir} held an earlier run ({describe(aside)}): moved to {aside}/ (nothing is deleted)"
    if checkpoints.exists(aside) and unfinished(aside):
        line += (
            f". It was unfinished: to continue it instead, stop this run, move {aside}/ back to {run_dir}/ and run "
            "its own configuration again (its config.yaml)"
        )
    say(line)
    return aside


def reveal_hidden(run_dir: Path, say=print) -> None:
    """Give the hidden ``.<run>.previous-<n>`` folders of earlier versions a visible name, and say so."""
    for hidden in sorted(run_dir.parent.glob(f".{run_dir.name}.previous-*")):
        if hidden.is_dir():
            visible = free_name(run_dir, started(hidden))
            os.replace(hidden, visible)
            say(f"an earlier run of {run_dir} was hidden in {hidden.name}/: moved to {visible}/")


def free_name(run_dir: Path, when: float) -> Path:
    """``<run_dir>-<YYYYmmdd-HHMMSS of when>``, with -2, -3 ... if taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    for suffix in ["", *(f"-{i}" for i in range(2, 1000))]:
        path = run_dir.with_name(f"{run_dir.name}-{stamp}{suffix}")
        if not path.exists():
            return path
    raise UserError(f"{run_dir}: too many earlier runs started at {stamp}")


def started(folder: Path) -> float:
    """When the run in ``folder`` started: its first TensorBoard event file was created then (the time is in
    the file's name; its config.yaml is rewritten on resume), else its oldest file's modification."""
    stamps = [p.name.split(".")[3] for p in folder.glob("events.out.tfevents.*")]
    stamps = [int(stamp) for stamp in stamps if stamp.isdigit()]
    return min(stamps or [p.stat().st_mtime for p in folder.iterdir()] or [folder.stat().st_mtime])


def unfinished(folder: Path) -> bool:
    """Whether the run in ``folder`` stopped before its train.steps (killed, or train.stop_after)."""
    try:
        return summary.read(folder).steps < OmegaConf.load(folder / "config.yaml").train.steps
    except (RecordError, OSError, ValueError, AttributeError):
        return True


def describe(folder: Path) -> str:
    """A run folder in a few words: how far it got, and its size on disk."""
    try:
        found = summary.read(folder)
        what = f"{found.steps} steps, final loss {found.final_loss:.4f}"
    except RecordError:
        what = "no summary: unfinished" + (", with a checkpoint" if checkpoints.exists(folder) else "")
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return f"{what}; {size / 2**20:.1f} MiB" if size < 2**30 else f"{what}; {size / 2**30:.1f} GiB"
