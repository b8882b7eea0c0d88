"""`make shapes` (``python -m detector shapes [SOURCE]``): the shape of a dataset's targets, and the strategy it
predicts fastest for them.

For the boxes of SOURCE (``data.boxes``: synthetic, coco:<instances.json> or widerface:<wider_face_*_bbx_gt.txt>)
at ``data.max_boxes`` slots (after ``data.over_max_boxes``) and batch ``data.batch_size``:

- the histogram of boxes an image, as text and as a PNG;
- the padding at those slots: the share of a padded batch's slots that hold no box;
- the images over the slots, and the boxes ``data.over_max_boxes=truncate`` drops from them;
- the strategy predicted fastest, with its reason: each strategy's cost per slot against its cost per box
  (detector/lab/measure/costs.py: bench losses' result file of this device, else a cheap timing here, which it says);
- the check: the newest profile run of each strategy over this source at these slots, batch and device
  (``make profile STRATEGY=<name> BOXES=<source>``), its step as training runs it, and where it disagrees with
  the prediction;
- each strategy's loss memory predicted from the same counts: the peak its forward rises to in "calc loss", bytes a
  slot times the batch's B·M slots plus bytes a box times its boxes (detector/lab/measure/costs.py ``MemoryCost``,
  measured here), against the calc loss peak rise of those profiles (within MEMORY_AGREES).

Everything goes to a new ``<dir of profile.out_dir>/shapes/<source's name>/<time>/``: shapes.md, shapes.json
and counts.png.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from omegaconf import DictConfig

from detector.checked import RecordError
from detector.config import device_name, resolve_device
from detector.data import FaceSampler
from detector.data.annotations import SYNTHETIC, read_annotations
from detector.folders import new_run_dir
from detector.lab.measure import costs as costing
from detector.lab.present.tables import cell_text, code_text, markdown_table, significant, speedup, times
from detector.lab.record.measures import memory_text
from detector.lab.record.run import SUMMARY, ProfileRecord, read_summary
from detector.lab.record.spread import Spread

SYNTHETIC_SAMPLES = 20_000  # the synthetic faces' counts are drawn: enough for a 1 % share to show


def run_shapes(cfg: DictConfig) -> dict:
    """The shape report of ``cfg.data``'s boxes (see the module docstring); returns what shapes.json holds."""
    data, device = cfg.data, resolve_device(cfg)
    counts = box_counts(data)
    slots, batch = data.max_boxes, data.batch_size
    kept = np.minimum(counts, slots)
    report = {
        "source": data.boxes,
        "device": device_name(device),
        "images": len(counts),
        "boxes": int(counts.sum()),
        "max_boxes": slots,
        "over_max_boxes": data.over_max_boxes,
        "batch_size": batch,
        "histogram": histogram(counts, slots),
        "padding": 1 - float(kept.sum()) / (len(counts) * slots),
        "over": {"images": int((counts > slots).sum()), "dropped": int((counts - kept).sum())},
        "batch": {"slots": batch * slots, "boxes": batch * float(kept.mean())},
    }
    found = find_costs(cfg, kept, device)
    report["costs"] = {"source": found.source, "file": found.file, "strategies": [asdict(c) for c in found.costs]}
    report["predicted"] = predict(found.costs, report["batch"]["slots"], report["batch"]["boxes"])
    report["measured"] = measured(cfg, report)
    report["memory"] = predicted_memory(cfg, kept, device, report)
    out = new_run_dir(Path(cfg.profile.out_dir).parent / "shapes" / source_name(data.boxes))
    draw_histogram(report, out / "counts.png")
    markdown = shapes_markdown(report, out)
    (out / "shapes.md").write_text(markdown + "\n")
    (out / "shapes.json").write_text(json.dumps(report, indent=2))
    print(markdown)
    print(f"\nshapes.md, shapes.json and counts.png in {out}/")
    return report


def box_counts(data: DictConfig) -> np.ndarray:
    """[I] the boxes of each image of the source: the file's, or the synthetic faces' first SYNTHETIC_SAMPLES."""
    if data.boxes != SYNTHETIC:
        return read_annotations(data.boxes).counts
    sampler = FaceSampler(data.image_size, data.max_boxes, data.seed, data.count_std, data.tail_fraction, data.tail_min)
    return np.array([sampler.count(np.random.default_rng([data.seed, i])) for i in range(SYNTHETIC_SAMPLES)])


