"""How busy the machine was around a profile run: the CPU time that *other* processes used, in cores.

Linux's /proc/stat counts every core's busy time since boot; this process and its descendants (the loader's
workers; under torchrun, every rank of the run) count their own in /proc/<pid>/stat. Their difference over a
window, divided by the window, is the number of cores that other programs kept busy: 0 on a quiet machine, 2
on 2 cores with two busy loops beside the run. A profile samples it before its steps, over its whole run, and after
them, each sample a window of at least SAMPLE_SECONDS laid over the run's own work (the model's build, the trace's
analysis: its own CPU time, which the difference leaves out), not a wait of its own; ``Noise``, part of the run record
(detector/lab/record/noise.py), judges it. Where /proc cannot be read, the load is None: unknown, not zero.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SAMPLE_SECONDS = 0.5  # long enough for the kernel's 10 ms ticks to average, short beside a profile


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def machine_busy() -> float | None:
    """Seconds of CPU time all processes have used since boot (every core's user, nice, system, irq, softirq
    and steal time), or None without /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, *rest = (int(v) for v in first[1:])
    steal = rest[0] if rest else 0
    return (user + nice + system + irq + softirq + steal) / _ticks_per_second()


def own_busy(root: int | None = None) -> float | None:
    """Seconds of CPU time used by process ``root`` (default: this one), its children that it has waited for,
    and its live descendants; None without /proc."""
    root = os.getpid() if root is None else root
    stats, children = {}, {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        pid, ppid = int(entry), int(fields[1])
        stats[pid] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        children.setdefault(ppid, []).append(pid)
    if root not in stats:
        return None
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0)
        todo += children.get(pid, [])
    return total / _ticks_per_second()


def run_root() -> int:
    """The process whose descendants are this run: under torchrun its agent, whose other ranks share the run's
    work (they are not another program's load), else this process."""
    return os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else os.getpid()


class LoadMeter:
    """The cores other processes kept busy between ``start`` and ``stop`` (and over a short sample alone)."""

    def __init__(self):
        self.cores = os.cpu_count() or 1
        self.began: tuple[float, float | None, float | None] | None = None
        self.own: float | None = None  # the run's own cores over the last window stop() measured
        self.slept = 0.0  # seconds the last stop() slept to make its window a sample's length

    @staticmethod
    def _now() -> tuple[float, float | None, float | None]:
        return time.monotonic(), machine_busy(), own_busy(run_root())

    def start(self) -> None:
        self.began = self._now()

    def stop(self, sample: bool = False) -> float | None:
        """The other processes' load since ``start``, in cores; None where it cannot be read. ``own`` is then the
        cores this run kept busy. With ``sample``, the window lasts at least SAMPLE_SECONDS: what it lacked is slept
        (``slept``)."""
        short = (SAMPLE_SECONDS if sample else 0.0) - (time.monotonic() - self.began[0])
        self.slept = max(short, 0.0)
        if short > 0:
            time.sleep(short)
        (t0, all0, own0), (t1, all1, own1) = self.began, self._now()
        self.own = None
        if None in (all0, own0, all1, own1) or t1 <= t0:
            return None
        self.own = (own1 - own0) / (t1 - t0)
        return max(0.0, ((all1 - all0) - (own1 - own0)) / (t1 - t0))
