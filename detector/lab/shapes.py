"""`make shapes` (``python -m detector shapes [SOURCE]``): the shape of a dataset's targets, and the strategy it
predicts fastest for them.

For the boxes of SOURCE (``data.boxes``: synthetic, coco:<instances.json> or widerface:<wider_face_*_bbx_gt.txt>)
at ``data.max_boxes`` slots (after ``data.over_max_boxes``) and batch ``data.batch_size``:

- the histogram of boxes an image, as text and as a PNG;
- the padding at those slots: the share of a padded batch's slots that hold no box;
- the images over the slots, and the boxes ``data.over_max_boxes=truncate`` drops from them;
- the strategy predicted fastest, with its reason: each strategy's cost per slot against its cost per box
  (detector/lab/measure/costs.py: bench losses' result file of this device, else a cheap timing here, which it says);
  and the candidates train.strategy=auto would time for these boxes here (``auto_ranking`` is its ranking);
- the check: the newest profile run of each strategy over this source at these slots, batch and device
  (``make profile STRATEGY=<name> BOXES=<source>``), its step as training runs it, and where it disagrees with
  the prediction;
- each strategy's loss memory predicted from the same counts: the peak its forward rises to in "calc loss", bytes a
  slot times the batch's B·M slots plus bytes a box times its boxes (detector/lab/measure/costs.py, measured here),
  against the calc loss peak rise of those profiles (within detector/lab/present/shapes.py's MEMORY_AGREES).

Everything goes to a new ``<dir of profile.out_dir>/shapes/<source's name>/<time>/``: shapes.md and counts.png
(detector/lab/present/shapes.py), and shapes.json (detector/lab/record/shapes.py).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from detector.checked import RecordError
from detector.config.device import device_name, resolve_device
from detector.data import FaceSampler
from detector.data.annotations import SYNTHETIC, read_annotations
from detector.errors import UserError
from detector.lab.folders import new_run_dir
from detector.lab.measure import costs as costing
from detector.lab.present.shapes import draw_histogram, shapes_markdown
from detector.lab.present.tables import significant, speedup
from detector.lab.record.run import SUMMARY, ProfileRecord, read_summary
from detector.lab.record.shapes import (
    SHAPES,
    TIE,
    Batch,
    Check,
    Cost,
    Costs,
    Memory,
    Over,
    PredictedMemory,
    Prediction,
    ProfiledStep,
    ShapesRecord,
    write_shapes,
)
from detector.train.run import auto
from detector.train.run.auto import Ranking

SYNTHETIC_SAMPLES = 20_000  # the synthetic faces' counts are drawn: enough for a 1 % share to show


def run_shapes(cfg: DictConfig) -> ShapesRecord:
    """The shape report of ``cfg.data``'s boxes (see the module docstring); returns what shapes.json holds."""
    data, device = cfg.data, resolve_device(cfg)
    counts = box_counts(data)
    slots, batch = data.max_boxes, data.batch_size
    kept = np.minimum(counts, slots)
    shape = batch_shape(data, kept)
    costs = find_costs(cfg, kept, device)
    predicted = predict(costs.costs, shape.slots, shape.boxes)
    runs = profiles_over(Path(cfg.profile.out_dir), data.boxes, slots, batch, device_name(device))
    record = ShapesRecord(
        source=data.boxes,
        device=device_name(device),
        images=len(counts),
        boxes=int(counts.sum()),
        max_boxes=slots,
        over_max_boxes=data.over_max_boxes,
        batch_size=batch,
        histogram=histogram(counts, slots),
        padding=1 - float(kept.sum()) / (len(counts) * slots),
        over=Over(images=int((counts > slots).sum()), dropped=int((counts - kept).sum())),
        batch=shape,
        costs=costs,
        predicted=predicted,
        measured=check(cfg.profile.out_dir, runs, predicted),
        memory=predicted_memory(cfg, kept, device, shape, runs),
        auto=auto_line(cfg, device, ranking(data, costs, predicted)),
    )
    out = new_run_dir(Path(cfg.profile.out_dir).parent / "shapes" / source_name(data.boxes))
    markdown = shapes_markdown(record, draw_histogram(record, out / "counts.png"))
    (out / "shapes.md").write_text(markdown + "\n")
    write_shapes(out, record)
    print(markdown)
    print(f"\nshapes.md, {SHAPES} and counts.png in {out}/")
    return record


