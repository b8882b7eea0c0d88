"""The machine's noise around a profile run, in its record: the CPU cores that other processes kept busy before,
during and after it (detector/lab/measure/cpu_load.py measures them), how widely its timed steps spread, and the
thresholds beyond which its times are not those of a quiet machine (``Noise.reasons``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from detector.checked import measured, need, optional

# Other processes' CPU use, in cores, beyond which a run's times are not those of a quiet machine, where they leave
# the run no idle core: on 2 cores a quarter of one competes with the run, on a 32-core GPU host a few cores do not
NOISY_LOAD = 0.25
# Timed steps whose (q3 - q1) / median exceeds this are too uneven to be a quiet machine's. What paces the step sets
# it: a step that keeps the GPU busy, timed by CUDA events, spreads far less than a step that the host's dispatch
# paces (the CPU's, or a GPU's whose device idles while Python launches thousands of kernels), which spreads with the
# host's scheduling. `make report` measures both on a quiet machine; docs/measures.md ("Noise") has the spreads
NOISY_SPREAD = {"device": 0.05, "host": 0.25}
# A step whose device idles less than this share of it is paced by the device
DEVICE_BOUND_IDLE = 0.05


@dataclass
class Noise:
    """The machine's noise around a run: the CPU cores that other processes kept busy before, during and after
    it (detector/lab/measure/cpu_load.py; None where it cannot be read), and how widely its timed steps spread."""

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
        """RecordError for no object, Damaged for a value no field of its kind holds."""
        need(data, dict, where)
        loads = {k: measured(data, k, where) for k in ("load_before", "load_during", "load_after", "load_own")}
        return cls(
            cores=measured(data, "cores", where, 1, kind=int, default=os.cpu_count() or 1),
            timed_spread=measured(data, "timed_spread", where),
            timed_by=optional(data, "timed_by", str, where, "host"),
            **loads,
        )
