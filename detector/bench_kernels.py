"""`make bench-kernels`: the detector::giou_loss kernels on a GPU (``python -m detector.bench_kernels``).

1. Headline: batch 1024, 256 slots, seed boxes: forward+backward of padded and the custom-op
   strategies, wall time with a synchronize after each call, against the floor of one tiny kernel
   plus a synchronize; also CUDA-event time and CUDA-graph replay (the kernels without the host).
2. Bandwidth: batch 16384, the fused forward kernel's bytes (pred and targets read, gradient written)
   over its time, against a device-to-device copy measured in the same run.
3. packed against cuda_fused as the number of valid boxes grows from 1 to 100k.
4. cuda_conditional against cuda_fused at large M: does skipping the padded slots pay?

Timings are medians after warm-up: CUDA events for kernel time, the host clock for wall time.
CUDA only: on a machine without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from detector import ops
from detector.cases import random_case, sample_counts
from detector.data import make_targets
from detector.losses import STRATEGIES, get_strategy

HEADLINE = ("padded", "cuda_fused", "cuda_conditional", "packed")
VALID_BOXES = (1, 10, 100, 1_000, 10_000, 100_000)


def event_ms(fn, warmup: int = 10, repeats: int = 50) -> float:
    """Median CUDA-event milliseconds of ``fn()``, each call followed by a synchronize."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn, warmup: int = 20, repeats: int = 200) -> float:
    """Median host milliseconds of ``fn(); torch.cuda.synchronize()``."""
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


def graph_ms(fn, repeats: int = 50) -> float | None:
    """Median event milliseconds of replaying ``fn`` captured in a CUDA graph; None if it cannot be captured."""
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
    except Exception as err:  # noqa: BLE001  reported, not fatal: the other columns still stand
        print(f"  (CUDA-graph capture failed: {type(err).__name__}: {str(err).splitlines()[0][:100]})")
        return None
    return event_ms(graph.replay, warmup=3, repeats=repeats)


def strategy_case(name: str, pred: torch.Tensor, boxes_list: list, slots: int):
    """(forward, forward+backward) closures of a strategy on device tensors."""
    strategy = get_strategy(name)
    targets = make_targets(boxes_list, strategy.layout, slots).to("cuda")
    pred = pred.to("cuda").requires_grad_()

    def forward():
        with torch.no_grad():
            strategy(pred, targets)

    def forward_backward():
        pred.grad = None
        strategy(pred, targets).backward()

    return forward, forward_backward


