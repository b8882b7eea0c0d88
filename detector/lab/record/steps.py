"""A profile run's extract.json.gz: every active step as the lab models it (detector/lab/measure/extract.py builds
it from the trace and documents its rows), its names stored once. Both pictures draw it: the PNG timeline
(detector/lab/present/timeline.py, through ``StepModel``) and TensorBoard's Traces tab (detector/board/).

``read_extract`` returns the ``Extract`` or raises ``RecordError``, one line naming the file and what is wrong in it;
``write_extract`` writes it whole or not at all. Every number of a step is checked by value as it is read (times
finite, durations and bytes allocated not negative, indices in their table): a step with a damaged value is left out,
or only its memory where the damage is there, each with a warning in ``Extract.left_out``; the others are kept.
"""

from __future__ import annotations

import gzip
import json
from bisect import bisect_right
from dataclasses import dataclass, field, fields
from pathlib import Path

from detector.checked import (
    CLOCK,
    LIMIT,
    NUMBER,
    Damaged,
    LeftOut,
    RecordError,
    all_fit,
    measure,
    measured,
    need,
    optional,
    plain,
    read_json,
    short,
    write_atomically,
)
from detector.regions import OTHER

EXTRACT = "extract.json.gz"
EXTRACT_VERSION = 1
# decompressed: a step of the loop strategy on a GPU models ~30k launches in ~2 MB, so ten such steps stay far
# below; a small gzip that unpacks past this is refused before it is parsed
EXTRACT_BYTES = 64 * 2**20
CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a stream event's category, by index
LAUNCH, SYNC = 1, 2  # a call's flags


Row = list  # a row of values (its fields by position, as each list below says), stored as a JSON array
Column = tuple[float, float, type | tuple]  # what a row's field holds: its range and its kind
TIME = (-LIMIT, LIMIT, NUMBER)  # µs from the step's start; GPU work the step launched may run before it ends or after
DURATION = (0, LIMIT, NUMBER)
NAME = (0, 0, str)  # a region's name (its range unused)


def index(entries: int, low: int = 0) -> Column:
    """An index into a table of ``entries`` (``low`` -1: none)."""
    return (low, entries - 1, int)


def rows(data, where: str, columns: dict[str, Column]) -> list[Row]:
    """``data``, a list of rows of ``columns``; RecordError where it is no list, Damaged naming the row and its field
    for a row of another shape or a value out of its column's range."""
    need(data, list, where)
    shaped = set(map(type, data)) <= {list} and set(map(len, data)) <= {len(columns)}
    if not (shaped and all(map(column_fits, zip(*data, strict=True), columns.values()))):
        name_damage(data, where, columns)
    return data


def column_fits(values: tuple, column: Column) -> bool:
    low, high, kind = column
    return set(map(type, values)) <= {str} if kind is str else all_fit(values, low, high, kind)


def name_damage(data: list, where: str, columns: dict[str, Column]) -> None:
    """Damaged naming the first row of ``data``, and its field, that does not fit ``columns``."""
    for i, row in enumerate(data):
        if not isinstance(row, list) or len(row) != len(columns):
            raise Damaged(f"{where}[{i}]", row, f"[{', '.join(columns)}]")
        for value, (name, (low, high, kind)) in zip(row, columns.items(), strict=True):
            if kind is str and not isinstance(value, str):
                raise Damaged(f"{where}[{i}].{name}", value, "a string")
            if kind is not str:
                measure(value, f"{where}[{i}].{name}", low, high, kind)


@dataclass
class Thread:
    """A thread of the process that ran operators in the step: its id and its top-level operators ``[start, duration,
    name]``."""

    tid: int | str
    ops: list[Row]


@dataclass
class Stream:
    """A GPU stream: the kernels, copies and memsets the step's calls launched, whenever they ran, ``[start, duration,
    category, name, call]`` (``call``: the index of the call that launched it)."""

    stream: str
    events: list[Row]


