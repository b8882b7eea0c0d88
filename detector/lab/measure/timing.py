"""Timing helpers shared by the benchmark targets (``python -m detector bench losses|kernels|layers``) and the shape
report's own timing (detector/lab/measure/costs.py).

Every timer returns a :class:`Stats`: the median of repeated calls and their interquartile range. The
quartiles, not min–max, are the spread: one preempted call on a shared host would otherwise widen
every interval. No configuration imports here: :func:`budget` reads any object with ``warmup``,
``repeats`` and ``max_seconds`` (``cfg.bench``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from detector.config.device import synchronize


@dataclass(frozen=True)
class Stats:
    """Milliseconds of repeated calls: median, first and third quartile (``low``, ``high``), sample count."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        if len(samples) < 2:
            return cls(samples[0], samples[0], samples[0], len(samples))
        low, median, high = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(median, low, high, len(samples))

    def __truediv__(self, k: float) -> Stats:
        """Per-call statistics of a sample that timed ``k`` calls at once (a graph of ``k`` calls)."""
        return Stats(self.median / k, self.low / k, self.high / k, self.n)


def budget(bcfg) -> dict:
    """``bcfg``'s (cfg.bench's) warm-up, repeats and time cap, as keyword arguments of the timers below."""
    return {"warmup": bcfg.warmup, "repeats": bcfg.repeats, "max_seconds": bcfg.max_seconds}


def _host_clock(fn, device: torch.device) -> float:
    """ms the host waits for ``fn(); synchronize()``: launch overhead included."""
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _event_clock(fn, device: torch.device) -> float:
    """ms between CUDA events recorded around ``fn()`` on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _repeat(fn, clock, device, warmup: int, repeats: int, max_seconds: float) -> Stats:
    """The one timing loop: ``warmup`` calls, then up to ``repeats`` timed calls, stopping after
    ``max_seconds`` once there are 3 samples (the loop strategy takes ~0.6 s a call)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples, deadline = [], time.perf_counter() + max_seconds
    for _ in range(repeats):
        samples.append(clock(fn, device))
        if time.perf_counter() > deadline and len(samples) >= 3:
            break
    return Stats.of(samples)


def event_ms(fn, device=None, warmup: int = 10, repeats: int = 50, max_seconds: float = float("inf")) -> Stats:
    """``fn()`` timed with CUDA events on a GPU, with the host clock and a synchronize on the CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    clock = _event_clock if device.type == "cuda" else _host_clock
    return _repeat(fn, clock, device, warmup, repeats, max_seconds)


def wall_ms(fn, device=None, warmup: int = 20, repeats: int = 200, max_seconds: float = float("inf")) -> Stats:
    """What the caller waits for ``fn(); synchronize()``, host clock, launch overhead included."""
    return _repeat(fn, _host_clock, device, warmup, repeats, max_seconds)


def capture(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` called ``calls`` times, captured in a CUDA graph after a warm-up on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture requires the warm-up off the capturing stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def device_ms(fn, calls: int = 10, warmup: int = 3, repeats: int = 20, max_seconds: float = float("inf")) -> Stats:
    """Device ms of one ``fn()``: replays of a graph of ``calls`` back-to-back calls, no host in the way."""
    return event_ms(capture(fn, calls).replay, "cuda", warmup, repeats, max_seconds) / calls


def graph_ms(
    fn, label: str = "", warmup: int = 3, repeats: int = 50, max_seconds: float = float("inf")
) -> Stats | None:
    """Replays of ``fn`` from a CUDA graph; None (and a note) if it cannot be captured."""
    try:
        graph = capture(fn)
    except Exception as err:  # noqa: BLE001  reported, not fatal: the other columns still stand
        print(
            f"  ({label + ': ' if label else ''}CUDA-graph capture failed: {type(err).__name__}: "
            f"{str(err).splitlines()[0][:100]})"
        )
        return None
    return event_ms(graph.replay, "cuda", warmup, repeats, max_seconds)


def loss_closures(strategy, pred: torch.Tensor, targets):
    """(forward, forward+backward) closures of a strategy's loss on ``pred`` (requires grad) and targets."""

    def forward():
        with torch.no_grad():
            strategy(pred, targets)

    def forward_backward():
        pred.grad = None
        strategy.backward(strategy(pred, targets))

    return forward, forward_backward