def even_boxes(batch: int, slots: int, valid: int, pred_dtype, seed: int = 0):
    """A case with ``valid`` boxes spread evenly over the images (pred [B, M, 4], list of targets)."""
    pred, boxes_list = random_case(batch, slots, "full", pred_dtype, torch.uint8, seed=seed, nan_padding=False)
    per_image = [valid // batch + (b < valid % batch) for b in range(batch)]
    return pred, [boxes[:n] for boxes, n in zip(boxes_list, per_image, strict=True)]


def headline(pred_dtype) -> list[dict]:
    pred, boxes_list = random_case(1024, 256, "seed", pred_dtype, torch.uint8, seed=1024, nan_padding=False)
    records = []
    for name in HEADLINE:
        if name not in STRATEGIES or STRATEGIES[name].unavailable(torch.device("cuda")):
            continue
        forward, forward_backward = strategy_case(name, pred, boxes_list, 256)
        records.append(
            {
                "strategy": name,
                "pred_dtype": str(pred_dtype).replace("torch.", ""),
                "valid_boxes": sum(len(b) for b in boxes_list),
                "forward_wall_ms": wall_ms(forward),
                "forward_backward_wall_ms": wall_ms(forward_backward),
                "forward_backward_event_ms": event_ms(forward_backward),
                "forward_backward_graph_ms": graph_ms(forward_backward),
            }
        )
    return records


def floor_ms() -> float:
    """One tiny kernel plus a synchronize: what any one-launch loss pays at least."""
    x = torch.zeros(1, device="cuda")
    return wall_ms(lambda: x.add_(1))


def bandwidth(pred_dtype, batch: int = 16384, slots: int = 256) -> dict:
    pred, boxes_list = random_case(batch, slots, "seed", pred_dtype, torch.uint8, seed=7, nan_padding=False)
    boxes, counts = make_targets(boxes_list, "padded", slots).to("cuda")
    pred = pred.to("cuda")
    moved = 2 * pred.numel() * pred.element_size() + boxes.numel() * boxes.element_size()  # pred, grad, targets
    moved += counts.numel() * counts.element_size()
    fused = event_ms(lambda: torch.ops.detector.giou_loss.default(pred, boxes, counts, False), repeats=100)
    skipping = event_ms(lambda: torch.ops.detector.giou_loss.default(pred, boxes, counts, True), repeats=100)
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = event_ms(lambda: dst.copy_(src), repeats=100)
    copy_gbs = 2 * src.numel() / copy / 1e6  # read + write
    fused_gbs = moved / fused / 1e6
    return {
        "pred_dtype": str(pred_dtype).replace("torch.", ""),
        "batch": batch,
        "slots": slots,
        "bytes": moved,
        "fused_forward_ms": fused,
        "fused_GBps": fused_gbs,
        "conditional_forward_ms": skipping,
        "copy_ms": copy,
        "copy_GBps": copy_gbs,
        "fused_vs_copy": fused_gbs / copy_gbs,
    }


def packed_scaling(pred_dtype, batch: int = 1024, slots: int = 256) -> list[dict]:
    records = []
    for valid in VALID_BOXES:
        pred, boxes_list = even_boxes(batch, slots, valid, pred_dtype, seed=valid)
        row = {"valid_boxes": valid}
        for name in ("cuda_fused", "packed"):
            forward, forward_backward = strategy_case(name, pred, boxes_list, slots)
            row[f"{name}_forward_event_ms"] = event_ms(forward)
            row[f"{name}_forward_backward_wall_ms"] = wall_ms(forward_backward, repeats=100)
            row[f"{name}_forward_backward_graph_ms"] = graph_ms(forward_backward)
        records.append(row)
    return records


def skipping(pred_dtype, batch: int = 1024) -> list[dict]:
    records = []
    for slots in (256, 4096):
        for distribution in ("seed", "full"):
            for target_dtype in (torch.uint8, torch.float32):
                g = torch.Generator().manual_seed(slots)
                counts = sample_counts(distribution, batch, slots, g)
                pred = torch.rand(batch, slots, 4, device="cuda", dtype=torch.float32) * 100
                pred[..., 2:] += pred[..., :2] + 1
                boxes = (pred.detach() + 3).round().clamp(0, 255).to(target_dtype)
                pred, counts = pred.to(pred_dtype), counts.cuda()
                row = {
                    "slots": slots,
                    "distribution": distribution,
                    "target_dtype": str(target_dtype).replace("torch.", ""),
                    "valid_boxes": int(counts.sum()),
                }
                op = torch.ops.detector.giou_loss.default
                row["cuda_fused_forward_ms"] = event_ms(lambda: op(pred, boxes, counts, False))  # noqa: B023
                row["cuda_conditional_forward_ms"] = event_ms(lambda: op(pred, boxes, counts, True))  # noqa: B023
                records.append(row)
    return records


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.4f}" if value < 100 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--pred-dtype", default="bfloat16", help="pred dtype of the headline and scaling runs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; the kernel benchmark needs one (nothing to do)")
        return 0
    reason = ops.kernel_unavailable(torch.device("cuda"))
    if reason:
        print(f"bench_kernels: {reason}")
        return 1
    pred_dtype = getattr(torch, args.pred_dtype)
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}\n", flush=True)

    results = {"device": device, "torch": torch.__version__, "floor_ms": floor_ms()}
    results["headline"] = headline(pred_dtype) + headline(torch.float32)
    print(
        f"## Forward+backward, batch 1024, 256 slots, seed boxes (floor: one tiny kernel + sync "
        f"= {results['floor_ms']:.4f} ms)\n"
    )
    columns = [
        "strategy",
        "pred_dtype",
        "valid_boxes",
        "forward_wall_ms",
        "forward_backward_wall_ms",
        "forward_backward_event_ms",
        "forward_backward_graph_ms",
    ]
    print(table(results["headline"], columns) + "\n", flush=True)

    results["bandwidth"] = [bandwidth(torch.float32), bandwidth(torch.bfloat16)]
    print("## Fused forward bandwidth, batch 16384, 256 slots, seed boxes, uint8 targets\n")
    columns = [
        "pred_dtype",
        "bytes",
        "fused_forward_ms",
        "fused_GBps",
        "copy_GBps",
        "fused_vs_copy",
        "conditional_forward_ms",
    ]
    print(table(results["bandwidth"], columns) + "\n", flush=True)

    results["packed_scaling"] = packed_scaling(pred_dtype)
    print("## packed vs cuda_fused as valid boxes grow (batch 1024, 256 slots)\n")
    columns = ["valid_boxes"] + [
        f"{n}_{m}"
        for m in ("forward_event_ms", "forward_backward_wall_ms", "forward_backward_graph_ms")
        for n in ("cuda_fused", "packed")
    ]
    print(table(results["packed_scaling"], columns) + "\n", flush=True)

    results["skipping"] = skipping(pred_dtype)
    print("## cuda_conditional vs cuda_fused forward kernel (batch 1024)\n")
    columns = [
        "slots",
        "distribution",
        "target_dtype",
        "valid_boxes",
        "cuda_fused_forward_ms",
        "cuda_conditional_forward_ms",
    ]
    print(table(results["skipping"], columns) + "\n", flush=True)

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
