"""Where the eager time of the ``triton`` strategy goes, on a GPU: ``python -m detector triton-host``.

1. Host path, batch 1024 x 256 slots, bf16 predictions, uint8 targets, seed boxes: median [quartiles]
   wall ms of calls each followed by a synchronize (host clock, launch overhead included), from the
   floors any loss pays (a tiny kernel; the smallest C++ and Python autograd forward+backward) through
   the forward kernel's launch (Triton's own launcher; the cached CompiledKernel the eager path uses)
   to the strategy's forward and forward+backward, and the same through the ops (torch.compile's path,
   run eagerly); then forward+backward replayed from a CUDA graph: the device time without the host.
2. Bytes, batch 16384 x 256: forward+backward device time against the byte floor, 2 x pred + targets +
   counts bytes over the rate of a 256 MiB device-to-device copy measured here.

A quick diagnostic (well under a minute), not a ``bench`` target: it prints and writes nothing.
"""

from __future__ import annotations

import torch

from detector.bench.kernels import Double
from detector.data.targets import make_targets
from detector.kernels import jit, triton_giou
from detector.lab.measure.cases import random_case
from detector.lab.measure.timing import device_ms, graph_ms, wall_ms
from detector.lab.present.tables import markdown_table, ms, spread_cell
from detector.losses import get_strategy

SLOTS = 256
COPY_BYTES = 256 * 2**20


def strategy_case(batch: int, distribution: str, pred_dtype: torch.dtype):
    """(pred [B, M, 4] requiring grad, PaddedTargets) on the GPU; uint8 targets, no NaN padding."""
    pred, boxes_list = random_case(batch, SLOTS, distribution, pred_dtype, torch.uint8, seed=batch, nan_padding=False)
    return pred.cuda().requires_grad_(), make_targets(boxes_list, "padded", SLOTS).to("cuda")


def backward_of(loss_fn, leaf: torch.Tensor):
    def step():
        leaf.grad = None
        loss_fn().backward()

    return step


def host_path() -> list[list[str]]:
    """Rows (what, wall ms) of section 1, and the CUDA-graph device time of forward+backward."""
    pred, targets = strategy_case(1024, "seed", torch.bfloat16)
    boxes, counts = targets
    strategy, op = get_strategy("triton"), torch.ops.detector.giou_loss_triton.default
    tiny = torch.zeros((), device="cuda", requires_grad=True)
    kernel, batch = triton_giou._giou_loss_forward_kernel, pred.shape[0]
    loss, inv_count, work = triton_giou._forward_outputs(pred)
    args = (pred.detach(), boxes, counts, work, loss, inv_count, batch, SLOTS)
    grid = triton_giou._forward_grid(batch, pred.device)

    def triton_launcher():
        kernel[grid](*args, EPS=triton_giou.EPS)

    def eager_launch():
        triton_giou._launch(kernel, grid, *args)

    def forward_no_grad():
        with torch.no_grad():
            strategy(pred, targets)

    # The raw launches reuse one work buffer: after the first, the kernel's sums are not reset, which
    # changes nothing in its time. The first _launch call autotunes; the timers warm up before timing.
    fns = {
        "tiny CUDA kernel + synchronize": lambda: tiny.detach().add_(1),
        "C++ autograd fwd+bwd (p.sum().backward())": backward_of(lambda: tiny.sum(), tiny),
        "Python autograd.Function fwd+bwd": backward_of(lambda: Double.apply(tiny), tiny),
        "forward kernel, Triton's launcher (autotuner + JITFunction.run)": triton_launcher,
        "forward kernel, the eager path's launch (cached CompiledKernel)": eager_launch,
        "triton strategy forward (no grad)": forward_no_grad,
        "triton strategy forward+backward": backward_of(lambda: strategy(pred, targets), pred),
        "the ops (compile's path) eagerly, forward+backward": backward_of(lambda: op(pred, boxes, counts)[0], pred),
    }
    rows = [[what, spread_cell(wall_ms(fn, "cuda", warmup=20, repeats=300))] for what, fn in fns.items()]
    graphed = graph_ms(backward_of(lambda: strategy(pred, targets), pred), label="triton")
    rows.append(["triton strategy forward+backward, CUDA graph (device time)", spread_cell(graphed)])
    return rows


def byte_floors() -> list[list[str]]:
    """Rows of section 2: forward and forward+backward device ms against the byte floor."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bytes_per_ms = 2 * COPY_BYTES / device_ms(lambda: dst.copy_(src)).median
    strategy, rows = get_strategy("triton"), []
    for distribution in ("seed", "full"):
        for pred_dtype in (torch.bfloat16, torch.float32):
            pred, targets = strategy_case(16384, distribution, pred_dtype)
            floor = (2 * pred.nbytes + targets.boxes.nbytes + targets.counts.nbytes) / bytes_per_ms
            forward = device_ms(lambda: strategy(pred, targets))  # noqa: B023  (called right here)
            both = device_ms(backward_of(lambda: strategy(pred, targets), pred))  # noqa: B023
            name = str(pred_dtype).replace("torch.", "")
            valid = int(targets.counts.sum())
            rows.append([f"{distribution} ({valid} boxes), {name}", ms(floor), ms(forward.median), ms(both.median)])
            rows[-1].append(f"{both.median / floor:.2f}x")
    print(f"copy rate: {bytes_per_ms / 1e6:.0f} GB/s")
    return rows


def run_diagnostic() -> None:
    if not torch.cuda.is_available() or jit.triton is None:
        print("triton_host: needs a CUDA device and triton (nothing to do)")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {jit.triton.__version__}\n")
    print("## Host path: batch 1024 x 256 slots, bf16, uint8 targets, seed boxes (wall ms, median [quartiles])\n")
    print(markdown_table(["what", "ms"], host_path()) + "\n")
    print("## Bytes: batch 16384 x 256 slots, uint8 targets (device ms)\n")
    headers = ["case", "byte floor", "forward", "forward+backward", "fwd+bwd / floor"]
    print(markdown_table(headers, byte_floors()) + "\n")
    tuned = {"forward": triton_giou._giou_loss_forward_kernel, "backward": triton_giou._giou_loss_backward_kernel}
    for name, kernel in tuned.items():
        print(f"autotuned {name}: " + "; ".join(f"{key}: {config}" for key, config in kernel.cache.items()))
