"""shapes.json: what `make shapes` found (detector/lab/shapes.py writes it), as one typed, versioned record: the
source's box counts and what the slots do to them, each strategy's cost a slot and a box and the strategy they predict
fastest (and which train.strategy=auto would time), the check against the profiles over the same boxes, and each
strategy's loss memory.

``read_shapes`` returns the ``ShapesRecord`` or raises ``RecordError``, one line naming the file and the field. Version
1 (no ``version`` key: written before the record was typed) has the same fields, less the ones added later (``memory``,
``measured.noisy``, ``predicted.ties``, ``auto``), which are read as empty.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from detector.checked import (
    LIMIT,
    NUMBER,
    RecordError,
    measure,
    measured,
    need,
    optional,
    read_json,
    versioned,
    write_atomically,
)
from detector.lab.record.spread import Spread

VERSION = 2  # 1: no "version" key
SHAPES = "shapes.json"
SHAPES_BYTES = 16 * 2**20  # a histogram of a few dozen bins and a row a strategy: a few kB
TIE = 1.05  # predictions within 5 % of the fastest's are ties: a model from a few timed cases is no finer


def strings(data, where: str) -> list[str]:
    return [need(s, str, f"{where}[{i}]") for i, s in enumerate(need(data, list, where))]


def row(data, where: str, kinds: tuple) -> tuple:
    """A JSON array of ``len(kinds)`` values, each checked: a string by type, a number by ``measured``."""
    need(data, list, where)
    if len(data) != len(kinds):
        raise RecordError(f"{where} has {len(data)} values, expected {len(kinds)}")
    return tuple(
        need(value, str, f"{where}[{i}]") if kind is str else measure(value, f"{where}[{i}]", kind=kind)
        for i, (value, kind) in enumerate(zip(data, kinds, strict=True))
    )


def number(data: dict, key: str, where: str, high: float = LIMIT, kind=NUMBER):
    """``data[key]``: a finite number of ``kind`` in [0, high]; absent, null or damaged, RecordError naming it."""
    return measure(data.get(key), f"{where}.{key}", 0, high, kind)


@dataclass
class Cost:
    """One strategy's forward+backward: ms per slot and per box, and what they were measured on."""

    strategy: str
    per_slot_ms: float
    per_box_ms: float
    measured: str  # "batch 1024 x 256 slots, 1,940 and 5,321 boxes"

    def at(self, slots: int, boxes: float) -> float:
        """The predicted ms of a batch of ``slots`` slots holding ``boxes`` boxes."""
        return self.per_slot_ms * slots + self.per_box_ms * boxes

    def bound(self, slots: int, boxes: float) -> str:
        """``slots`` or ``boxes``: which of the two its time at that shape mostly pays for."""
        return "slots" if self.per_slot_ms * slots >= self.per_box_ms * boxes else "boxes"

    @classmethod
    def parse(cls, data, where: str) -> Cost:
        need(data, dict, where)
        return cls(
            strategy=need(data.get("strategy"), str, f"{where}.strategy"),
            per_slot_ms=number(data, "per_slot_ms", where),
            per_box_ms=number(data, "per_box_ms", where),
            measured=need(data.get("measured"), str, f"{where}.measured"),
        )


@dataclass
class Costs:
    """Every strategy's cost and where it comes from (a file and its device, or a timing here), said in one line."""

    source: str
    costs: list[Cost]
    file: str | None = None  # the bench result file read, if one was

    def to_json(self) -> dict:
        return {"source": self.source, "file": self.file, "strategies": [asdict(c) for c in self.costs]}

    @classmethod
    def parse(cls, data, where: str) -> Costs:
        need(data, dict, where)
        rows = need(data.get("strategies"), list, f"{where}.strategies")
        return cls(
            source=need(data.get("source"), str, f"{where}.source"),
            costs=[Cost.parse(c, f"{where}.strategies[{i}]") for i, c in enumerate(rows)],
            file=optional(data, "file", str, where),
        )