def box_counts(data: DictConfig) -> np.ndarray:
    """[I] the boxes of each image of the source: the file's, or the synthetic faces' first SYNTHETIC_SAMPLES."""
    if data.boxes != SYNTHETIC:
        return read_annotations(data.boxes).counts
    sampler = FaceSampler(data.image_size, data.max_boxes, data.seed, data.count_std, data.tail_fraction, data.tail_min)
    return np.array([sampler.count(np.random.default_rng([data.seed, i])) for i in range(SYNTHETIC_SAMPLES)])


def batch_shape(data: DictConfig, kept: np.ndarray) -> Batch:
    """A padded batch of ``data``: its B·M slots and the boxes it holds on average (``kept``: each image's boxes, at
    most the slots)."""
    return Batch(slots=data.batch_size * data.max_boxes, boxes=data.batch_size * float(kept.mean()))


def source_name(source: str) -> str:
    """``widerface-wider_face_train_bbx_gt``: a folder name for a source."""
    if source == SYNTHETIC:
        return source
    kind, _, path = source.partition(":")
    return f"{kind}-{Path(path).stem}"


def histogram(counts: np.ndarray, slots: int) -> list[tuple[int, int, int]]:
    """[(lo, hi, images), ...]: images with lo..hi boxes, in bins 0, 1, 2–3, 4–7, ... split at the slots."""
    largest = int(counts.max(initial=0))
    edges = {0, 1, slots + 1} | {2**k for k in range(1, max(1, largest).bit_length() + 1)}
    edges = sorted(e for e in edges if e <= largest) + [largest + 1]
    found = np.histogram(counts, bins=edges)[0] if len(edges) > 1 else [len(counts)]
    return [(lo, hi - 1, int(n)) for lo, hi, n in zip(edges, edges[1:], found, strict=False)]


# ----------------------------------------------------------------------------- the prediction


def find_costs(cfg: DictConfig, kept: np.ndarray, device, empty: bool = True) -> Costs:
    """bench losses' result file of this device, else a cheap timing here on a batch of the data's counts (and, with
    ``empty``, on the batch with no box: the slots' and the boxes' costs apart, for a prediction at other shapes)."""
    path = Path(cfg.bench.out).parent / "losses.json"
    found, why = costing.from_bench(path, device_name(device), cfg.data.batch_size, cfg.data.max_boxes)
    if found:
        wanted = list(cfg.bench.strategies)
        found.costs = [c for c in found.costs if not wanted or c.strategy in wanted]
        return found
    names, left = costing.quick_strategies(list(cfg.bench.strategies), device)
    batch = np.random.default_rng(cfg.data.seed).choice(kept, size=cfg.data.batch_size)  # a batch of the data
    timed = costing.timed_here(names, batch, cfg.data.max_boxes, device, why, empty)
    if left:
        timed.source += f"; not timed: {', '.join(left)} (compiled, emulated or unavailable here: bench.strategies)"
    return timed


def predict(costs: list[Cost], slots: int, boxes: float) -> Prediction | None:
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
    return Prediction(
        strategy=best.strategy,
        ties=[c.strategy for c in ranked[1:] if c.at(slots, boxes) <= TIE * best.at(slots, boxes)],
        reason=reason,
        ranking=[(c.strategy, c.at(slots, boxes), c.bound(slots, boxes)) for c in ranked],
    )


def cost_sum(cost: Cost, slots: int, boxes: float) -> str:
    """``0.0123 µs a slot × 65,536 slots + 0.35 µs a box × 1,640 boxes = 1.38 ms``."""
    return (
        f"{significant(cost.per_slot_ms * 1e3)} µs a slot × {slots:,} slots + {significant(cost.per_box_ms * 1e3)} µs "
        f"a box × {boxes:,.0f} boxes = {significant(cost.at(slots, boxes))} ms"
    )


