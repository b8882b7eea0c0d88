"""``bench kernels`` (``make bench-kernels``): the custom kernels on a GPU, in five sections.

1. Host floors: wall ms of a tiny kernel, autograd round trips and the op below autograd, each with a
   synchronize: what any loss pays on this host before its own work.
2. Headline: batch 1024, 256 slots, seed boxes; forward+backward of padded and the custom-op strategies,
   wall time (host clock), CUDA-event time and CUDA-graph replay (the kernels without the host).
3. Byte floors: batch 16384, 256 slots, seed boxes, uint8 targets. For each kernel strategy the bytes a
   forward+backward must move (predictions read, gradient written, target boxes read, counts read: 2 x
   pred + targets + counts), over the rate of a 256 MiB device-to-device copy measured in the same run,
   is its floor; the table gives the forward+backward device time (CUDA-graph replays) and its ratio to
   that floor, then the forward alone: its device time and its read rate, the bytes a forward reading
   every slot must read (pred + targets + counts) over that time, as a % of the copy's rate. The floor
   counts every prediction slot, so a strategy that skips padded slots (triton, cuda_conditional, packed)
   may go below it (ratio < 1, read rate > 100 %); the table says so.
4. packed against cuda_fused as the valid boxes grow from 1 to 100k (batch 1024 and 16384, 256 slots);
   then packed's two ways to the prefix sums of the counts at batch 1024, 2048 and 4096 (seed boxes):
   every block scanning all the counts itself against block sums (each block sums its own images' counts
   and adds the sums the blocks before it publish; the default switches at 2048).
5. cuda_conditional against cuda_fused forward at 256 and 4096 slots (batch 1024): does skipping pay?

The case sizes above are fixed; ``bench.pred_dtype`` (sections 2–5; 2 and 3 also in float32) and the
timing budget ``bench.warmup``, ``bench.repeats``, ``bench.max_seconds`` come from the configuration.
Every time is a median [quartiles]; speed-ups print ``≈`` where the quartiles overlap. CUDA only: on a
machine without one it says so in one line and returns.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector import bench
from detector.data.targets import make_targets
from detector.kernels import cuda_op
from detector.lab.measure.cases import random_case, sample_counts
from detector.lab.measure.timing import budget, device_ms, event_ms, graph_ms, loss_closures, wall_ms
from detector.lab.present.tables import markdown_table, ms, significant, speedup_cell, spread_cell
from detector.lab.record.provenance import run_header
from detector.losses import STRATEGIES, get_strategy

HEADLINE = ("padded", "cuda_fused", "cuda_conditional", "packed")
KERNEL_STRATEGIES = ("triton", "cuda_fused", "cuda_conditional", "packed")  # one kernel forward each
FLOOR_BATCH = 16384
SLOTS = 256
COPY_BYTES = 256 * 2**20
VALID_BOXES = (1, 10, 100, 1_000, 10_000, 100_000)
SCAN_BATCHES = (1024, 2048, 4096)  # around the default block_scan_max_batch (2048) and its limit (4096)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def runnable(names) -> list[str]:
    return [n for n in names if n in STRATEGIES and not STRATEGIES[n].unavailable(torch.device("cuda"))]


def strategy_inputs(name: str, pred: torch.Tensor, boxes_list: list, slots: int):
    """A strategy with its CUDA predictions (requiring grad) and targets of its layout."""
    strategy = get_strategy(name)
    targets = make_targets(boxes_list, strategy.layout, slots).to("cuda")
    return strategy, pred.to("cuda").requires_grad_(), targets


def even_boxes(boxes_list: list, valid: int) -> list:
    """The first boxes of a full case's images, ``valid`` of them in all, spread evenly over the images."""
    batch = len(boxes_list)
    per_image = [valid // batch + (b < valid % batch) for b in range(batch)]
    return [boxes[:n] for boxes, n in zip(boxes_list, per_image, strict=True)]


class Double(torch.autograd.Function):
    """The smallest Python autograd.Function: one kernel forward, one backward (a Python backward node);
    the shell the eager triton path pays for (bench.triton_host)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def host_floors(timed: dict) -> dict:
    """What any loss pays on this host before its own work: wall ms of tiny kernels and autograd round trips."""
    x = torch.zeros((), device="cuda", requires_grad=True)
    pred, boxes_list = random_case(1024, SLOTS, "seed", torch.bfloat16, torch.uint8, seed=1024, nan_padding=False)
    boxes, counts = make_targets(boxes_list, "padded", SLOTS).to("cuda")
    pred = pred.to("cuda")
    op = torch.ops.detector.giou_loss.default

    def op_below_autograd():  # the op without its autograd layer
        with torch._C._AutoDispatchBelowAutograd():
            op(pred, boxes, counts, False)

    def backward(fn):
        def step():
            x.grad = None
            fn(x).backward()

        return step

    fns = {
        "tiny kernel + synchronize": lambda: x.detach().add_(1),
        "C++ autograd fwd+bwd": backward(lambda t: t * 2),
        "Python autograd.Function fwd+bwd": backward(Double.apply),
        "op forward below autograd": op_below_autograd,
        "op forward, no autograd recording": lambda: op(pred, boxes, counts, False),
    }
    return {label: wall_ms(fn, "cuda", **timed) for label, fn in fns.items()}


def headline(pred_dtype: torch.dtype, timed: dict) -> list[dict]:
    pred, boxes_list = random_case(1024, SLOTS, "seed", pred_dtype, torch.uint8, seed=1024, nan_padding=False)
    records = []
    for name in runnable(HEADLINE):
        forward, forward_backward = loss_closures(*strategy_inputs(name, pred, boxes_list, SLOTS))
        records.append(
            {
                "strategy": name,
                "pred_dtype": dtype_name(pred_dtype),
                "valid_boxes": sum(len(b) for b in boxes_list),
                "forward_wall_ms": wall_ms(forward, "cuda", **timed),
                "forward_backward_wall_ms": wall_ms(forward_backward, "cuda", **timed),
                "forward_backward_event_ms": event_ms(forward_backward, "cuda", **timed),
                "forward_backward_graph_ms": graph_ms(forward_backward, label=name, **timed),
            }
        )
    return records


def copy_rate(timed: dict) -> dict:
    """Device ms of a 256 MiB device-to-device copy and its rate in bytes moved (read + write) per ms."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = device_ms(lambda: dst.copy_(src), **timed)
    return {"bytes": 2 * COPY_BYTES, "ms": copy, "bytes_per_ms": 2 * COPY_BYTES / copy.median}


def input_bytes(pred: torch.Tensor, targets) -> int:
    """What a forward reading every slot reads: predictions, target boxes ([B, M, 4] or [N, 4]), counts."""
    boxes, counts = targets
    return pred.nbytes + boxes.nbytes + counts.nbytes


def byte_floors(pred_dtype: torch.dtype, copy: dict, timed: dict) -> list[dict]:
    """Each kernel strategy's forward+backward device time against its byte floor (the inputs read and the
    gradient written, over the copy's rate), and its forward's read rate."""
    pred, boxes_list = random_case(FLOOR_BATCH, SLOTS, "seed", pred_dtype, torch.uint8, seed=7, nan_padding=False)
    records = []
    for name in runnable(KERNEL_STRATEGIES):
        strategy, cuda_pred, targets = strategy_inputs(name, pred, boxes_list, SLOTS)
        forward, forward_backward = loss_closures(strategy, cuda_pred, targets)
        read = input_bytes(cuda_pred, targets)
        moved = read + cuda_pred.nbytes  # + the gradient written
        floor = moved / copy["bytes_per_ms"]
        both, alone = device_ms(forward_backward, **timed), device_ms(forward, **timed)
        records.append(
            {
                "strategy": name,
                "pred_dtype": dtype_name(pred_dtype),
                "bytes": moved,
                "floor_ms": floor,
                "forward_backward_ms": both,
                "vs_floor": both.median / floor,
                "forward_read_bytes": read,
                "forward_ms": alone,
                "forward_read_of_copy": read / alone.median / copy["bytes_per_ms"],
            }
        )
    return records


def packed_scaling(pred_dtype: torch.dtype, batch: int, timed: dict) -> list[dict]:
    """packed against cuda_fused, device time of the forward and of forward+backward, as boxes grow."""
    pred, full_boxes = random_case(batch, SLOTS, "full", pred_dtype, torch.uint8, seed=batch, nan_padding=False)
    records = []
    for valid in VALID_BOXES:
        boxes_list = even_boxes(full_boxes, valid)
        row = {"batch": batch, "valid_boxes": valid}
        for name in ("cuda_fused", "packed"):
            forward, forward_backward = loss_closures(*strategy_inputs(name, pred, boxes_list, SLOTS))
            row[f"{name}_forward_device_ms"] = device_ms(forward, **timed)
            row[f"{name}_forward_backward_graph_ms"] = graph_ms(forward_backward, label=name, **timed)
        records.append(row)
    return records


def scan_paths(pred_dtype: torch.dtype, timed: dict) -> list[dict]:
    """packed forward+backward device ms with every block scanning the counts itself (block_scan_max_batch =
    B) against block sums (block_scan_max_batch = 0), seed boxes."""

    def packed_op(limit: int):
        return lambda pred, targets: cuda_op.giou_loss_packed(pred, *targets, limit)

    records = []
    for batch in SCAN_BATCHES:
        pred, boxes_list = random_case(batch, SLOTS, "seed", pred_dtype, torch.uint8, seed=batch, nan_padding=False)
        targets = make_targets(boxes_list, "packed", SLOTS).to("cuda")
        cuda_pred = pred.to("cuda").requires_grad_()
        row = {"batch": batch, "valid_boxes": sum(len(b) for b in boxes_list)}
        for key, limit in (("block_scan_ms", batch), ("block_sums_ms", 0)):
            _, forward_backward = loss_closures(packed_op(limit), cuda_pred, targets)
            row[key] = device_ms(forward_backward, **timed)
        records.append(row)
    return records


def skipping(pred_dtype: torch.dtype, timed: dict, batch: int = 1024) -> list[dict]:
    """cuda_conditional against cuda_fused forward kernels, device ms, as slots and valid boxes vary."""
    op = torch.ops.detector.giou_loss.default
    records = []
    for slots in (256, 4096):
        for distribution in ("seed", "full"):
            for target_dtype in (torch.uint8, torch.float32):
                counts = sample_counts(distribution, batch, slots, torch.Generator().manual_seed(slots)).cuda()
                pred = torch.rand(batch, slots, 4, device="cuda", dtype=torch.float32) * 100
                pred[..., 2:] += pred[..., :2] + 1
                boxes = (pred + 3).round().clamp(0, 255).to(target_dtype)
                pred = pred.to(pred_dtype)
                records.append(
                    {
                        "slots": slots,
                        "distribution": distribution,
                        "target_dtype": dtype_name(target_dtype),
                        "valid_boxes": int(counts.sum()),
                        "cuda_fused_forward_ms": device_ms(lambda: op(pred, boxes, counts, False), **timed),  # noqa: B023
                        "cuda_conditional_forward_ms": device_ms(lambda: op(pred, boxes, counts, True), **timed),  # noqa: B023
                    }
                )
    return records


def tables(results: dict, copy: dict, header: str) -> str:
    out = [header + "; median [quartiles] ms\n"]
    floors = results["host_floors"]
    out.append("## Host floors (wall ms, synchronised)\n")
    out.append(markdown_table(["what", "ms"], [[k, spread_cell(v)] for k, v in floors.items()]) + "\n")

    out.append("## Forward+backward, batch 1024, 256 slots, seed boxes (ms)\n")
    headers = ["strategy", "pred", "valid", "fwd wall", "fwd+bwd wall", "fwd+bwd events", "fwd+bwd graph"]
    keys = ["forward_wall_ms", "forward_backward_wall_ms", "forward_backward_event_ms", "forward_backward_graph_ms"]
    rows = [
        [r["strategy"], r["pred_dtype"], r["valid_boxes"]] + [spread_cell(r[k]) for k in keys]
        for r in results["headline"]
    ]
    out.append(markdown_table(headers, rows, align="llrrrrr") + "\n")

    rate = copy["bytes_per_ms"] / 1e9  # TB/s
    out.append(f"## Byte floors, batch {FLOOR_BATCH}, {SLOTS} slots, seed boxes, uint8 targets")
    out.append(
        f"(floor = 2 x pred + targets + counts over the device-to-device copy's {significant(rate)} TB/s, "
        f"{spread_cell(copy['ms'])} ms; fwd read = pred + targets + counts over the forward's time). The floor "
        "counts every slot: a strategy whose loads skip the padded ones (triton, cuda_conditional, packed) can "
        "go under it, × floor < 1 and a read rate over 100 %, by reading less, not by a faster memory.\n"
    )
    headers = ["strategy", "pred", "floor MB", "floor ms", "fwd+bwd device ms", "× floor"]
    headers += ["fwd device ms", "fwd read GB/s", "fwd read % of copy"]
    rows = [
        [r["strategy"], r["pred_dtype"], significant(r["bytes"] / 1e6), ms(r["floor_ms"])]
        + [spread_cell(r["forward_backward_ms"]), significant(r["vs_floor"]) + "×", spread_cell(r["forward_ms"])]
        + [significant(r["forward_read_bytes"] / r["forward_ms"].median / 1e6)]
        + [f"{significant(100 * r['forward_read_of_copy'])} %"]
        for r in results["byte_floors"]
    ]
    out.append(markdown_table(headers, rows, align="llrrrrrrr") + "\n")

    out.append("## packed vs cuda_fused as valid boxes grow (256 slots, device ms)\n")
    headers = ["batch", "valid", "cuda_fused fwd", "packed fwd", "packed fwd speed-up"]
    headers += ["cuda_fused fwd+bwd graph", "packed fwd+bwd graph", "packed fwd+bwd speed-up"]
    rows = []
    for r in results["packed_scaling"]:
        row = [r["batch"], r["valid_boxes"]]
        for what in ("forward_device_ms", "forward_backward_graph_ms"):
            fused, packed = r[f"cuda_fused_{what}"], r[f"packed_{what}"]
            row += [spread_cell(fused), spread_cell(packed), speedup_cell(fused, packed)]
        rows.append(row)
    out.append(markdown_table(headers, rows) + "\n")

    out.append("## packed: prefix sums by every block itself vs block sums (fwd+bwd device ms, seed boxes)\n")
    headers = ["batch", "valid", "block scan", "block sums", "block scan speed-up"]
    rows = [
        [r["batch"], r["valid_boxes"], spread_cell(r["block_scan_ms"]), spread_cell(r["block_sums_ms"])]
        + [speedup_cell(r["block_sums_ms"], r["block_scan_ms"])]
        for r in results["scan_paths"]
    ]
    out.append(markdown_table(headers, rows) + "\n")

    out.append("## cuda_conditional vs cuda_fused forward kernel, batch 1024 (device ms)\n")
    headers = ["slots", "boxes", "targets", "valid", "cuda_fused", "cuda_conditional", "conditional speed-up"]
    rows = [
        [r["slots"], r["distribution"], r["target_dtype"], r["valid_boxes"]]
        + [spread_cell(r["cuda_fused_forward_ms"]), spread_cell(r["cuda_conditional_forward_ms"])]
        + [speedup_cell(r["cuda_fused_forward_ms"], r["cuda_conditional_forward_ms"])]
        for r in results["skipping"]
    ]
    out.append(markdown_table(headers, rows, align="rllrrrr") + "\n")
    return "\n".join(out)


def run_bench(cfg: DictConfig) -> dict | None:
    device = bench.gpu_device(cfg, "kernels", cuda_op.kernel_unavailable)
    if device is None:
        return None
    pred_dtype, timed = getattr(torch, cfg.bench.pred_dtype), budget(cfg.bench)
    dtypes = [pred_dtype] + ([torch.float32] if pred_dtype != torch.float32 else [])
    print(f"bench kernels on {run_header(device)} ...", flush=True)
    copy = copy_rate(timed)
    results = {
        "host_floors": host_floors(timed),
        "headline": [r for d in dtypes for r in headline(d, timed)],
        "copy": copy,
        "byte_floors": [r for d in dtypes for r in byte_floors(d, copy, timed)],
        "packed_scaling": packed_scaling(pred_dtype, 1024, timed) + packed_scaling(pred_dtype, FLOOR_BATCH, timed),
        "scan_paths": scan_paths(pred_dtype, timed),
        "skipping": skipping(pred_dtype, timed),
    }
    bench.save(cfg, "kernels", device, results, tables(results, copy, run_header(device)))
    return results