def source_name(source: str) -> str:
    """``widerface-wider_face_train_bbx_gt``: a folder name for a source."""
    if source == SYNTHETIC:
        return source
    kind, _, path = source.partition(":")
    return f"{kind}-{Path(path).stem}"


def histogram(counts: np.ndarray, slots: int) -> list[list[int]]:
    """[[lo, hi, images], ...]: images with lo..hi boxes, in bins 0, 1, 2–3, 4–7, ... split at the slots."""
    largest = int(counts.max(initial=0))
    edges = {0, 1, slots + 1} | {2**k for k in range(1, max(1, largest).bit_length() + 1)}
    edges = sorted(e for e in edges if e <= largest) + [largest + 1]
    found = np.histogram(counts, bins=edges)[0] if len(edges) > 1 else [len(counts)]
    return [[lo, hi - 1, int(n)] for lo, hi, n in zip(edges, edges[1:], found, strict=False)]


# ----------------------------------------------------------------------------- the prediction


def find_costs(cfg: DictConfig, kept: np.ndarray, device) -> costing.Costs:
    """bench losses' result file of this device, else a cheap timing here on a batch of the data's counts."""
    path = Path(cfg.bench.out).parent / "losses.json"
    found, why = costing.from_bench(path, device_name(device), cfg.data.batch_size, cfg.data.max_boxes)
    if found:
        wanted = list(cfg.bench.strategies)
        found.costs = [c for c in found.costs if not wanted or c.strategy in wanted]
        return found
    names, left = costing.quick_strategies(list(cfg.bench.strategies), device)
    batch = np.random.default_rng(cfg.data.seed).choice(kept, size=cfg.data.batch_size)  # a batch of the data
    timed = costing.timed_here(names, batch, cfg.data.max_boxes, device, why)
    if left:
        timed.source += f"; not timed: {', '.join(left)} (compiled, emulated or unavailable here: bench.strategies)"
    return timed


TIE = 1.05  # predictions within 5 % of the fastest's are ties: a model from a few timed cases is no finer


def predict(costs: list[costing.Cost], slots: int, boxes: float) -> dict | None:
    """The strategies ranked by their predicted loss ms at a batch of ``slots`` slots and ``boxes`` boxes, the
    fastest first, those within TIE of it, and the reason: what it pays for, against the fastest that pays mostly
    for the other (or the next) and against padded."""
    if not costs:
        return None
    ranked = sorted(costs, key=lambda c: c.at(slots, boxes))
    best = ranked[0]
    bound = best.bound(slots, boxes)
    other = next((c for c in ranked if c.bound(slots, boxes) != bound), None)
    reason = f"{best.strategy} pays mostly for the {bound}: {cost_sum(best, slots, boxes)}"
    if other:
        reason += f"; the fastest that pays mostly for the {other.bound(slots, boxes)}, {other.strategy}: "
    elif len(ranked) > 1:
        other = ranked[1]
        reason += f"; every strategy pays mostly for the {bound} here; the next, {other.strategy}: "
    reason += cost_sum(other, slots, boxes) if other else ""
    padded = next((c for c in ranked if c.strategy == "padded"), None)
    if padded and padded not in (best, other):
        reason += f"; padded: {cost_sum(padded, slots, boxes)}"
    return {
        "strategy": best.strategy,
        "ties": [c.strategy for c in ranked[1:] if c.at(slots, boxes) <= TIE * best.at(slots, boxes)],
        "reason": reason,
        "ranking": [[c.strategy, c.at(slots, boxes), c.bound(slots, boxes)] for c in ranked],
    }


def cost_sum(cost: costing.Cost, slots: int, boxes: float) -> str:
    """``0.0123 µs a slot × 65,536 slots + 0.35 µs a box × 1,640 boxes = 1.38 ms``."""
    return (
        f"{significant(cost.per_slot_ms * 1e3)} µs a slot × {slots:,} slots + {significant(cost.per_box_ms * 1e3)} µs "
        f"a box × {boxes:,.0f} boxes = {significant(cost.at(slots, boxes))} ms"
    )


# ----------------------------------------------------------------------------- the check: profiles over this source


