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
import sys
from pathlib import Path

import torch

from detector.bench.cases import random_case, sample_counts
from detector.bench.timing import device_ms, event_ms, graph_ms, loss_closures, wall_ms
from detector.data import make_targets
from detector.kernels import cuda_op as ops
from detector.losses import STRATEGIES, get_strategy

HEADLINE = ("padded", "cuda_fused", "cuda_conditional", "packed")
VALID_BOXES = (1, 10, 100, 1_000, 10_000, 100_000)


def strategy_case(name: str, pred: torch.Tensor, boxes_list: list, slots: int):
    """(forward, forward+backward) closures of a strategy on device tensors."""
    strategy = get_strategy(name)
    targets = make_targets(boxes_list, strategy.layout, slots).to("cuda")
    return loss_closures(strategy, pred.to("cuda").requires_grad_(), targets)


def even_boxes(boxes_list: list, valid: int) -> list:
    """The first boxes of a full case's images, ``valid`` of them in all, spread evenly over the images."""
    batch = len(boxes_list)
    per_image = [valid // batch + (b < valid % batch) for b in range(batch)]
    return [boxes[:n] for boxes, n in zip(boxes_list, per_image, strict=True)]


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


class _Double(torch.autograd.Function):
    """The smallest Python autograd.Function: one kernel forward, one backward (a Python backward node)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def floors() -> dict:
    """What any loss pays on this host before its own work: wall ms of tiny kernels and autograd round trips."""
    x = torch.zeros((), device="cuda", requires_grad=True)
    pred, boxes_list = random_case(1024, 256, "seed", torch.bfloat16, torch.uint8, seed=1024, nan_padding=False)
    boxes, counts = make_targets(boxes_list, "padded", 256).to("cuda")
    pred = pred.to("cuda")

    def op_below_autograd():  # the op without its Python autograd layer
        with torch._C._AutoDispatchBelowAutograd():
            torch.ops.detector.giou_loss.default(pred, boxes, counts, False)

    def backward(fn):
        def step():
            x.grad = None
            fn(x).backward()

        return step

    return {
        "tiny_kernel_sync_ms": wall_ms(lambda: x.detach().add_(1)),
        "cpp_autograd_fwd_bwd_ms": wall_ms(backward(lambda t: t * 2)),
        "python_autograd_fwd_bwd_ms": wall_ms(backward(_Double.apply)),
        "op_forward_below_autograd_ms": wall_ms(op_below_autograd),
        "op_forward_no_grad_ms": wall_ms(lambda: torch.ops.detector.giou_loss.default(pred, boxes, counts, False)),
    }


def bandwidth(pred, boxes_list) -> dict:
    """Fused forward bytes over device time, against a device-to-device copy in the same run."""
    slots = pred.shape[1]
    boxes, counts = make_targets(boxes_list, "padded", slots).to("cuda")
    pred = pred.to("cuda")
    moved = 2 * pred.numel() * pred.element_size() + boxes.numel() * boxes.element_size()  # pred, grad, targets
    moved += counts.numel() * counts.element_size()
    op = torch.ops.detector.giou_loss.default
    fused = device_ms(lambda: op(pred, boxes, counts, False))
    skipping = device_ms(lambda: op(pred, boxes, counts, True))
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = device_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() / copy / 1e6  # read + write
    fused_gbs = moved / fused / 1e6
    return {
        "pred_dtype": str(pred.dtype).replace("torch.", ""),
        "batch": pred.shape[0],
        "slots": slots,
        "bytes": moved,
        "fused_forward_ms": fused,
        "fused_GBps": fused_gbs,
        "conditional_forward_ms": skipping,
        "copy_ms": copy,
        "copy_GBps": copy_gbs,
        "fused_vs_copy": fused_gbs / copy_gbs,
    }


def packed_scaling(pred_dtype, batch: int, slots: int = 256) -> list[dict]:
    """packed against cuda_fused, device time of the forward and of forward+backward, as boxes grow."""
    pred, full_boxes = random_case(batch, slots, "full", pred_dtype, torch.uint8, seed=batch, nan_padding=False)
    records = []
    for valid in VALID_BOXES:
        boxes_list = even_boxes(full_boxes, valid)
        row = {"batch": batch, "valid_boxes": valid}
        for name in ("cuda_fused", "packed"):
            forward, forward_backward = strategy_case(name, pred, boxes_list, slots)
            row[f"{name}_forward_device_ms"] = device_ms(forward)
            row[f"{name}_forward_backward_graph_ms"] = graph_ms(forward_backward)
            if batch <= 1024:
                row[f"{name}_forward_backward_wall_ms"] = wall_ms(forward_backward, repeats=100)
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
                row["cuda_fused_forward_ms"] = device_ms(lambda: op(pred, boxes, counts, False))  # noqa: B023
                row["cuda_conditional_forward_ms"] = device_ms(lambda: op(pred, boxes, counts, True))  # noqa: B023
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

    results = {"device": device, "torch": torch.__version__, "floors": floors()}
    print("## Host floors (wall ms, synchronised)\n")
    print(table([results["floors"]], list(results["floors"])) + "\n", flush=True)
    results["headline"] = headline(pred_dtype) + headline(torch.float32)
    print("## Forward+backward, batch 1024, 256 slots, seed boxes\n")
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

    pred, boxes_list = random_case(16384, 256, "seed", torch.float32, torch.uint8, seed=7, nan_padding=False)
    results["bandwidth"] = [bandwidth(pred, boxes_list), bandwidth(pred.bfloat16(), boxes_list)]
    del pred, boxes_list
    print("## Fused forward bandwidth (device time), batch 16384, 256 slots, seed boxes, uint8 targets\n")
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

    results["packed_scaling"] = packed_scaling(pred_dtype, 1024) + packed_scaling(pred_dtype, 16384)
    print("## packed vs cuda_fused as valid boxes grow (256 slots; device ms, and wall ms at batch 1024)\n")
    columns = ["batch", "valid_boxes"] + [
        f"{n}_{m}"
        for m in ("forward_device_ms", "forward_backward_graph_ms", "forward_backward_wall_ms")
        for n in ("cuda_fused", "packed")
    ]
    print(table(results["packed_scaling"], columns) + "\n", flush=True)

    results["skipping"] = skipping(pred_dtype)
    print("## cuda_conditional vs cuda_fused forward kernel, device ms (batch 1024)\n")
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
