"""One way to run a child command of the lab's and the benches' (make report's parts, bench memory's, the scaling
table's runs): ``python <args>`` in a process of its own, its output kept in a log (and shown, indented, where
asked), stopped at its time limit where it has one, and its part marked done once it succeeded, so that a command
stopped half-way resumes after it.

The child stays in the parent's process group: a Ctrl-C at the terminal reaches both. The parent then gives the child
up to STOP_SECONDS to end by itself (a training child checkpoints the steps since its last save) before it kills it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from detector.lab.record.provenance import now, quote

STOP_SECONDS = 30.0  # a child's own stop on Ctrl-C: a training run's takes up to 20 s (its last save), then its exit


@dataclass
class Child:
    """A child command: its title, its arguments after ``python``, its time limit, what it changes of the
    environment, and the file that exists once it has run."""

    title: str
    args: list[str]
    seconds: float | None = None  # None: no limit
    env: dict[str, str | None] = field(default_factory=dict)  # variables set (a value) or removed (None) for it
    done: Path | None = None  # written once it succeeded, unless the child wrote it itself

    def command(self) -> str:
        return "python " + " ".join(quote(a) for a in self.args)


@dataclass
class Ran:
    """What became of a child: its exit status (None: stopped at its time limit) and its seconds."""

    title: str
    command: str
    code: int | None
    seconds: float
    limit: float | None = None

    @property
    def state(self) -> str:
        if self.code == 0:
            return "done"
        return f"stopped at its limit of {self.limit:.0f} s" if self.code is None else f"exit {self.code}"


def run_child(child: Child, log: TextIO, echo: bool = False) -> Ran:
    """Run ``child``, its output written to ``log`` between a line that names it and one that says what became of
    it, and with ``echo`` shown as it comes, indented; its ``done`` file written once it succeeded."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in child.env.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    limit = f" (at most {child.seconds:.0f} s)" if child.seconds is not None else ""
    log.write(f"===== {child.title}: {child.command()}{limit}\n")
    log.flush()
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, *child.args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    copier = threading.Thread(target=copy_lines, args=(process.stdout, log, echo), daemon=True)
    copier.start()
    try:
        code = process.wait(timeout=child.seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
    except BaseException:  # Ctrl-C: the child got it too (one process group): its own stop, then it is not left behind
        try:
            process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise
    finally:
        copier.join(timeout=10)  # the pipe closes with the child (a grandchild that keeps it open is not waited for)
    ran = Ran(child.title, child.command(), code, time.perf_counter() - began, child.seconds)
    log.write(f"===== {child.title}: {ran.state} after {ran.seconds:.0f} s\n")
    log.flush()
    if code == 0 and child.done is not None and not child.done.exists():
        child.done.parent.mkdir(parents=True, exist_ok=True)
        child.done.write_text(now())
    return ran


def copy_lines(source, log: TextIO, echo: bool) -> None:
    for line in source:
        log.write(line)
        if echo:
            print(f"    {line}", end="", flush=True)
    log.flush()