@dataclass
class MemoryCost:
    """One strategy's loss forward in bytes: its peak rise per slot and per box, and what they were measured on."""

    strategy: str
    per_slot_bytes: float
    per_box_bytes: float
    measured: str

    def at(self, slots: int, boxes: float) -> float:
        """The predicted peak rise, in bytes, of the loss over ``slots`` slots holding ``boxes`` boxes."""
        return self.per_slot_bytes * slots + self.per_box_bytes * boxes


@dataclass
class PredictedMemory(MemoryCost):
    """A strategy's loss memory at the report's batch: predicted from its bytes a slot and a box, and the median calc
    loss peak rise of its profile over the same boxes (None: not profiled over them)."""

    predicted: float = 0.0
    profiled: float | None = None

    @classmethod
    def parse(cls, data, where: str) -> PredictedMemory:
        need(data, dict, where)
        return cls(
            strategy=need(data.get("strategy"), str, f"{where}.strategy"),
            per_slot_bytes=number(data, "per_slot_bytes", where),
            per_box_bytes=number(data, "per_box_bytes", where),
            measured=need(data.get("measured"), str, f"{where}.measured"),
            predicted=number(data, "predicted", where),
            profiled=measured(data, "profiled", where),
        )


@dataclass
class Memory:
    """Each measured strategy's loss memory, the least predicted first, and the strategies not measured here."""

    strategies: list[PredictedMemory] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, data, where: str) -> Memory:
        need(data, dict, where)
        rows = need(data.get("strategies"), list, f"{where}.strategies")
        return cls(
            strategies=[PredictedMemory.parse(r, f"{where}.strategies[{i}]") for i, r in enumerate(rows)],
            not_measured=strings(optional(data, "not_measured", list, where, []), f"{where}.not_measured"),
        )


@dataclass
class Prediction:
    """The strategy predicted fastest, those within TIE of it, why, and every strategy ranked by its predicted ms."""

    strategy: str
    ties: list[str]
    reason: str
    ranking: list[tuple[str, float, str]]  # (strategy, predicted loss ms, "slots" or "boxes"), the fastest first

    @classmethod
    def parse(cls, data, where: str) -> Prediction:
        need(data, dict, where)
        ranking = need(data.get("ranking"), list, f"{where}.ranking")
        return cls(
            strategy=need(data.get("strategy"), str, f"{where}.strategy"),
            ties=strings(optional(data, "ties", list, where, []), f"{where}.ties"),
            reason=need(data.get("reason"), str, f"{where}.reason"),
            ranking=[row(r, f"{where}.ranking[{i}]", (str, NUMBER, str)) for i, r in enumerate(ranking)],
        )


@dataclass
class ProfiledStep:
    """A profile over the report's boxes: its step as training runs it, and its run folder."""

    step: Spread
    folder: str


@dataclass
class Check:
    """The profiles over the report's boxes against the prediction: each one's step, the noisy ones and why, the
    measured fastest and those ≈ it (None: no profile), and each pair (a, b, x) predicted a faster than b whose b
    measured x times faster."""

    profile_dir: str
    runs: dict[str, ProfiledStep] = field(default_factory=dict)
    noisy: dict[str, list[str]] = field(default_factory=dict)
    fastest: list[str] | None = None
    disagreements: list[tuple[str, str, float]] = field(default_factory=list)

    def to_json(self) -> dict:
        data = asdict(self)
        data["runs"] = {name: [asdict(run.step), run.folder] for name, run in self.runs.items()}
        return data

    @classmethod
    def parse(cls, data, where: str) -> Check:
        need(data, dict, where)
        runs = {}
        for name, run in need(data.get("runs"), dict, f"{where}.runs").items():
            at = f"{where}.runs.{name}"
            need(run, list, at)
            if len(run) != 2:
                raise RecordError(f"{at} has {len(run)} values, expected 2 (the step's spread, the run folder)")
            runs[name] = ProfiledStep(Spread.parse(run[0], f"{at}[0]"), need(run[1], str, f"{at}[1]"))
        fastest = data.get("fastest")
        disagreements = optional(data, "disagreements", list, where, [])
        return cls(
            profile_dir=need(data.get("profile_dir"), str, f"{where}.profile_dir"),
            runs=runs,
            noisy={n: strings(r, f"{where}.noisy.{n}") for n, r in optional(data, "noisy", dict, where, {}).items()},
            fastest=None if fastest is None else strings(fastest, f"{where}.fastest"),
            disagreements=[
                row(d, f"{where}.disagreements[{i}]", (str, str, NUMBER)) for i, d in enumerate(disagreements)
            ],
        )


