"""Output folders that never collide: every command's own (a profile run, a comparison, a shape report, a finished
report or bench memory) and the work folder of a command that resumes where it stopped.

- ``new_run_dir``: a fresh, timestamped folder (``<parent>/<YYYYmmdd-HHMMSS>``), made atomically: two commands in the
  same second never share one. A running TensorBoard picks up re-runs, and older runs stay comparable.
- ``prepare_work``: the work folder of a command that resumes where it stopped, and ``WorkState``, the record in it
  (report.json) of the overrides it was started with.

A training run's own folder, its lock and the runs it sets aside are train/run/folder.py's.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from detector.checked import RecordError, need, read_json, versioned, write_atomically
from detector.errors import UserError

STATE = "report.json"
STATE_VERSION = 2  # 1: no "version" key
STATE_BYTES = 2**20  # a list of overrides and a time: a few hundred bytes; a larger file is not one


def new_run_dir(parent: Path) -> Path:
    """Create and return ``parent/<YYYYmmdd-HHMMSS>`` (with a -2, -3 ... suffix if that second is taken): the creation
    is the check, so that of two processes in the same second each gets its own. A finished work folder takes its
    time's name by moving into one made here (``os.replace`` onto the new, empty folder)."""
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


@dataclass
class WorkState:
    """A work folder's ``report.json``: the overrides its command was started with (resumed only with the same) and
    when it started."""

    overrides: list[str]
    started: str
    version: int = STATE_VERSION

    def write(self, path: Path) -> None:
        write_atomically(path, json.dumps(asdict(self)).encode())

    @classmethod
    def parse(cls, data, where: str) -> WorkState:
        """The record of parsed JSON; RecordError naming ``where`` and the first field of the wrong shape."""
        versioned(data, where, STATE_VERSION)
        overrides = need(data.get("overrides"), list, f"{where}.overrides")
        return cls(
            overrides=[need(o, str, f"{where}.overrides[{i}]") for i, o in enumerate(overrides)],
            started=need(data.get("started"), str, f"{where}.started"),
        )

    @classmethod
    def read(cls, path: Path) -> WorkState:
        """The state in ``path``; RecordError, one line naming the file and the field, otherwise."""
        return cls.parse(read_json(path, STATE_BYTES), str(path))


def prepare_work(folder: Path, overrides: list[str]) -> Path:
    """``folder/current``, the work folder of a command that resumes where it stopped (make report, bench memory):
    resumed when it was started with the same overrides; otherwise (other overrides, or a state that cannot be read)
    an unfinished one is kept aside as ``folder/unfinished-<time>`` and a fresh one begins."""
    work, state = folder / "current", folder / "current" / STATE
    if work.exists():
        try:
            same, why = WorkState.read(state).overrides == overrides, "with other overrides"
        except RecordError as err:
            same, why = False, f"({err})"
        if same:
            print(f"resuming the unfinished report in {work}/")
            return work
        aside = folder / f"unfinished-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(work, aside)
        print(f"an unfinished report {why} is kept in {aside}/; starting afresh")
    (work / "logs").mkdir(parents=True)
    WorkState(overrides, datetime.now(timezone.utc).isoformat(timespec="seconds")).write(state)
    return work
