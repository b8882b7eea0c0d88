"""``python -m detector.bench_triton``: where the time of the ``triton`` strategy goes, next to the others.

One case, the article's: batch 1024 x 256 slots, bf16 predictions, uint8 targets, ``seed`` and
``tail`` counts. Per strategy, the median of synchronised calls (CUDA events), as ``make bench`` times
them, and the median of CUDA-graph replays of forward+backward (the device time without the host's
launch overhead). For ``triton`` also the host-side layers one by one (the op alone, the strategy's
forward, forward + backward) and each kernel's device time from the profiler. No omegaconf needed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from detector.cases import random_case
from detector.data import make_targets
from detector.losses import STRATEGIES
from detector.losses import triton as triton_strategy


def median_ms(fn, repeats: int = 200, warmup: int = 20) -> float:
    """Median ms of ``fn()``, each call between two CUDA events and synchronised (host clock on the CPU)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn, repeats: int = 200) -> float | None:
    """Median ms of replaying ``fn`` captured in a CUDA graph; None if it cannot be captured."""
    if not torch.cuda.is_available():
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # noqa: BLE001  reported, not fatal
        print(f"  (CUDA-graph capture failed: {type(err).__name__}: {str(err).splitlines()[0][:100]})")
        return None
    return median_ms(graph.replay, repeats)


def kernel_times(fn) -> list[tuple[str, float]]:
    """(kernel name, device ms) of one call of ``fn``, from the profiler (average of 20 calls)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.key[:60], e.device_time_total / 20 / 1e3) for e in events if e.count]


def bench_strategy(name: str, pred: torch.Tensor, targets, distribution: str, repeats: int) -> None:
    strategy = STRATEGIES[name]
    valid = int(targets.counts.sum())
    reason = strategy.unavailable(pred.device)
    if reason:
        print(f"| {name} | {distribution} | {valid} | — | — | — |  ({reason})")
        return

    def forward():
        with torch.no_grad():
            strategy(pred, targets)

    def forward_backward():
        pred.grad = None
        strategy(pred, targets).backward()

    fwd, fwd_bwd = median_ms(forward, repeats), median_ms(forward_backward, repeats)
    graph = graph_ms(forward_backward, repeats)
    graph_text = "—" if graph is None else f"{graph:.4f}"
    print(f"| {name} | {distribution} | {valid} | {fwd:.4f} | {fwd_bwd:.4f} | {graph_text} |", flush=True)


def bench_triton_layers(pred: torch.Tensor, targets, repeats: int) -> None:
    boxes, counts = targets
    detached = pred.detach()
    op = torch.ops.detector.giou_loss_triton.default

    def triton_step():
        pred.grad = None
        STRATEGIES["triton"](pred, targets).backward()

    layers = {
        "op alone, no autograd": lambda: op(detached, boxes, counts),
        "strategy forward, autograd recording": lambda: STRATEGIES["triton"](pred, targets),
        "strategy forward + backward": triton_step,
    }
    for label, fn in layers.items():
        print(f"  triton {label}: {median_ms(fn, repeats):.4f} ms")
    for kernel, ms in kernel_times(triton_step):
        print(f"  device time {ms * 1e3:8.2f} us  {kernel}")


def run(batch: int, max_boxes: int, distributions: list[str], names: list[str], repeats: int) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"{where}, torch {torch.__version__}, triton {triton_strategy.triton.__version__}")
    print(f"batch {batch} x {max_boxes} slots, bf16 predictions, uint8 targets; median ms of synchronised calls")
    print("| strategy | boxes | valid | fwd ms | fwd+bwd ms | fwd+bwd graph ms |")
    print("|---|---|---:|---:|---:|---:|")
    for distribution in distributions:
        pred, boxes_list = random_case(
            batch, max_boxes, distribution, torch.bfloat16, torch.uint8, seed=batch, nan_padding=False
        )
        pred = pred.to(device).requires_grad_()
        targets = make_targets(boxes_list, "padded", max_boxes).to(device)
        for name in names:
            bench_strategy(name, pred, targets, distribution, repeats)
        if distribution == distributions[0]:
            bench_triton_layers(pred, targets, repeats)
    print("autotuned configs (key: M, dtypes):")
    for key, config in triton_strategy._giou_loss_fwd_bwd_kernel.cache.items():
        print(f"  {key}: {config}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--max-boxes", type=int, default=256)
    parser.add_argument("--distributions", nargs="+", default=["seed", "tail"])
    default = [n for n in ("padded", "compiled", "triton", "cuda_fused", "cuda_conditional") if n in STRATEGIES]
    parser.add_argument("--strategies", nargs="+", default=default)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    run(args.batch, args.max_boxes, args.distributions, args.strategies, args.repeats)


if __name__ == "__main__":
    main()
