"""How busy the machine was around a profile run: the CPU time that *other* processes used, in cores.

Linux's /proc/stat counts every core's busy time since boot; this process and its descendants (the loader's
workers; under torchrun, every rank of the run) count their own in /proc/<pid>/stat. Their difference over a
window, divided by the window, is the number of cores that other programs kept busy: 0 on a quiet machine, 2
on 2 cores with two busy loops beside the run. A profile samples it for a moment before it starts, over its
whole run, and for a moment after it ends; ``Noise``, part of the run record (detector/lab/record.py), judges
it. Where /proc cannot be read, the load is None: unknown, not zero.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from detector.checked import need, optional

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

    @staticmethod
    def _now() -> tuple[float, float | None, float | None]:
        return time.monotonic(), machine_busy(), own_busy(run_root())

    def start(self) -> None:
        self.began = self._now()

    def stop(self) -> float | None:
        """The other processes' load since ``start``, in cores; None where it cannot be read. ``own`` is then the
        cores this run kept busy."""
        (t0, all0, own0), (t1, all1, own1) = self.began, self._now()
        self.own = None
        if None in (all0, own0, all1, own1) or t1 <= t0:
            return None
        self.own = (own1 - own0) / (t1 - t0)
        return max(0.0, ((all1 - all0) - (own1 - own0)) / (t1 - t0))

    def sample(self, seconds: float = SAMPLE_SECONDS) -> float | None:
        """The other processes' load over the next ``seconds`` (this process sleeps meanwhile)."""
        self.start()
        time.sleep(seconds)
        return self.stop()


# Other processes' CPU use, in cores, beyond which a run's times are not those of a quiet machine, where they leave
# the run no idle core: on 2 cores a quarter of one competes with the run, on a 32-core GPU host a few cores do not
NOISY_LOAD = 0.25
# Timed steps whose (q3 - q1) / median exceeds this are too uneven to be a quiet machine's. What paces the step sets
# it: a step that keeps the GPU busy, timed by CUDA events, spreads under 1 % on a quiet machine; a step that the
# host's dispatch paces (the CPU's, or a GPU's whose device idles while Python launches thousands of kernels)
# spreads with the host's scheduling, 2-18 % on 2 quiet cores and 2-20 % on a quiet 16-core GPU host (`python -m
# detector report`), against 60 % and more with two busy loops beside it
NOISY_SPREAD = {"device": 0.05, "host": 0.25}
# A step whose device idles less than this share of it is paced by the device
DEVICE_BOUND_IDLE = 0.05


@dataclass
class Noise:
    """The machine's noise around a run: the CPU cores that other processes kept busy before, during and after
    it (detector/lab/noise.py; None where it cannot be read), and how widely its timed steps spread."""

    cores: int
    load_before: float | None = None
    load_during: float | None = None
    load_after: float | None = None
    timed_spread: float | None = None
    load_own: float | None = None  # the cores the run itself kept busy during it (None: not recorded)
    timed_by: str = "host"  # "device": the timed steps are CUDA events' (a GPU's), else the host's wall clock

    def reasons(self, paced_by: str | None = None) -> list[str]:
        """Why the run's times are not those of a quiet machine; empty where nothing says so. ``paced_by``: what
        paced the step, "device" or "host" (by default the clock that timed it)."""
        out = []
        loads = {"before": self.load_before, "during": self.load_during, "after": self.load_after}
        busy = {when: load for when, load in loads.items() if load is not None and self.contends(load)}
        if busy:
            when, load = max(busy.items(), key=lambda item: item[1])
            out.append(f"other processes kept {load:.1f} of {self.cores} cores busy {when} it")
        if self.timed_spread is not None and self.timed_spread > NOISY_SPREAD.get(paced_by or self.timed_by, 0.25):
            out.append(f"its timed steps spread ±{50 * self.timed_spread:.0f} % around their median")
        return out

    def contends(self, load: float) -> bool:
        """Whether others' ``load`` competed with the run: beyond NOISY_LOAD, and with the run's own cores more than
        all but one of the machine's (where the run's own use is known)."""
        return load > NOISY_LOAD and (self.load_own is None or load + self.load_own > self.cores - 1)

    def describe(self) -> str:
        """One line: the load the run ran under."""
        loads = [(w, v) for w, v in (("before", self.load_before), ("during", self.load_during)) if v is not None]
        loads += [("after", self.load_after)] if self.load_after is not None else []
        if not loads:
            return "the load of other processes is unknown here"
        text = ", ".join(f"{v:.2f} {w}" for w, v in loads)
        own = f"; the run's own: {self.load_own:.2f}" if self.load_own is not None else ""
        return f"other processes' load, in cores of {self.cores}: {text}{own}"

    @classmethod
    def parse(cls, data, where: str) -> Noise:
        need(data, dict, where)
        loads = {
            k: optional(data, k, (int, float), where) for k in ("load_before", "load_during", "load_after", "load_own")
        }
        return cls(
            cores=need(data.get("cores", os.cpu_count() or 1), int, f"{where}.cores"),
            timed_spread=optional(data, "timed_spread", (int, float), where),
            timed_by=optional(data, "timed_by", str, where, "host"),
            **loads,
        )
