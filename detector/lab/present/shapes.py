"""The shape report a person reads (`make shapes`, detector/lab/shapes.py): shapes.md, from the record of
detector/lab/record/shapes.py, and counts.png, the histogram of boxes an image. Every name that comes from a file or a
user (the source, a strategy, a device, a run folder) is written through ``cell_text`` or ``code_text``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from detector.lab.present.tables import cell_text, code_text, markdown_table, significant, times
from detector.lab.record.measures import memory_text
from detector.lab.record.shapes import TIE, ShapesRecord
from detector.lab.record.spread import Spread

# A prediction and a profile agree where neither is more than this many times the other: the profile's calc loss also
# counts the step's own small tensors (the boxes' count, the global mean) and its batches' box counts vary
MEMORY_AGREES = 1.5


def shapes_markdown(record: ShapesRecord, chart: Path) -> str:
    """shapes.md: the counts, the padding, the images over the slots, the prediction and the check; ``chart``: the
    histogram's PNG beside it."""
    slots, batch = record.max_boxes, record.batch_size
    lines = [
        f"# Shapes of {cell_text(record.source)}",
        "",
        f"{record.images:,} images, {record.boxes:,} boxes ({record.boxes / record.images:.2f} an image); "
        f"{slots:,} slots an image (data.max_boxes), batch {batch:,} (data.batch_size).",
        "",
        markdown_table(
            ["boxes an image", "images", "share", ""],
            [
                [f"{lo}" if lo == hi else f"{lo}–{hi}", f"{n:,}", f"{100 * n / record.images:.2f} %"]
                + ["over the slots" if lo > slots else ""]
                for lo, hi, n in record.histogram
            ],
            "lrrl",
        ),
        "",
        f"![boxes an image]({chart.name})",
        "",
        f"**Padding at {slots:,} slots**: {100 * record.padding:.1f} % of a padded batch's slots hold no box "
        f"({record.batch.slots:,} slots for {record.batch.boxes:,.0f} boxes on average a batch).",
        "",
        over_line(record),
        "",
        "## The strategy predicted fastest",
        "",
        f"Costs from {cell_text(record.costs.source)}.",
        "",
    ]
    lines += prediction_lines(record)
    lines += ["", cell_text(record.auto)] if record.auto else []
    lines += ["", "## The check: profiles over this source", ""] + check_lines(record)
    lines += ["", "## Loss memory", ""] + memory_lines(record)
    return "\n".join(lines)


def memory_lines(record: ShapesRecord) -> list[str]:
    """The loss memory table: bytes a slot and a box, the peak rise predicted at the batch, the profiles' calc loss."""
    memory = record.memory
    if not memory.strategies:
        return ["No strategy's loss memory could be measured here (bench.strategies names none that runs here)."]
    slots, boxes = record.batch.slots, record.batch.boxes
    rows, off = [], []
    for row in memory.strategies:
        profiled, predicted = row.profiled, row.predicted
        ratio = profiled / predicted if profiled and predicted else None
        if ratio is not None and not 1 / MEMORY_AGREES <= ratio <= MEMORY_AGREES:
            off.append(f"{cell_text(row.strategy)} ({ratio:.2f}×)")
        rows.append(
            [row.strategy, significant(row.per_slot_bytes), significant(row.per_box_bytes), memory_text(predicted)]
            + [memory_text(profiled) if profiled is not None else "—", f"{ratio:.2f}×" if ratio else "—"]
        )
    headers = ["strategy", "B a slot", "B a box", "predicted peak rise", "profiled (calc loss)", "profiled / predicted"]
    lines = [
        f"The peak each strategy's loss forward rises to in calc loss, as training runs it: bytes a slot × {slots:,} "
        f"slots + bytes a box × {boxes:,.0f} boxes, measured here ({cell_text(memory.strategies[0].measured)}), "
        "against the calc loss of the profiles over this source (the median peak rise).",
        "",
        markdown_table(headers, rows, "lrrrrr"),
    ]
    if any(row.profiled is not None for row in memory.strategies):
        verdict = (
            f"off by more than {MEMORY_AGREES}× for {', '.join(off)}"
            if off
            else f"within {MEMORY_AGREES}× for every one profiled"
        )
        lines += ["", f"**The memory prediction** is {verdict}."]
    if memory.not_measured:
        names = ", ".join(map(cell_text, memory.not_measured))
        lines += ["", f"Not measured here: {names} (compiled, emulated or unavailable)."]
    return lines


def over_line(record: ShapesRecord) -> str:
    over, slots = record.over, record.max_boxes
    if not over.images:
        return f"**Images over the slots**: none holds more than {slots:,} boxes."
    share = 100 * over.images / record.images
    fate = {
        "truncate": f"data.over_max_boxes=truncate drops their {over.dropped:,} smallest boxes "
        f"({100 * over.dropped / record.boxes:.2f} % of the boxes)",
        "refuse": "data.over_max_boxes=refuse refuses the run",
    }.get(record.over_max_boxes, "")
    return f"**Images over the slots**: {over.images:,} ({share:.2f} %) hold more than {slots:,} boxes: {fate}."