def profiles_over(profile_dir: Path, source: str, slots: int, batch: int, device: str) -> list[ProfileRecord]:
    """The newest train-mode run of each strategy under ``profile_dir`` over ``source`` at these slots, batch and
    device (a folder of runs from before data.boxes counts as synthetic)."""
    found, wanted = [], ("train", same_file(source), slots, batch, device)
    for group in sorted(p for p in profile_dir.iterdir() if p.is_dir()) if profile_dir.is_dir() else []:
        for folder in sorted((p.parent for p in group.glob(f"*/{SUMMARY}")), key=lambda p: p.name, reverse=True):
            try:
                record = read_summary(folder)
            except RecordError:
                continue
            boxes = same_file(record.data.boxes if record.data else SYNTHETIC)
            if (record.mode, boxes, record.max_boxes, record.batch_size, record.device) == wanted:
                found.append(record)
                break
    return found


def same_file(source: str) -> str:
    """``widerface:/abs/path/gt.txt`` for ``widerface:gt.txt``: one text for one file, however it was named."""
    kind, sep, path = source.partition(":")
    return f"{kind}:{Path(path).resolve()}" if sep and path else source


def measured(cfg: DictConfig, report: dict) -> dict:
    """The profiles over this source against the prediction: each one's step as training runs it, the fastest, and
    every pair the two order differently (by the one rule: medians whose quartiles overlap are ≈)."""
    runs = profiles_over(
        Path(cfg.profile.out_dir), report["source"], report["max_boxes"], report["batch_size"], report["device"]
    )
    steps = {r.strategy: (r.timed_step() or r.stats("step"), str(r.folder)) for r in runs}
    steps = {name: found for name, found in steps.items() if found[0]}
    predicted = {name: ms for name, ms, _ in (report["predicted"] or {}).get("ranking", [])}
    result = {"profile_dir": cfg.profile.out_dir, "runs": {n: [asdict(s), f] for n, (s, f) in steps.items()}}
    result["noisy"] = {r.strategy: r.noise_reasons() for r in runs if r.noisy and r.strategy in steps}
    if not steps:
        return result | {"fastest": None, "disagreements": []}
    fastest = min(steps, key=lambda n: steps[n][0].median)
    result["fastest"] = [fastest] + [n for n in steps if n != fastest and not speedup(steps[n][0], steps[fastest][0])]
    disagreements = []
    for a in predicted:
        for b in predicted:
            if a in steps and b in steps and predicted[a] < predicted[b]:
                x = speedup(steps[a][0], steps[b][0])  # > 1: b's step measured faster than a's
                if x and x > 1:
                    disagreements.append([a, b, x])
    return result | {"disagreements": disagreements}


# ----------------------------------------------------------------------------- memory


# A prediction and a profile agree where neither is more than this many times the other: the profile's calc loss also
# counts the step's own small tensors (the boxes' count, the global mean) and its batches' box counts vary
MEMORY_AGREES = 1.5


def predicted_memory(cfg: DictConfig, kept: np.ndarray, device, report: dict) -> dict:
    """Each strategy's loss memory at the report's batch from its bytes a slot and a box (measured here on a batch of
    the data's counts), and the calc loss peak rise of the profiles over this source, where there are any."""
    names, left = costing.quick_strategies(list(cfg.bench.strategies), device)
    batch = np.random.default_rng(cfg.data.seed).choice(kept, size=cfg.data.batch_size)  # a batch of the data
    print(f"shapes: measuring {len(names)} strategies' loss memory here ...", flush=True)
    costs = costing.memory_here(names, batch, cfg.data.max_boxes, device)
    slots, boxes = report["batch"]["slots"], report["batch"]["boxes"]
    runs = profiles_over(
        Path(cfg.profile.out_dir), report["source"], report["max_boxes"], report["batch_size"], report["device"]
    )
    profiled = {r.strategy: r.stats("calc loss", "peak_rise_bytes") for r in runs}
    rows = []
    for cost in sorted(costs, key=lambda c: c.at(slots, boxes)):
        found = profiled.get(cost.strategy)
        rows.append(asdict(cost) | {"predicted": cost.at(slots, boxes), "profiled": found.median if found else None})
    return {"strategies": rows, "not_measured": left}


# ----------------------------------------------------------------------------- the report


