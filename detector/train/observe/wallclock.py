"""Where a training run's wall clock went, and its goodput: the share of it that trained.

    start-up      from the process's start (its interpreter, imports, the model, a resume) to the first step
    first step    the first step: compilation, autotuning, cuDNN's benchmark of the shapes
    steps         every other step, the host's waits for the device at log lines included
    data          the loop's waits for the loader (a data stall: the step had no batch)
    evaluations   the held-out evaluations
    checkpoints   the step's waits for checkpoints: the copy to host memory, and a save still under way
    end           from the last step to the summary (the final checkpoint's write included)

A step whose wait for the loader took over ``STALL_SECONDS`` is a stalled step (a batch ready takes microseconds to
hand over): the account counts them beside the steps it counted.

Goodput is ``steps / total``. The checkpoints' writes in the background are reported beside, not in the total: they
overlap the steps. ``Account`` is what the run's summary keeps of it (summary.json's ``wall_clock``).

Start-up is split in its own parts (``Account.startup``), in the order the run meets them: ``BEFORE`` (from the
process's start to the run: the interpreter and the imports), the parts the command timed before the run existed
(``early``: the configuration, the CUDA context), then each part the run times (``WallClock.startup``: the model, the
resume, the loader, ...), and ``other``, the rest. The parts add up to the start-up: a part that ran beside another (the
CUDA context, begun in a thread while the imports go on) counts the main thread's wait for it, what it added.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import time
from dataclasses import dataclass

from detector.checked import Damaged, measure, measured, need

PARTS = ("start-up", "first step", "steps", "data", "evaluations", "checkpoints", "end")
BEFORE = "interpreter and imports"
STALL_SECONDS = 1e-3  # a wait for the loader longer than this: the step had no batch ready (a data stall)
EARLY: dict[str, float] = {}  # the start-up's parts timed before the run's clock existed (``early``), this process's


@contextlib.contextmanager
def early(name: str):
    """Time a part of the start-up that the command meets before the run begins (the configuration's checks, the
    wait for the CUDA context): the next ``WallClock`` takes it out of ``BEFORE``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        EARLY[name] = EARLY.get(name, 0.0) + time.perf_counter() - start


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), or 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class WallClock:
    """The run's seconds by part (``PARTS``); ``part`` times a block, the steps are what the loop leaves over."""

    def __init__(self):
        age = process_age()
        self.origin = time.perf_counter() - age
        self.seconds = dict.fromkeys(PARTS, 0.0)
        timed = dict(EARLY)
        EARLY.clear()  # a second run in this process (the strategy sweep's) has its own
        self.startup_parts = {BEFORE: max(0.0, age - sum(timed.values())), **timed}
        self.loop_start: float | None = None
        self.loop_end: float | None = None
        self.loop_seconds = 0.0
        self.in_loop = 0.0  # the parts' seconds inside the loop (the steps are the rest of it)
        self.data_waits, self.stalls = 0, 0  # the steps' waits for the loader, and of them the stalls

    def waited_for_data(self, seconds: float) -> None:
        """A step's wait for its batch (already in ``data``): counted, and as a stall past STALL_SECONDS."""
        self.data_waits += 1
        self.stalls += seconds > STALL_SECONDS

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    @contextlib.contextmanager
    def startup(self, name: str):
        """Time a part of the start-up."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.startup_parts[name] = self.startup_parts.get(name, 0.0) + time.perf_counter() - start

    def startup_line(self) -> str:
        """The start-up's parts, the largest first: what the run's first lines say."""
        parts = self.startup_account()
        shown = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in sorted(parts.items(), key=lambda p: -p[1]))
        return f"start-up {self.seconds['start-up']:.1f} s: {shown}"

    def startup_account(self) -> dict[str, float]:
        parts = dict(self.startup_parts)
        parts["other"] = max(0.0, self.seconds["start-up"] - sum(parts.values()))
        return parts

    def start_loop(self) -> None:
        self.loop_start = time.perf_counter()
        self.seconds["start-up"] = self.loop_start - self.origin

    def stop_loop(self) -> None:
        if self.loop_start is not None:
            self.loop_end = time.perf_counter()
            self.loop_seconds = self.loop_end - self.loop_start
            self.in_loop = sum(self.seconds[p] for p in ("first step", "data", "evaluations", "checkpoints"))
            self.loop_start = None

    def account(self, background: float = 0.0, images: int = 0) -> Account:
        """Where the run's wall clock went so far; ``background``: the checkpoints' seconds of writing beside the steps,
        ``images``: the images this process's run trained (its images/s over the whole run)."""
        now = time.perf_counter()
        seconds = dict(self.seconds)
        seconds["steps"] = max(0.0, self.loop_seconds - self.in_loop)
        if self.loop_end is not None:  # after the loop: the parts timed there (the final checkpoint), the rest is end
            after = sum(seconds[p] for p in ("first step", "data", "evaluations", "checkpoints")) - self.in_loop
            seconds["end"] = max(0.0, now - self.loop_end - after)
        total = sum(seconds.values())
        goodput, rate = (seconds["steps"] / total, images / total) if total else (None, None)
        stalls = (self.stalls, self.data_waits) if self.data_waits else None
        return Account(seconds, total, goodput, background, rate, self.startup_account(), stalls)


