"""``bench layers``: where the time of the ``triton`` strategy goes, layer by layer, on a GPU.

One case, the article's: batch 1024 x 256 slots, bf16 predictions, uint8 targets, ``seed`` and ``tail``
box counts (fixed here; compare strategies with ``bench losses``). For each: the forward op alone (the
path torch.compile traces, no autograd), the strategy's forward while autograd records, forward +
backward, and forward + backward replayed from a CUDA graph (the device time without the host); then,
for the ``seed`` case, each kernel's device time from the profiler and the autotuned configurations of
both kernels. ``python -m detector triton-host`` breaks the eager host path down further. Timing
budget: ``bench.warmup``, ``bench.repeats``, ``bench.max_seconds``. CUDA only: on a machine without one
it says so in one line and returns (the Triton interpreter would time numpy, not the kernel).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector import bench
from detector.data.targets import make_targets
from detector.kernels import jit, triton_giou
from detector.lab.measure.cases import random_case
from detector.lab.measure.timing import budget, event_ms, graph_ms
from detector.lab.present.tables import markdown_table, ms, spread_cell
from detector.lab.record.provenance import run_header
from detector.losses import get_strategy

BATCH, SLOTS = 1024, 256
DISTRIBUTIONS = ("seed", "tail")
PROFILED_CALLS = 20


def kernel_times(fn) -> list[dict]:
    """Each CUDA kernel of one ``fn()`` call and its device ms, from the profiler (mean of 20 calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.count]
    return [{"kernel": e.key[:60], "device_ms": e.device_time_total / PROFILED_CALLS / 1e3} for e in events]


def layer_times(distribution: str, timed: dict) -> tuple[dict, object]:
    """(layer -> Stats, the forward+backward closure) of the triton strategy on one case."""
    pred, boxes_list = random_case(
        BATCH, SLOTS, distribution, torch.bfloat16, torch.uint8, seed=BATCH, nan_padding=False
    )
    pred = pred.to("cuda").requires_grad_()
    boxes, counts = targets = make_targets(boxes_list, "padded", SLOTS).to("cuda")
    strategy, detached = get_strategy("triton"), pred.detach()
    op = torch.ops.detector.giou_loss_triton.default

    def forward_backward():
        pred.grad = None
        strategy(pred, targets).backward()

    layers = {
        "forward op (compile's path), no autograd": event_ms(lambda: op(detached, boxes, counts), "cuda", **timed),
        "strategy forward, autograd recording": event_ms(lambda: strategy(pred, targets), "cuda", **timed),
        "strategy forward + backward": event_ms(forward_backward, "cuda", **timed),
        "forward + backward, CUDA graph": graph_ms(forward_backward, label="triton", **timed),
    }
    return {"distribution": distribution, "valid_boxes": int(counts.sum()), "layers_ms": layers}, forward_backward


def run_bench(cfg: DictConfig) -> dict | None:
    device = bench.gpu_device(cfg, "layers", triton_giou.triton_unavailable)
    if device is None:
        return None
    timed = budget(cfg.bench)
    print(f"bench layers on {run_header(device)}, triton {jit.triton.__version__}")
    print(f"triton strategy, batch {BATCH} x {SLOTS} slots, bf16 predictions, uint8 targets; median [quartiles] ms\n")
    cases, kernels = [], []
    for distribution in DISTRIBUTIONS:
        case, forward_backward = layer_times(distribution, timed)
        cases.append(case)
        if distribution == DISTRIBUTIONS[0]:
            kernels = kernel_times(forward_backward)
    headers = ["layer"] + [f"{c['distribution']} ({c['valid_boxes']} boxes)" for c in cases]
    rows = [[layer] + [spread_cell(c["layers_ms"][layer]) for c in cases] for layer in cases[0]["layers_ms"]]
    tuned = {"forward": triton_giou._giou_loss_forward_kernel, "backward": triton_giou._giou_loss_backward_kernel}
    autotuned = {f"{name} {key}": str(config) for name, kernel in tuned.items() for key, config in kernel.cache.items()}
    markdown = [
        f"{run_header(device)}, triton {jit.triton.__version__}",
        "",
        markdown_table(headers, rows),
        "",
        f"## Kernels of one forward + backward, {DISTRIBUTIONS[0]} boxes (profiler, mean of {PROFILED_CALLS})",
        "",
        markdown_table(["kernel", "device ms"], [[k["kernel"], ms(k["device_ms"])] for k in kernels]),
        "",
        "autotuned configs (key: M, dtypes):",
        "",
        *(f"- {k}: {v}" for k, v in autotuned.items()),
    ]
    results = {"cases": cases, "kernels": kernels, "autotuned": autotuned}
    bench.save(cfg, "layers", device, results, "\n".join(markdown))
    return results