@dataclass
class StepMemory:
    """The run's device (``cuda:0``, ``cpu``), the bytes allocated when the step began (``start``), the allocator's
    events in it (``events``) and ``rows`` ``[start, allocated, bytes, operator]`` (operator -1: none)."""

    device: str
    start: int
    events: int
    rows: list[Row]

    @classmethod
    def parse(cls, data, where: str, names: int) -> StepMemory:
        need(data, dict, where)
        # bytes: an allocation's (> 0) or a free's (< 0); allocated: what is held after it, never negative
        columns = {
            "start": TIME,
            "allocated": (0, LIMIT, int),
            "bytes": (-LIMIT, LIMIT, int),
            "operator": index(names, -1),
        }
        return cls(
            device=need(data.get("device"), str, f"{where}.device"),
            start=measure(data.get("start"), f"{where}.start", kind=int),
            events=measure(data.get("events"), f"{where}.events", kind=int),
            rows=rows(data.get("rows"), f"{where}.rows", columns),
        )


@dataclass
class Step:
    """One active step as the lab models it (measure/extract.py writes it; its rows' fields are documented there),
    every time in µs from the step's start. ``names`` index the extract's name table."""

    dur: float
    regions: list[Row]  # [name, start, duration] of each of the lab's regions on the step's thread
    threads: list[Thread]
    calls: list[Row]  # [start, duration, thread, name, region, flags]: the CUDA calls that launched work or waited
    streams: list[Stream]
    why: dict[str, dict[str, float]]  # region -> every measure of it in this step (measures.py)
    start: float | None = None  # on the host's clock; None in extracts written before ranks were aligned
    memory: StepMemory | None = None  # None where the profile recorded no memory

    def to_json(self) -> dict:
        data = plain(self)
        return {key: value for key, value in data.items() if value is not None or key not in ("start", "memory")}

    @classmethod
    def parse(cls, data, where: str, names: int, found: LeftOut) -> Step:
        """The step of the shape measure/extract.py writes (names index the name table): RecordError for a part of
        another shape, Damaged for a value out of its range; a damaged memory is left out (``found``), not the step."""
        need(data, dict, where)
        regions = rows(data.get("regions"), f"{where}.regions", {"name": NAME, "start": TIME, "duration": DURATION})
        call = {"start": TIME, "duration": DURATION, "thread": (0, LIMIT, int), "name": index(names)}
        call |= {"region": index(len(regions), -1), "flags": (0, LAUNCH | SYNC, int)}
        calls = rows(data.get("calls"), f"{where}.calls", call)
        op = {"start": TIME, "duration": DURATION, "name": index(names)}
        threads = []
        for i, thread in enumerate(need(data.get("threads"), list, f"{where}.threads")):
            at = f"{where}.threads[{i}]"
            threads.append(Thread(need(thread, dict, at).get("tid"), rows(thread.get("ops"), f"{at}.ops", op)))
        launched = {"start": TIME, "duration": DURATION, "category": index(len(CATEGORIES)), "name": index(names)}
        launched["call"] = index(len(calls))
        streams = []
        for i, stream in enumerate(need(data.get("streams"), list, f"{where}.streams")):
            at = f"{where}.streams[{i}]"
            events = rows(need(stream, dict, at).get("events"), f"{at}.events", launched)
            streams.append(Stream(str(stream.get("stream")), events))
        memory = data.get("memory")
        return cls(
            dur=measure(data.get("dur"), f"{where}.dur"),
            regions=regions,
            threads=threads,
            calls=calls,
            streams=streams,
            why=why(data.get("why"), f"{where}.why"),
            start=measured(data, "start", where, high=CLOCK),
            memory=None if memory is None else found.part(StepMemory.parse, memory, f"{where}.memory", names),
        )


def why(data, where: str) -> dict[str, dict[str, float]]:
    """Every measure of each region in a step (measures.py): region -> measure -> a value in [0, LIMIT]."""
    return {
        region: {m: measure(v, f"{where}.{region}.{m}") for m, v in need(measures, dict, f"{where}.{region}").items()}
        for region, measures in need(data, dict, where).items()
    }


