"""``python -m detector.bench_triton``: where the time of the ``triton`` strategy goes, next to the others.

One case, the article's: batch 1024 x 256 slots, bf16 predictions, uint8 targets, ``seed`` and
``tail`` counts. Per strategy, the median of synchronised calls (CUDA events), as ``make bench`` times
them, and the median of CUDA-graph replays of forward+backward (the device time without the host's
launch overhead). For ``triton`` also the host-side layers one by one (the op alone, the strategy's
forward, forward + backward) and each kernel's device time from the profiler. No omegaconf needed.
"""

from __future__ import annotations

import argparse

import torch

from detector.bench.cases import random_case
from detector.bench.timing import event_ms, graph_ms, loss_closures
from detector.data import make_targets
from detector.kernels import triton_giou as triton_strategy
from detector.losses import STRATEGIES


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

    forward, forward_backward = loss_closures(strategy, pred, targets)
    fwd, fwd_bwd = event_ms(forward, repeats=repeats), event_ms(forward_backward, repeats=repeats)
    graph = graph_ms(forward_backward, repeats) if pred.is_cuda else None
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
        print(f"  triton {label}: {event_ms(fn, repeats=repeats):.4f} ms")
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