# ----------------------------------------------------------------------------- train.strategy=auto's candidates


def auto_ranking(cfg: DictConfig, device) -> Ranking:
    """train.strategy=auto's ranking (detector/train/run/auto.py, which `make train` hands it to): the strategies by the
    loss ms this report predicts for the run's boxes, the fastest first: timed at the run's shape alone, which is all
    the ranking predicts at."""
    kept = np.minimum(box_counts(cfg.data), cfg.data.max_boxes)
    shape = batch_shape(cfg.data, kept)
    costs = find_costs(cfg, kept, device, empty=False)
    return ranking(cfg.data, costs, predict(costs.costs, shape.slots, shape.boxes))


def ranking(data: DictConfig, costs: Costs, predicted: Prediction | None) -> Ranking:
    names = [name for name, _, _ in predicted.ranking] if predicted else []
    where = f"{source_name(data.boxes)} at batch {data.batch_size} x {data.max_boxes} slots"
    costed = f"bench losses' {costs.file}" if costs.file else "a timing here"
    return Ranking(names, f"make shapes' prediction for {where}, from {costed}")


def auto_line(cfg: DictConfig, device, ranked: Ranking) -> str:
    """What train.strategy=auto would time in the training step for these boxes on this device (one process), or why
    it would time none."""
    try:
        names, source = auto.candidates(cfg, device, 1, lambda _cfg, _device: ranked)
    except UserError as err:
        return f"train.strategy=auto would time none here: {err}"
    return f"train.strategy=auto would time {', '.join(names)} in the training step ({source})"


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


def check(profile_dir: str, runs: list[ProfileRecord], predicted: Prediction | None) -> Check:
    """The profiles over this source against the prediction: each one's step as training runs it, the fastest, and
    every pair the two order differently (by the one rule: medians whose quartiles overlap are ≈)."""
    steps = {r.strategy: ProfiledStep(r.timed_step() or r.stats("step"), str(r.folder)) for r in runs}
    steps = {name: found for name, found in steps.items() if found.step}
    noisy = {r.strategy: r.noise_reasons() for r in runs if r.noisy and r.strategy in steps}
    result = Check(profile_dir, steps, noisy)
    if not steps:
        return result
    fastest = min(steps, key=lambda n: steps[n].step.median)
    result.fastest = [fastest] + [n for n in steps if n != fastest and not speedup(steps[n].step, steps[fastest].step)]
    ranked = {name: ms for name, ms, _ in predicted.ranking} if predicted else {}
    for a in ranked:
        for b in ranked:
            if a in steps and b in steps and ranked[a] < ranked[b]:
                x = speedup(steps[a].step, steps[b].step)  # > 1: b's step measured faster than a's
                if x and x > 1:
                    result.disagreements.append((a, b, x))
    return result


# ----------------------------------------------------------------------------- memory


def predicted_memory(cfg: DictConfig, kept: np.ndarray, device, shape: Batch, runs: list[ProfileRecord]) -> Memory:
    """Each strategy's loss memory at the report's batch from its bytes a slot and a box (measured here on a batch of
    the data's counts), and the calc loss peak rise of the profiles over this source, where there are any."""
    names, left = costing.quick_strategies(list(cfg.bench.strategies), device)
    batch = np.random.default_rng(cfg.data.seed).choice(kept, size=cfg.data.batch_size)  # a batch of the data
    print(f"shapes: measuring {len(names)} strategies' loss memory here ...", flush=True)
    costs = costing.memory_here(names, batch, cfg.data.max_boxes, device)
    profiled = {r.strategy: r.stats("calc loss", "peak_rise_bytes") for r in runs}
    rows = []
    for cost in sorted(costs, key=lambda c: c.at(shape.slots, shape.boxes)):
        found = profiled.get(cost.strategy)
        at = cost.at(shape.slots, shape.boxes)
        rows.append(PredictedMemory(**asdict(cost), predicted=at, profiled=found.median if found else None))
    return Memory(rows, left)
