"""Output folders that never collide: every command's own (a profile run, a comparison, a shape report, a finished
report or bench memory) and the work folder of a command that resumes where it stopped.

- ``new_run_dir``: a fresh, timestamped folder (``<parent>/<YYYYmmdd-HHMMSS>``), made atomically: two commands in the
  same second never share one. A running TensorBoard picks up re-runs, and older runs stay comparable.
- ``prepare_work``: the work folder of a command that resumes where it stopped.

A training run's own folder, its lock and the runs it sets aside are train/run_folder.py's.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from detector.errors import UserError


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


def prepare_work(folder: Path, overrides: list[str]) -> Path:
    """``folder/current``, the work folder of a command that resumes where it stopped (make report, bench memory):
    resumed when it was started with the same overrides; otherwise an unfinished one is kept aside as
    ``folder/unfinished-<time>`` and a fresh one begins."""
    work, state = folder / "current", folder / "current" / "report.json"
    if work.exists():
        try:
            same = json.loads(state.read_text())["overrides"] == overrides
        except (OSError, ValueError, KeyError, TypeError):
            same = False
        if same:
            print(f"resuming the unfinished report in {work}/")
            return work
        aside = folder / f"unfinished-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(work, aside)
        print(f"an unfinished report with other overrides is kept in {aside}/; starting afresh")
    (work / "logs").mkdir(parents=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    state.write_text(json.dumps({"overrides": overrides, "started": started}))
    return work
