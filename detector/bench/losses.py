"""`make bench`: every registered strategy's loss alone, on device tensors, forward and forward+backward.

For each strategy x batch size x box distribution: warm-up calls, then repeated calls each followed by
a synchronize, timed with CUDA events on a GPU (host clock on the CPU); the median is reported. On a GPU,
strategies whose targets have static shapes are also timed as CUDA-graph replays of forward+backward,
which removes the host's launch overhead and shows the kernels' own time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from detector.bench.cases import random_case
from detector.bench.timing import event_ms, graph_ms, loss_closures
from detector.config import resolve_device
from detector.data import make_targets
from detector.losses import STRATEGIES, get_strategy
from detector.profiling import device_name


def bench_case(name: str, batch: int, distribution: str, cfg: DictConfig, device: torch.device) -> dict:
    bcfg, max_boxes = cfg.bench, cfg.data.max_boxes
    strategy = get_strategy(name)
    pred_dtype = getattr(torch, bcfg.pred_dtype)
    pred, boxes_list = random_case(
        batch, max_boxes, distribution, pred_dtype, torch.uint8, seed=batch, nan_padding=False
    )
    targets = make_targets(boxes_list, strategy.layout, max_boxes).to(device)
    pred = pred.to(device).requires_grad_()
    forward, forward_backward = loss_closures(strategy, pred, targets)
    timed = dict(device=device, warmup=bcfg.warmup, repeats=bcfg.repeats, max_seconds=bcfg.max_seconds)

    record = {
        "strategy": name,
        "layout": strategy.layout,
        "batch_size": batch,
        "distribution": distribution,
        "valid_boxes": sum(len(b) for b in boxes_list),
        "forward_ms": event_ms(forward, **timed),
        "forward_backward_ms": event_ms(forward_backward, **timed),
        "graph_forward_backward_ms": None,
    }
    if device.type == "cuda" and strategy.layout != "list":  # list targets mean host-side shapes: no graph
        record["graph_forward_backward_ms"] = graph_ms(forward_backward, bcfg.repeats, label=name)
    return record


def format_table(records: list[dict]) -> str:
    def ms(value):
        return "—" if value is None else f"{value:.4f}"

    lines = [
        "| strategy | batch | boxes | valid | fwd ms | fwd+bwd ms | fwd+bwd graph ms | fwd+bwd vs padded |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        base = next(
            (
                b
                for b in records
                if b["strategy"] == "padded"
                and (b["batch_size"], b["distribution"]) == (r["batch_size"], r["distribution"])
            ),
            None,
        )
        speedup = f"{base['forward_backward_ms'] / r['forward_backward_ms']:.2f}x" if base else "—"
        lines.append(
            f"| {r['strategy']} | {r['batch_size']} | {r['distribution']} | {r['valid_boxes']} | {ms(r['forward_ms'])} "
            f"| {ms(r['forward_backward_ms'])} | {ms(r['graph_forward_backward_ms'])} | {speedup} |"
        )
    return "\n".join(lines)


def run_bench(cfg: DictConfig) -> list[dict]:
    device = resolve_device(cfg)
    names = list(cfg.bench.strategies) or list(STRATEGIES)
    runnable = []
    for name in names:
        reason = get_strategy(name).unavailable(device)
        if reason:
            print(f"skipping {name}: {reason}")
        else:
            runnable.append(name)
    cases = [(b, d) for b in cfg.bench.batch_sizes for d in cfg.bench.distributions]
    print(
        f"benchmarking {len(runnable)} strategies x {len(cases)} cases on {device_name(device)} "
        f"(torch {torch.__version__}, pred {cfg.bench.pred_dtype}, {cfg.data.max_boxes} slots, "
        f"median of up to {cfg.bench.repeats} synchronised calls)"
    )
    records = []
    for batch, distribution in cases:
        for name in runnable:
            record = bench_case(name, batch, distribution, cfg, device)
            print(
                f"  {name:<17} batch {batch:<6} {distribution:<6} fwd {record['forward_ms']:9.4f} ms   "
                f"fwd+bwd {record['forward_backward_ms']:9.4f} ms",
                flush=True,
            )
            records.append(record)
    table = format_table(records)
    print(f"\n{device_name(device)}, torch {torch.__version__}\n{table}")
    out = Path(cfg.bench.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": device_name(device), "torch": torch.__version__, "config": OmegaConf.to_container(cfg.bench)}
    out.write_text(json.dumps({**meta, "results": records}, indent=2))
    print(f"results: {out}")
    return records