@dataclass
class Extract:
    """extract.json.gz: every active step as the lab models it (detector/lab/measure/extract.py builds it, and documents
    its rows), its names stored once. ``steps`` maps the step's number, as text, to its model."""

    about: dict
    gpu: bool
    representative_step: int
    steps: dict[str, Step]
    names: list[str]
    version: int = EXTRACT_VERSION
    left_out: list[str] = field(default_factory=list, compare=False)  # damaged steps, when it was read (not written)

    def to_json(self) -> dict:
        data = {f.name: plain(getattr(self, f.name)) for f in fields(self) if f.name not in ("steps", "left_out")}
        return data | {"steps": {number: step.to_json() for number, step in self.steps.items()}}

    @classmethod
    def parse(cls, data, where: str) -> Extract:
        if not isinstance(data, dict):
            raise RecordError(f"{where}: not a JSON object")
        if data.get("version") != EXTRACT_VERSION:
            raise RecordError(f"{where}: version {short(data.get('version'))}, this detector reads {EXTRACT_VERSION}")
        steps = need(data.get("steps"), dict, f"{where}: steps")
        names = [need(n, str, f"{where}: names") for n in need(data.get("names"), list, f"{where}: names")]
        found = LeftOut(where)
        parsed = {n: found.part(Step.parse, step, f"{where}: step {n}", len(names), found) for n, step in steps.items()}
        return cls(
            about=optional(data, "about", dict, where, {}),
            gpu=need(data.get("gpu"), bool, f"{where}: gpu"),
            representative_step=need(data.get("representative_step"), int, f"{where}: representative_step"),
            steps={number: step for number, step in parsed.items() if step is not None},
            names=names,
            left_out=found.warnings,
        )


def read_extract(path) -> Extract:
    """The Extract in ``path`` (extract.json.gz); RecordError with the reason otherwise (also one that would
    decompress to more than EXTRACT_BYTES)."""
    return Extract.parse(read_json(Path(path), EXTRACT_BYTES), str(path))


def write_extract(run_dir: Path, extract: Extract) -> Path:
    """extract.json.gz in ``run_dir``, written whole or not at all (``write_atomically``)."""
    path = Path(run_dir) / EXTRACT
    data = json.dumps(extract.to_json(), separators=(",", ":")).encode()
    write_atomically(path, gzip.compress(data, compresslevel=6))
    return path


class StepModel:
    """One step of an extract, read as events: what the PNG timeline (detector/lab/present/timeline.py) draws, the
    same that the Traces tab draws from the same rows."""

    def __init__(self, extract: Extract, number: int | None = None):
        number = extract.representative_step if number is None else number
        if not extract.steps:
            raise RecordError("the extract has no step left to draw (each was damaged, or none was recorded)")
        if str(number) not in extract.steps:
            raise RecordError(f"the extract has no step {number} (its steps: {', '.join(extract.steps) or 'none'})")
        self.number, self.gpu = number, extract.gpu
        self.step, self.names = extract.steps[str(number)], extract.names
        self.dur = self.step.dur

    def regions(self) -> list[tuple[str, float, float]]:
        """(region, start, duration) µs from the step's start, on the step's thread."""
        return [(name, start, dur) for name, start, dur in self.step.regions]

    def region_of_call(self, call: int) -> str:
        index = self.step.calls[call][4]
        return self.step.regions[index][0] if index >= 0 else OTHER

    def calls(self, flag: int) -> list[float]:
        """The starts (µs) of the step's calls with ``flag`` (LAUNCH or SYNC)."""
        return [start for start, _, _, _, _, flags in self.step.calls if flags & flag]

    def gpu_events(self) -> list[tuple[str, float, float, str, str]]:
        """(stream, start, duration, category, the region whose call launched it) of the GPU work the step
        launched, whenever it ran."""
        return [
            (stream.stream, start, dur, CATEGORIES[category], self.region_of_call(call))
            for stream in self.step.streams
            for start, dur, category, _, call in stream.events
        ]

    def end(self) -> float:
        """µs from the step's start to the end of its host part or of the last GPU work it launched."""
        return max([self.dur] + [start + dur for _, start, dur, _, _ in self.gpu_events()])

    def memory(self) -> tuple[int, list[tuple[float, int, int, str, str]]] | None:
        """(bytes allocated when the step began, [(µs from its start, bytes allocated after, the event's bytes, its
        operator, the region it fell in)]) of the step's allocator events; None where the profile recorded none."""
        memory = self.step.memory
        if memory is None:
            return None
        regions = sorted((start, start + dur, name) for name, start, dur in self.regions())
        starts = [a for a, _, _ in regions]

        def region_at(t: float) -> str:
            i = bisect_right(starts, t) - 1
            return regions[i][2] if i >= 0 and t < regions[i][1] else OTHER

        rows = [
            (t, allocated, size, self.names[op] if op >= 0 else "", region_at(t))
            for t, allocated, size, op in memory.rows
        ]
        return memory.start, rows
