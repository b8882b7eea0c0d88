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
from detector.config.device import resolve_device
from detector.data.targets import make_targets
from detector.lab.measure.cases import random_case
from detector.lab.measure.timing import budget, event_ms, graph_ms, loss_closures
from detector.lab.present.tables import WHICH_HEADING, markdown_table, speedup, speedup_cell, spread_cell, times
from detector.lab.record.provenance import run_header
from detector.losses import STRATEGIES, get_strategy

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
    fb_ms = event_ms(forward_backward, device, **timed)
    strategy.nonfinite_gradient()  # a user's backward of NaN: no time of it is worth printing
    return {
        "strategy": name,
        "layout": strategy.layout,
        "batch_size": batch,
        "distribution": distribution,
        "valid_boxes": sum(len(b) for b in boxes_list),
        "forward_ms": event_ms(forward, device, **timed),
        "forward_backward_ms": fb_ms,
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
    runnable, unavailable = [], {}
    for name in list(cfg.bench.strategies) or list(STRATEGIES):
        reason = get_strategy(name).unavailable(device)
        if reason:
            print(f"skipping {name}: {reason}")
            unavailable[name] = reason
        else:
            runnable.append(name)
    # smallest batch first: a strategy slower than bench.max_call_ms there is not timed at the larger ones
    cases = [(b, d) for b in sorted(cfg.bench.batch_sizes) for d in cfg.bench.distributions]
    print(
        f"bench losses: {len(runnable)} strategies x {len(cases)} cases on {run_header(device)} "
        f"(pred {cfg.bench.pred_dtype}, {cfg.data.max_boxes} slots; median [quartiles] ms of up to "
        f"{cfg.bench.repeats} synchronised calls)"
    )
    records, too_slow = [], {}  # name -> (batch, ms) of the call that exceeded bench.max_call_ms
    for batch, distribution in cases:
        for name in runnable:
            if name in too_slow and too_slow[name][0] < batch:
                print(
                    f"  {name:<17} batch {batch:<6} {distribution:<6} not timed: {too_slow[name][1]:.0f} ms a call at "
                    f"batch {too_slow[name][0]}, over bench.max_call_ms={cfg.bench.max_call_ms:g}"
                )
                continue
            r = bench_case(name, batch, distribution, cfg, device)
            print(
                f"  {name:<17} batch {batch:<6} {distribution:<6} fwd {spread_cell(r['forward_ms'])} ms   "
                f"fwd+bwd {spread_cell(r['forward_backward_ms'])} ms",
                flush=True,
            )
            records.append(r)
            if r["forward_backward_ms"].median > cfg.bench.max_call_ms:
                too_slow.setdefault(name, (batch, r["forward_backward_ms"].median))
    tables = [run_header(device), format_table(records), WHICH_HEADING, which(records, unavailable)]
    bench.save(cfg, "losses", device, records, "\n\n".join(tables))
    return records


# The strategies users arrive with, each column of the "which strategy" table: what they cost against the winner.
NEWCOMERS = {"torchvision": ("torchvision", "torchvision_padded"), "torch.nested": ("nested", "nested_compiled")}


def which(records: list[dict], unavailable: dict[str, str] | None = None) -> str:
    """Which strategy should I use? Per situation measured here (seed boxes: each batch size eager, as a CUDA
    graph on a GPU, and among the strategies that are torch.compile'd), the fastest strategy's forward+backward, the
    others within its noise (overlapping interquartile ranges), and what each newcomer costs against it. Every
    registered strategy passes the same correctness grid (tests/losses), so the fastest is the fastest correct."""
    seed = [r for r in records if r["distribution"] == "seed"]
    situations = []
    for batch in sorted({r["batch_size"] for r in seed}):
        rows = [r for r in seed if r["batch_size"] == batch]
        compiled = [r for r in rows if get_strategy(r["strategy"]).compiled]
        eager = [r for r in rows if r not in compiled]
        situations.append((f"eager, batch {batch}", eager, "forward_backward_ms"))
        if any(r["graph_forward_backward_ms"] for r in eager):
            situations.append((f"one CUDA graph, batch {batch}", eager, "graph_forward_backward_ms"))
        if compiled:
            situations.append((f"torch.compile'd, batch {batch}", compiled, "forward_backward_ms"))
    table = []
    for label, rows, key in situations:
        timed = sorted((r for r in rows if r[key]), key=lambda r: r[key].median)
        if not timed:
            continue
        best = timed[0]
        ties = [r["strategy"] for r in timed[1:] if speedup(r[key], best[key]) is None]
        row = [label, best["strategy"] + (f" (≈ {', '.join(ties)})" if ties else ""), spread_cell(best[key])]
        for names in NEWCOMERS.values():
            theirs = sorted((r for r in timed if r["strategy"] in names), key=lambda r: r[key].median)
            if theirs and theirs[0] is best:
                row.append(f"{best['strategy']} is the fastest")
            elif theirs:
                row.append(f"{theirs[0]['strategy']}: {times(theirs[0][key].median / best[key].median)} the time")
            elif all(name in (unavailable or {}) for name in names):
                row.append(f"unavailable here: {unavailable[names[0]]}")
            elif key == "graph_forward_backward_ms" and any(r["strategy"] in names for r in rows):
                row.append("its CUDA-graph capture failed (the log says why)")
            else:
                row.append("—")
        table.append(row)
    if not table:
        return "(no strategy timed)"
    headers = ["situation", "fastest", "fwd+bwd ms", *(f"{k}, against it" for k in NEWCOMERS)]
    return markdown_table(headers, table, align="lllll")