def shapes_markdown(report: dict, out: Path) -> str:
    """shapes.md: the counts, the padding, the images over the slots, the prediction and the check."""
    slots, batch = report["max_boxes"], report["batch_size"]
    lines = [
        f"# Shapes of {cell_text(report['source'])}",
        "",
        f"{report['images']:,} images, {report['boxes']:,} boxes ({report['boxes'] / report['images']:.2f} an image); "
        f"{slots:,} slots an image (data.max_boxes), batch {batch:,} (data.batch_size).",
        "",
        markdown_table(
            ["boxes an image", "images", "share", ""],
            [
                [f"{lo}" if lo == hi else f"{lo}–{hi}", f"{n:,}", f"{100 * n / report['images']:.2f} %"]
                + ["over the slots" if lo > slots else ""]
                for lo, hi, n in report["histogram"]
            ],
            "lrrl",
        ),
        "",
        f"![boxes an image]({(out / 'counts.png').name})",
        "",
        f"**Padding at {slots:,} slots**: {100 * report['padding']:.1f} % of a padded batch's slots hold no box "
        f"({report['batch']['slots']:,} slots for {report['batch']['boxes']:,.0f} boxes on average a batch).",
        "",
        over_line(report),
        "",
        "## The strategy predicted fastest",
        "",
        f"Costs from {cell_text(report['costs']['source'])}.",
        "",
    ]
    lines += prediction_lines(report)
    lines += ["", "## The check: profiles over this source", ""] + check_lines(report)
    lines += ["", "## Loss memory", ""] + memory_lines(report)
    return "\n".join(lines)


def memory_lines(report: dict) -> list[str]:
    """The loss memory table: bytes a slot and a box, the peak rise predicted at the batch, the profiles' calc loss."""
    memory = report.get("memory") or {"strategies": []}
    if not memory["strategies"]:
        return ["No strategy's loss memory could be measured here (bench.strategies names none that runs here)."]
    slots, boxes = report["batch"]["slots"], report["batch"]["boxes"]
    rows, off = [], []
    for row in memory["strategies"]:
        profiled, predicted = row["profiled"], row["predicted"]
        ratio = profiled / predicted if profiled and predicted else None
        if ratio is not None and not 1 / MEMORY_AGREES <= ratio <= MEMORY_AGREES:
            off.append(f"{cell_text(row['strategy'])} ({ratio:.2f}×)")
        rows.append(
            [
                row["strategy"],
                significant(row["per_slot_bytes"]),
                significant(row["per_box_bytes"]),
                memory_text(predicted),
            ]
            + [memory_text(profiled) if profiled is not None else "—", f"{ratio:.2f}×" if ratio else "—"]
        )
    headers = ["strategy", "B a slot", "B a box", "predicted peak rise", "profiled (calc loss)", "profiled / predicted"]
    lines = [
        f"The peak each strategy's loss forward rises to in calc loss, as training runs it: bytes a slot × {slots:,} "
        f"slots + bytes a box × {boxes:,.0f} boxes, measured here ({cell_text(memory['strategies'][0]['measured'])}), "
        "against the "
        "calc loss of the profiles over this source (the median peak rise).",
        "",
        markdown_table(headers, rows, "lrrrrr"),
    ]
    if any(row["profiled"] is not None for row in memory["strategies"]):
        verdict = (
            f"off by more than {MEMORY_AGREES}× for {', '.join(off)}"
            if off
            else f"within {MEMORY_AGREES}× for every one profiled"
        )
        lines += ["", f"**The memory prediction** is {verdict}."]
    if memory.get("not_measured"):
        names = ", ".join(map(cell_text, memory["not_measured"]))
        lines += ["", f"Not measured here: {names} (compiled, emulated or unavailable)."]
    return lines


def over_line(report: dict) -> str:
    over, slots = report["over"], report["max_boxes"]
    if not over["images"]:
        return f"**Images over the slots**: none holds more than {slots:,} boxes."
    share = 100 * over["images"] / report["images"]
    fate = {
        "truncate": f"data.over_max_boxes=truncate drops their {over['dropped']:,} smallest boxes "
        f"({100 * over['dropped'] / report['boxes']:.2f} % of the boxes)",
        "refuse": "data.over_max_boxes=refuse refuses the run",
    }.get(report["over_max_boxes"], "")
    return f"**Images over the slots**: {over['images']:,} ({share:.2f} %) hold more than {slots:,} boxes: {fate}."


