"""``bench losses`` (``make bench``): every registered strategy's loss alone, forward and forward+backward.

For each strategy x batch size x box distribution (``bench.strategies``, ``bench.batch_sizes``,
``bench.distributions``; ``data.max_boxes`` slots; ``bench.pred_dtype`` predictions, uint8 targets):
``bench.warmup`` calls, then up to ``bench.repeats`` calls each followed by a synchronize (at most
``bench.max_seconds`` per measurement once 3 are taken), timed with CUDA events on a GPU and the host
clock on the CPU. On a GPU, strategies whose targets have static shapes are also timed as CUDA-graph
replays of forward+backward, which removes the host's launch overhead and shows the kernels' own time.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector import bench
from detector.bench.cases import random_case
from detector.bench.timing import budget, event_ms, graph_ms, loss_closures
from detector.config import resolve_device
from detector.losses import STRATEGIES, get_strategy
from detector.tables import markdown_table, run_header, speedup_cell, spread_cell
from detector.targets import make_targets

BASELINE = "padded"  # speed-ups are against this strategy in the same case


def bench_case(name: str, batch: int, distribution: str, cfg: DictConfig, device: torch.device) -> dict:
    max_boxes, timed = cfg.data.max_boxes, budget(cfg.bench)
    strategy = get_strategy(name)
    pred_dtype = getattr(torch, cfg.bench.pred_dtype)
    pred, boxes_list = random_case(
        batch, max_boxes, distribution, pred_dtype, torch.uint8, seed=batch, nan_padding=False
    )
    targets = make_targets(boxes_list, strategy.layout, max_boxes).to(device)
    pred = pred.to(device).requires_grad_()
    forward, forward_backward = loss_closures(strategy, pred, targets)
    graph = None
    if device.type == "cuda" and strategy.layout != "list":  # list targets mean host-side shapes: no graph
        graph = graph_ms(forward_backward, label=name, **timed)
    return {
        "strategy": name,
        "layout": strategy.layout,
        "batch_size": batch,
        "distribution": distribution,
        "valid_boxes": sum(len(b) for b in boxes_list),
        "forward_ms": event_ms(forward, device, **timed),
        "forward_backward_ms": event_ms(forward_backward, device, **timed),
        "graph_forward_backward_ms": graph,
    }


def format_table(records: list[dict]) -> str:
    """One row per strategy and case: median [quartiles] ms, and forward+backward speed-up vs padded."""
    baselines = {(r["batch_size"], r["distribution"]): r for r in records if r["strategy"] == BASELINE}
    rows = []
    for r in records:
        base = baselines.get((r["batch_size"], r["distribution"]))
        rows.append(
            [
                r["strategy"],
                r["batch_size"],
                r["distribution"],
                r["valid_boxes"],
                spread_cell(r["forward_ms"]),
                spread_cell(r["forward_backward_ms"]),
                spread_cell(r["graph_forward_backward_ms"]),
                "baseline"
                if r is base
                else speedup_cell(base and base["forward_backward_ms"], r["forward_backward_ms"]),
            ]
        )
    headers = ["strategy", "batch", "boxes", "valid", "fwd ms", "fwd+bwd ms", "fwd+bwd graph ms"]
    return markdown_table(headers + [f"fwd+bwd vs {BASELINE}"], rows, align="lrlrrrrr")


def run_bench(cfg: DictConfig) -> list[dict]:
    device = resolve_device(cfg)
    runnable = []
    for name in list(cfg.bench.strategies) or list(STRATEGIES):
        reason = get_strategy(name).unavailable(device)
        if reason:
            print(f"skipping {name}: {reason}")
        else:
            runnable.append(name)
    cases = [(b, d) for b in cfg.bench.batch_sizes for d in cfg.bench.distributions]
    print(
        f"bench losses: {len(runnable)} strategies x {len(cases)} cases on {run_header(device)} "
        f"(pred {cfg.bench.pred_dtype}, {cfg.data.max_boxes} slots; median [quartiles] ms of up to "
        f"{cfg.bench.repeats} synchronised calls)"
    )
    records = []
    for batch, distribution in cases:
        for name in runnable:
            r = bench_case(name, batch, distribution, cfg, device)
            print(
                f"  {name:<17} batch {batch:<6} {distribution:<6} fwd {spread_cell(r['forward_ms'])} ms   "
                f"fwd+bwd {spread_cell(r['forward_backward_ms'])} ms",
                flush=True,
            )
            records.append(r)
    bench.save(cfg, "losses", device, records, f"{run_header(device)}\n\n{format_table(records)}")
    return records
