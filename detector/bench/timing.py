"""Timing helpers shared by the benchmarks (``make bench``, ``bench_kernels``, ``bench_triton``).

No configuration imports here, so the kernel benchmarks run where omegaconf is missing.
"""

from __future__ import annotations

import statistics
import time

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def event_ms(fn, device=None, warmup: int = 10, repeats: int = 50, max_seconds: float = float("inf")) -> float:
    """Median ms of ``fn()``, each call followed by a synchronize: CUDA events on a GPU, the host clock on
    the CPU. Stops after ``max_seconds`` once it has 3 samples (the loop strategy takes ~0.6 s a call)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for _ in range(warmup):
        fn()
    synchronize(device)
    times, deadline = [], time.perf_counter() + max_seconds
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return statistics.median(times)


def wall_ms(fn, warmup: int = 20, repeats: int = 200) -> float:
    """Median host ms of ``fn(); torch.cuda.synchronize()``: what the caller waits, launch overhead included."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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


def device_ms(fn, calls: int = 10, repeats: int = 20) -> float:
    """Device ms of one ``fn()``: a graph of ``calls`` back-to-back calls, no host in the way."""
    return event_ms(capture(fn, calls).replay, warmup=3, repeats=repeats) / calls


def graph_ms(fn, repeats: int = 50, label: str = "") -> float | None:
    """Median ms of replaying ``fn`` from a CUDA graph; None (and a note) if it cannot be captured."""
    try:
        graph = capture(fn)
    except Exception as err:  # noqa: BLE001  reported, not fatal: the other columns still stand
        print(
            f"  ({label + ': ' if label else ''}CUDA-graph capture failed: {type(err).__name__}: "
            f"{str(err).splitlines()[0][:100]})"
        )
        return None
    return event_ms(graph.replay, warmup=3, repeats=repeats)


def loss_closures(strategy, pred: torch.Tensor, targets):
    """(forward, forward+backward) closures of a strategy's loss on ``pred`` (requires grad) and targets."""

    def forward():
        with torch.no_grad():
            strategy(pred, targets)

    def forward_backward():
        pred.grad = None
        strategy(pred, targets).backward()

    return forward, forward_backward
