"""A training run's progress: every step's loss and time, the log line, and the throughput they give.

The losses stay on the device until a log line, an evaluation or a checkpoint needs them (one host wait
then, not one a step). Throughput is by the wall clock, data waits included; on a GPU the device's time
of each step and its idle time between steps stand beside it: the part of the host's waits (data,
Python) that reached the GPU. On the CPU there is no device apart from the host, so the log shows neither.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

TIMING_SKIP = 5  # first steps of a run left out of its step times: compilation, autotuning, graph capture
ETA_STEPS = 2000  # the ETA's median is of the last steps this many at most: a log line's work may not grow with the run


def format_eta(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


class StepClock:
    """Each step's device time (CUDA events, read only when the host waits anyway) or host time (CPU), and
    the time the device sat idle since the previous step ended: the only part of a host-side wait (data,
    Python) that costs throughput. The host runs ahead of the GPU, so it may wait for data a long time
    while the GPU is still busy with earlier steps; the idle time says whether that wait reached the GPU.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.last_stop = None  # the previous step's end mark
        self.aside_ms = 0.0  # of the time before the next step: timed on its own (an evaluation, a save's wait)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks.append([self.aside_ms, self._now()])
        self.aside_ms = 0.0

    def set_aside(self, seconds: float) -> None:
        """Leave ``seconds`` out of the idle time before the next step: the host timed them on its own (an
        evaluation, a save's wait), and the device's work or idleness then is theirs, not the steps'."""
        self.aside_ms += seconds * 1e3

    def stop(self) -> None:
        self.marks[-1].append(self._now())

    def read(self) -> list[tuple[float, float]]:
        """(ms of the step, ms idle before it) of each step since the last read; the first step has no idle time."""
        out = []
        for aside, start, stop in self.marks:
            idle = 0.0 if self.last_stop is None else max(0.0, self._ms(self.last_stop, start) - aside)
            out.append((self._ms(start, stop), idle))
            self.last_stop = stop
        self.marks = []
        return out

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class Log:
    """Every step's loss and time; flushed (one host wait) at log lines, checkpoints and evaluations."""

    def __init__(self, device: torch.device, losses: list[float]):
        self.device, self.clock = device, StepClock(device)
        self.losses = losses  # loss of step s at index s - 1, restored on resume
        self.pending: list[torch.Tensor] = []
        self.timings: list[dict] = []  # per step: step, wall_ms, device_ms, idle_ms, data_ms
        self.window_start, self.window_data = time.perf_counter(), []
        self.first_done = time.perf_counter()  # when this process's first step ended: the ETA's origin until a line
        self.first_line: int | None = None  # the first log line's step: its window holds the first step

    def add(self, loss: torch.Tensor, data_seconds: float) -> None:
        self.pending.append(loss.detach())
        self.window_data.append(data_seconds * 1e3)

    def flush(self, step: int) -> list[int]:
        """Read the pending steps (ending at ``step``); returns those whose loss is not finite."""
        if not self.pending:
            return []
        values = torch.stack(self.pending).float().tolist()
        wall_ms = (time.perf_counter() - self.window_start) * 1e3 / len(values)
        first = step - len(values) + 1
        for i, ((ms, idle_ms), data_ms) in enumerate(zip(self.clock.read(), self.window_data, strict=True)):
            self.timings.append(
                {"step": first + i, "wall_ms": wall_ms, "device_ms": ms, "idle_ms": idle_ms, "data_ms": data_ms}
            )
        self.losses += values
        self.pending, self.window_data, self.window_start = [], [], time.perf_counter()
        return [first + i for i, v in enumerate(values) if not math.isfinite(v)]

    def since(self, step: int, most: int | None = None) -> list[dict]:
        """The timings of the steps after ``step``, the last ``most`` of them at most: found from the end, so a log
        line's cost is its window's, not the run's (a scan of every step so far grew each window with the run)."""
        first = len(self.timings)
        floor = 0 if most is None else max(0, first - most)
        while first > floor and self.timings[first - 1]["step"] > step:
            first -= 1
        return self.timings[first:]

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` out of the window's wall time and the next step's idle time: an evaluation or a
        checkpoint's wait, timed on its own."""
        self.window_start += seconds
        self.clock.set_aside(seconds)

    def window_mean(self, step: int, log_every: int) -> float:
        """Mean loss of the log window ending at ``step``: (step - log_every, step], the same on resume."""
        window = self.losses[max(0, step - log_every) : step]
        return sum(window) / len(window)

    def line(self, step: int, steps: int, log_every: int, resumed_at: int, lr: float, batch: int) -> tuple[str, dict]:
        """The log line of the window ending at ``step`` (of ``steps``; ``batch`` images a step, on every process), and
        its TensorBoard scalars. The ETA is the median of the recent steps since the first window, which holds the
        compilation: an evaluation or a save's wait, which stretches one window, says nothing of the steps to come."""
        loss = self.window_mean(step, log_every)
        rate = throughput(self.since(step - log_every), batch, skip_until=0)  # this window's steps
        steady = self.since(self.first_line, ETA_STEPS) if self.first_line is not None else []
        if steady:
            eta = throughput(steady, batch, skip_until=0)["step_ms"] / 1e3 * (steps - step)
        else:  # the first window: its steps after the first
            done = step - resumed_at - 1
            eta = (time.perf_counter() - self.first_done) / done * (steps - step) if done else None
        if self.first_line is None:
            self.first_line = step
        line = (
            f"step {step:6d}/{steps}  loss {loss:.4f}  lr {lr:.2e}  {step_times(rate, self.device.type == 'cuda')}  "
            f"{rate['images_per_s']:9.0f} img/s  eta {format_eta(eta) if eta is not None else '(after step 2)'}"
        )
        return line, log_scalars(rate, loss, lr, self.device)

    def history(self, log_every: int, last: int) -> list[tuple[int, float]]:
        steps = [s for s in range(log_every, last + 1, log_every)] + ([last] if last % log_every else [])
        return [(s, self.window_mean(s, log_every)) for s in steps]


def throughput(timings: list[dict], global_batch: int, skip_until: int) -> dict:
    """Median step times and images/s, by the wall clock and by the device, and the device's mean idle time between
    steps, past the first steps."""
    timed = [t for t in timings if t["step"] > skip_until] or timings
    if not timed:
        keys = ("step_ms", "device_step_ms", "device_idle_ms", "data_wait_ms", "images_per_s", "device_images_per_s")
        return dict.fromkeys(keys) | {"timed_steps": 0}

    def median(key: str) -> float:
        return statistics.median(t[key] for t in timed)

    wall, device = median("wall_ms"), median("device_ms")
    return {
        "step_ms": wall,  # wall clock per step, data wait included
        "device_step_ms": device,
        # between steps: what data and host cost the GPU, as a mean: the host waits for the device at each log line
        # and the GPU idles once a window then, which a median of the window's steps would never show
        "device_idle_ms": statistics.fmean(t["idle_ms"] for t in timed),
        "data_wait_ms": median("data_ms"),  # the host's wait; overlapped when the host is ahead
        "images_per_s": global_batch / wall * 1e3,
        "device_images_per_s": global_batch / device * 1e3,
        "timed_steps": len(timed),
    }


def step_times(rate: dict, cuda: bool) -> str:
    """A log line's step times: the wall clock's, then on a GPU the device's and its idle time."""
    if not cuda:  # the host is the device: its time is the wall clock's
        return f"step {rate['step_ms']:8.1f} ms (data wait {rate['data_wait_ms']:.1f})"
    return (
        f"step {rate['step_ms']:8.1f} ms (device {rate['device_step_ms']:.1f}, idle {rate['device_idle_ms']:.1f}; "
        f"host data wait {rate['data_wait_ms']:.1f})"
    )


def log_scalars(rate: dict, loss: float, lr: float, device: torch.device) -> dict[str, float]:
    """The TensorBoard scalars of a log line (the device's times and memory on a GPU only)."""
    scalars = {"train/loss": loss, "train/lr": lr, "time/step_ms": rate["step_ms"]}
    scalars |= {"time/data_wait_ms": rate["data_wait_ms"], "time/images_per_s": rate["images_per_s"]}
    if device.type == "cuda":
        scalars |= {"time/device_step_ms": rate["device_step_ms"], "time/device_idle_ms": rate["device_idle_ms"]}
        scalars["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return scalars