@dataclass
class Over:
    """The images holding more boxes than the slots, and the boxes ``truncate`` drops from them."""

    images: int
    dropped: int


@dataclass
class Batch:
    """A padded batch: its B·M slots and the boxes it holds on average."""

    slots: int
    boxes: float


@dataclass
class ShapesRecord:
    """shapes.json: the source's counts at the run's slots and batch, the prediction, the check and the memory."""

    source: str
    device: str
    images: int
    boxes: int
    max_boxes: int
    over_max_boxes: str
    batch_size: int
    histogram: list[tuple[int, int, int]]  # (lo, hi, images with lo..hi boxes)
    padding: float  # the share of a padded batch's slots that hold no box
    over: Over
    batch: Batch
    costs: Costs
    predicted: Prediction | None  # None: no strategy could be costed
    measured: Check
    memory: Memory = field(default_factory=Memory)
    auto: str = ""  # what train.strategy=auto would time for these boxes here, in a line ("": not said)
    version: int = VERSION

    def to_json(self) -> dict:
        data = asdict(self)
        data |= {"costs": self.costs.to_json(), "measured": self.measured.to_json()}
        return data

    @classmethod
    def parse(cls, data, where: str) -> ShapesRecord:
        versioned(data, where, VERSION)
        if "histogram" not in data:
            raise RecordError(f"{where}: no histogram: not written by make shapes")
        over, batch = need(data.get("over"), dict, f"{where}.over"), need(data.get("batch"), dict, f"{where}.batch")
        histogram = need(data["histogram"], list, f"{where}.histogram")
        predicted, memory = data.get("predicted"), data.get("memory")
        return cls(
            source=need(data.get("source"), str, f"{where}.source"),
            device=need(data.get("device"), str, f"{where}.device"),
            images=number(data, "images", where, kind=int),
            boxes=number(data, "boxes", where, kind=int),
            max_boxes=number(data, "max_boxes", where, kind=int),
            over_max_boxes=need(data.get("over_max_boxes"), str, f"{where}.over_max_boxes"),
            batch_size=number(data, "batch_size", where, kind=int),
            histogram=[row(b, f"{where}.histogram[{i}]", (int, int, int)) for i, b in enumerate(histogram)],
            padding=number(data, "padding", where, 1),
            over=Over(
                number(over, "images", f"{where}.over", kind=int), number(over, "dropped", f"{where}.over", kind=int)
            ),
            batch=Batch(
                number(batch, "slots", f"{where}.batch", kind=int),
                number(batch, "boxes", f"{where}.batch"),
            ),
            costs=Costs.parse(data.get("costs"), f"{where}.costs"),
            predicted=None if predicted is None else Prediction.parse(predicted, f"{where}.predicted"),
            measured=Check.parse(data.get("measured"), f"{where}.measured"),
            memory=Memory() if memory is None else Memory.parse(memory, f"{where}.memory"),
            auto=optional(data, "auto", str, where, ""),
        )


def read_shapes(path) -> ShapesRecord:
    """The record of a shapes folder (or its shapes.json); RecordError with the reason otherwise."""
    path = Path(path)
    file = path if path.name == SHAPES else path / SHAPES
    return ShapesRecord.parse(read_json(file, SHAPES_BYTES), str(file))


def write_shapes(out: Path, record: ShapesRecord) -> Path:
    path = Path(out) / SHAPES
    write_atomically(path, json.dumps(record.to_json(), indent=2).encode())
    return path