@dataclass
class Account:
    """Where a run's wall clock went: ``seconds`` by part (PARTS), their total, the goodput, the checkpoints' seconds
    of writing in the background, and the images/s over the whole run, as the run lived it."""

    seconds: dict[str, float]
    total_s: float
    goodput: float | None
    checkpoint_background_s: float
    images_per_s_lived: float | None = None
    startup: dict[str, float] | None = None  # the start-up's parts (module docstring); None in older summaries
    # (stalled steps, steps that waited for the loader): STALL_SECONDS; None in older summaries and runs of no step
    data_stalls: tuple[int, int] | None = None

    def line(self) -> str:
        """The closing log line's account: goodput, then each part that took time."""
        parts = ", ".join(
            f"{name} {self.seconds[name]:.1f} s" + (self.stall_note() if name == "data" else "")
            for name in PARTS
            if self.seconds[name] >= 0.05
        )
        text = f"goodput {100 * (self.goodput or 0):.0f} % of {self.total_s:.1f} s ({parts})"
        if self.checkpoint_background_s:
            text += f"; checkpoints wrote {self.checkpoint_background_s:.1f} s in the background"
        return text

    def stall_note(self) -> str:
        """`` (3 of 1000 steps stalled)``: the steps that found no batch ready, where counted."""
        if self.data_stalls is None:
            return ""
        stalled, counted = self.data_stalls
        return f" ({stalled} of {counted} steps stalled)"

    def add_scalars(self, board, step: int) -> None:
        """The account as TensorBoard scalars under goodput/ (observe/board.py's ``Board``)."""
        board.scalar("goodput/share", self.goodput or 0.0, step)
        board.scalars({f"goodput/{scalar_name(part)}_s": self.seconds[part] for part in PARTS}, step)
        board.flush()

    @classmethod
    def parse(cls, data, where: str) -> Account:
        """RecordError for a part of another shape, Damaged for a value no field of its kind holds."""
        need(data, dict, where)
        seconds = need(data.get("seconds"), dict, f"{where}.seconds")
        return cls(
            seconds={part: measure(seconds.get(part), f"{where}.seconds.{part}") for part in PARTS},
            total_s=measure(data.get("total_s"), f"{where}.total_s"),
            goodput=measured(data, "goodput", where, high=1),
            checkpoint_background_s=measured(data, "checkpoint_background_s", where, default=0.0),
            images_per_s_lived=measured(data, "images_per_s_lived", where),
            startup=startup_parts(data.get("startup"), f"{where}.startup"),
            data_stalls=stall_counts(data.get("data_stalls"), f"{where}.data_stalls"),
        )


def startup_parts(data, where: str) -> dict[str, float] | None:
    if data is None:
        return None
    return {name: measure(seconds, f"{where}.{name}") for name, seconds in need(data, dict, where).items()}


def stall_counts(data, where: str) -> tuple[int, int] | None:
    """[stalled, counted]: two whole numbers, the first at most the second; None where absent (older summaries)."""
    if data is None:
        return None
    need(data, list, where)
    if len(data) != 2:
        raise Damaged(where, data, "[stalled steps, counted steps]")
    stalled, counted = (measure(value, f"{where}[{i}]", kind=int) for i, value in enumerate(data))
    if stalled > counted:
        raise Damaged(where, data, "[stalled steps, counted steps], the first at most the second")
    return stalled, counted


def scalar_name(part: str) -> str:
    """A part's name as a TensorBoard tag writes it: lower-case words joined by underscores (``start-up``:
    ``start_up``, ``first step``: ``first_step``), like every other tag the run writes."""
    return "_".join(re.findall(r"[a-z0-9]+", part.lower()))


class FullCollections:
    """The interpreter's full garbage collections (generation 2) within a block (``gc.callbacks``): how many, their
    pauses in all, and the longest with the step it followed (``step``: a callable giving the step now). A full
    collection walks every object the process holds, the compiler's graphs among them (millions after a compiled
    first step): a pause of a fraction of a second in the middle of the steps, once in a long while. The loop freezes
    what the first step made (``gc.freeze``: the collector no longer walks it), and this says what pauses remain."""

    def __init__(self, step):
        self.step, self.count, self.seconds, self.longest, self.after, self.began = step, 0, 0.0, 0.0, 0, None

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self.callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self.callback)

    def callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self.began = time.perf_counter()
        elif self.began is not None:
            pause, self.began = time.perf_counter() - self.began, None
            self.count += 1
            self.seconds += pause
            if pause > self.longest:
                self.longest, self.after = pause, self.step()

    def line(self) -> str | None:
        """One line on the pauses, or None where there were none."""
        if not self.count:
            return None
        return (
            f"garbage collection: {self.count} full collection{'s' if self.count > 1 else ''} of the interpreter's "
            f"objects during the steps, {self.seconds:.2f} s in all (the longest {self.longest:.2f} s, after step "
            f"{self.after})"
        )