def prediction_lines(record: ShapesRecord) -> list[str]:
    predicted = record.predicted
    if not predicted:
        return ["No strategy could be costed (bench.strategies names none that runs here)."]
    costs = {c.strategy: c for c in record.costs.costs}
    rows = [
        [name, significant(costs[name].per_slot_ms * 1e3), significant(costs[name].per_box_ms * 1e3)]
        + [significant(ms), bound, costs[name].measured]
        for name, ms, bound in predicted.ranking
    ]
    headers = ["strategy", "µs a slot", "µs a box", "predicted loss ms", "pays mostly for", "measured on"]
    ties = f" ({', '.join(map(cell_text, predicted.ties))} within {TIE - 1:.0%})" if predicted.ties else ""
    return [
        f"**{cell_text(predicted.strategy)}**{ties}, because {cell_text(predicted.reason)}.",
        "",
        markdown_table(headers, rows, "lrrrll"),
    ]


def check_lines(record: ShapesRecord) -> list[str]:
    check, predicted = record.measured, record.predicted
    runs = check.runs
    if not runs:
        example = predicted.strategy if predicted else "padded"
        command = code_text(f"make profile STRATEGY={example} BOXES={record.source}")
        return [
            f"No profile run over this source at {record.max_boxes} slots, batch {record.batch_size} on "
            f"{cell_text(record.device)} in {cell_text(check.profile_dir)}: {command} (and padded) checks the "
            "prediction; `make shapes` then says where they disagree."
        ]
    noisy = check.noisy
    rows = [
        [name, stats_text(run.step), "; ".join(noisy[name]) if name in noisy else "quiet", code_text(run.folder)]
        for name, run in runs.items()
    ]
    lines = [markdown_table(["strategy", "step ms as training runs it", "noise", "run"], rows, "lrll"), ""]
    if noisy:
        lines += [f"Noisy runs ({', '.join(map(cell_text, noisy))}): their times may not hold on a quiet machine.", ""]
    fastest = [cell_text(name) for name in check.fastest]
    shown = fastest[0] + (f" (≈ {', '.join(fastest[1:])})" if fastest[1:] else "")
    name = cell_text(predicted.strategy) if predicted else None
    if predicted and predicted.strategy not in runs:
        lines.append(f"Measured fastest: {shown}; the predicted {name} has no profile here yet.")
    elif predicted and (predicted.strategy in check.fastest or check.fastest[0] in predicted.ties):
        lines.append(f"**The prediction holds**: measured fastest {shown}, predicted {name}.")
    elif predicted:
        lines.append(f"**The prediction disagrees**: measured fastest {shown}, predicted {name}.")
    for a, b, x in check.disagreements:
        lines.append(
            f"- predicted {cell_text(a)} faster than {cell_text(b)}; measured {cell_text(b)} {times(x)} faster"
        )
    missing = [cell_text(n) for n, _, _ in (predicted.ranking if predicted else [])[:3] if n not in runs]
    if missing:
        lines.append(f"\nNot profiled over this source among the three predicted fastest: {', '.join(missing)}.")
    return lines


def stats_text(spread: Spread) -> str:
    return f"{significant(spread.median)} [{significant(spread.q1)}–{significant(spread.q3)}]"


def draw_histogram(record: ShapesRecord, path: Path) -> Path:
    """counts.png: images per bin of boxes an image (log axis), the bins over the slots in another colour."""
    bins = record.histogram
    fig = Figure(figsize=(max(6.0, 0.6 * len(bins) + 2), 4.0), layout="constrained")
    ax = fig.add_subplot()
    labels = [f"{lo}" if lo == hi else f"{lo}–{hi}" for lo, hi, _ in bins]
    colours = ["#d62728" if lo > record.max_boxes else "#1f77b4" for lo, _, _ in bins]
    bars = ax.bar(np.arange(len(bins)), [n or np.nan for _, _, n in bins], color=colours)
    ax.bar_label(bars, [f"{n:,}" for _, _, n in bins], fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(bins)), labels, rotation=30 if len(bins) > 8 else 0, fontsize=8)
    ax.set_xlabel(f"boxes an image (red: over the {record.max_boxes:,} slots)", fontsize=9)
    ax.set_ylabel("images (log)", fontsize=9)
    padding = f"{100 * record.padding:.1f} % padding at {record.max_boxes:,} slots"
    ax.set_title(f"{record.source}: {record.images:,} images, {padding}", fontsize=9)
    fig.savefig(path, dpi=100)
    return path