def prediction_lines(report: dict) -> list[str]:
    predicted = report["predicted"]
    if not predicted:
        return ["No strategy could be costed (bench.strategies names none that runs here)."]
    costs = {c["strategy"]: c for c in report["costs"]["strategies"]}
    rows = [
        [name, f"{significant(costs[name]['per_slot_ms'] * 1e3)}", f"{significant(costs[name]['per_box_ms'] * 1e3)}"]
        + [significant(ms), bound, costs[name]["measured"]]
        for name, ms, bound in predicted["ranking"]
    ]
    headers = ["strategy", "µs a slot", "µs a box", "predicted loss ms", "pays mostly for", "measured on"]
    ties = f" ({', '.join(map(cell_text, predicted['ties']))} within {TIE - 1:.0%})" if predicted.get("ties") else ""
    return [
        f"**{cell_text(predicted['strategy'])}**{ties}, because {cell_text(predicted['reason'])}.",
        "",
        markdown_table(headers, rows, "lrrrll"),
    ]


def check_lines(report: dict) -> list[str]:
    check, predicted = report["measured"], report["predicted"]
    runs = check["runs"]
    if not runs:
        example = (predicted or {}).get("strategy", "padded")
        command = code_text(f"make profile STRATEGY={example} BOXES={report['source']}")
        return [
            f"No profile run over this source at {report['max_boxes']} slots, batch {report['batch_size']} on "
            f"{cell_text(report['device'])} in {cell_text(check['profile_dir'])}: {command} (and padded) checks the "
            "prediction; `make shapes` then says where they disagree."
        ]
    noisy = check.get("noisy", {})
    rows = [
        [name, stats_text(Spread(**spread)), "; ".join(noisy[name]) if name in noisy else "quiet", code_text(folder)]
        for name, (spread, folder) in runs.items()
    ]
    lines = [markdown_table(["strategy", "step ms as training runs it", "noise", "run"], rows, "lrll"), ""]
    if noisy:
        lines += [f"Noisy runs ({', '.join(map(cell_text, noisy))}): their times may not hold on a quiet machine.", ""]
    fastest = [cell_text(name) for name in check["fastest"]]
    shown = fastest[0] + (f" (≈ {', '.join(fastest[1:])})" if fastest[1:] else "")
    name = cell_text(predicted["strategy"]) if predicted else None
    if predicted and predicted["strategy"] not in runs:
        lines.append(f"Measured fastest: {shown}; the predicted {name} has no profile here yet.")
    elif predicted and (predicted["strategy"] in check["fastest"] or check["fastest"][0] in predicted.get("ties", [])):
        lines.append(f"**The prediction holds**: measured fastest {shown}, predicted {name}.")
    elif predicted:
        lines.append(f"**The prediction disagrees**: measured fastest {shown}, predicted {name}.")
    for a, b, x in check["disagreements"]:
        lines.append(
            f"- predicted {cell_text(a)} faster than {cell_text(b)}; measured {cell_text(b)} {times(x)} faster"
        )
    missing = [cell_text(n) for n, _, _ in (predicted or {}).get("ranking", [])[:3] if n not in runs]
    if missing:
        lines.append(f"\nNot profiled over this source among the three predicted fastest: {', '.join(missing)}.")
    return lines


def stats_text(spread: Spread) -> str:
    return f"{significant(spread.median)} [{significant(spread.q1)}–{significant(spread.q3)}]"


def draw_histogram(report: dict, path: Path) -> Path:
    """counts.png: images per bin of boxes an image (log axis), the bins over the slots in another colour."""
    bins = report["histogram"]
    fig = Figure(figsize=(max(6.0, 0.6 * len(bins) + 2), 4.0), layout="constrained")
    ax = fig.add_subplot()
    labels = [f"{lo}" if lo == hi else f"{lo}–{hi}" for lo, hi, _ in bins]
    colours = ["#d62728" if lo > report["max_boxes"] else "#1f77b4" for lo, _, _ in bins]
    bars = ax.bar(np.arange(len(bins)), [n or np.nan for _, _, n in bins], color=colours)
    ax.bar_label(bars, [f"{n:,}" for _, _, n in bins], fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(bins)), labels, rotation=30 if len(bins) > 8 else 0, fontsize=8)
    ax.set_xlabel(f"boxes an image (red: over the {report['max_boxes']:,} slots)", fontsize=9)
    ax.set_ylabel("images (log)", fontsize=9)
    padding = f"{100 * report['padding']:.1f} % padding at {report['max_boxes']:,} slots"
    ax.set_title(f"{report['source']}: {report['images']:,} images, {padding}", fontsize=9)
    fig.savefig(path, dpi=100)
    return path
