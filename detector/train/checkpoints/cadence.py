"""When a run checkpoints: every ``train.checkpoint_every`` steps, or by default (``auto``, -1) as often as the disk
keeps up with, so that no save is due before the one before it is written and the step never waits for one.

``auto``: a save every ``max(MIN_SECONDS, write time / WRITE_SHARE)`` seconds of steps, the write time being the
state's bytes at the disk's speed (process 0 measures the disk at start-up, in the background; each save's own time
replaces that estimate once known). The steps between two saves are set once the step's time is known: at the first
log line past the first steps (``progress.TIMING_SKIP``), from process 0's figures, the same on every process, and
said in one line. A save that would fall less than one interval before the end is left out: the final save follows.
"""

from __future__ import annotations

import math

AUTO = -1
MIN_SECONDS = 60.0  # at most a minute of steps lost to a crash, where the disk allows
WRITE_SHARE = 0.25  # a save writes during at most this share of the steps between two saves


def interval_steps(step_seconds: float, write_seconds: float) -> int:
    """Steps between two saves of ``auto``: the longer of MIN_SECONDS and four times a save's write."""
    return max(1, math.ceil(max(MIN_SECONDS, write_seconds / WRITE_SHARE) / max(step_seconds, 1e-9)))


class Cadence:
    """Which steps save (besides the final one and a stop's): ``due(step)``; ``auto`` until ``decide`` sets it."""

    def __init__(self, every: int, steps: int):
        self.auto, self.steps = every == AUTO, steps
        self.every: int | None = None if self.auto else every

    @property
    def undecided(self) -> bool:
        return self.auto and self.every is None

    def decide(self, step_seconds: float, write_seconds: float) -> int:
        self.every = interval_steps(step_seconds, write_seconds)
        return self.every

    def due(self, step: int) -> bool:
        if not self.every or step % self.every:
            return False
        return not self.auto or self.steps - step >= self.every  # auto: the final save comes sooner anyway

    def describe(self, step_seconds: float, write_seconds: float, state_bytes: int, disk_speed: float | None) -> str:
        """The line that says the auto cadence and why."""
        disk = f" at the disk's {disk_speed / 1e9:.2f} GB/s" if disk_speed else ""
        return (
            f"checkpoints: every {self.every:,} steps (train.checkpoint_every=auto: about "
            f"{self.every * step_seconds:.0f} s of {1e3 * step_seconds:.1f}-ms steps, where a save of "
            f"{state_bytes / 2**30:.2f} GiB writes in about {write_seconds:.1f} s{disk}), and at the end"
        )
