"""A profile run's extract.json.gz: every active step as the lab models it (detector/lab/measure/extract.py builds
it from the trace and documents its rows), its names stored once. Both pictures draw it: the PNG timeline
(detector/lab/present/timeline.py, through ``StepModel``) and TensorBoard's Traces tab (detector/board/).

``read_extract`` returns the ``Extract`` or raises ``RecordError``, one line naming the file and what is wrong in it;
``write_extract`` writes it whole or not at all.
"""

from __future__ import annotations

import gzip
import json
import os
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path

from detector.checked import RecordError, need, optional, read_json, short
from detector.regions import OTHER

EXTRACT = "extract.json.gz"
EXTRACT_VERSION = 1
# decompressed: a step of the loop strategy on a GPU models ~30k launches in ~2 MB, so ten such steps stay far
# below; a small gzip that unpacks past this is refused before it is parsed
EXTRACT_BYTES = 64 * 2**20
CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a stream event's category, by index
LAUNCH, SYNC = 1, 2  # a call's flags


Row = list  # a row of numbers (its fields by position, as each list below says), stored as a JSON array


def numbers(row) -> bool:
    return isinstance(row, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in row)


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
        rows = need(data.get("rows"), list, f"{where}.rows")
        for row in rows:
            if not numbers(row) or len(row) != 4 or not -1 <= row[3] < names:
                raise RecordError(f"{where} has a row {short(row)} that is not [start, allocated, bytes, operator]")
        counts = {key: need(data.get(key), int, f"{where}.{key}") for key in ("start", "events")}
        return cls(need(data.get("device"), str, f"{where}.device"), rows=rows, **counts)


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
        data = asdict(self)
        return {key: value for key, value in data.items() if value is not None or key not in ("start", "memory")}

    @classmethod
    def parse(cls, data, where: str, names: int) -> Step:
        """RecordError unless ``data`` has the shape that measure/extract.py writes (names index the name table)."""
        need(data, dict, where)
        regions, calls = (
            need(data.get("regions"), list, f"{where}.regions"),
            need(data.get("calls"), list, f"{where}.calls"),
        )
        for row in regions:
            if not isinstance(row, list) or len(row) != 3:
                raise RecordError(f"{where}.regions has a row {short(row)}, expected 3 values")
            need(row[0], str, f"{where}.regions")
        for row in calls:
            if not numbers(row) or len(row) != 6 or not 0 <= row[3] < names:
                raise RecordError(
                    f"{where}.calls has a row {short(row)} that is not [start, dur, thread, name, region, flags]"
                )
        threads = [
            Thread(need(t, dict, f"{where}.threads").get("tid"), need(t.get("ops"), list, f"{where}.threads.ops"))
            for t in need(data.get("threads"), list, f"{where}.threads")
        ]
        streams = []
        for stream in need(data.get("streams"), list, f"{where}.streams"):
            events = need(need(stream, dict, f"{where}.streams").get("events"), list, f"{where}.streams.events")
            for row in events:
                if not isinstance(row, list) or len(row) != 5 or not 0 <= row[4] < len(calls):
                    raise RecordError(f"{where}.streams has an event {short(row)} not launched by one of its calls")
            streams.append(Stream(str(stream.get("stream")), events))
        memory = data.get("memory")
        return cls(
            dur=need(data.get("dur"), (int, float), f"{where}.dur"),
            regions=regions,
            threads=threads,
            calls=calls,
            streams=streams,
            why=need(data.get("why"), dict, f"{where}.why"),
            start=optional(data, "start", (int, float), where),
            memory=None if memory is None else StepMemory.parse(memory, f"{where}.memory", names),
        )


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

    def to_json(self) -> dict:
        return asdict(self) | {"steps": {number: step.to_json() for number, step in self.steps.items()}}

    @classmethod
    def parse(cls, data, where: str) -> Extract:
        if not isinstance(data, dict):
            raise RecordError(f"{where}: not a JSON object")
        if data.get("version") != EXTRACT_VERSION:
            raise RecordError(f"{where}: version {short(data.get('version'))}, this detector reads {EXTRACT_VERSION}")
        steps = need(data.get("steps"), dict, f"{where}: steps")
        names = need(data.get("names"), list, f"{where}: names")
        return cls(
            about=optional(data, "about", dict, where, {}),
            gpu=need(data.get("gpu"), bool, f"{where}: gpu"),
            representative_step=need(data.get("representative_step"), int, f"{where}: representative_step"),
            steps={number: Step.parse(step, f"{where}: step {number}", len(names)) for number, step in steps.items()},
            names=[need(n, str, f"{where}: names") for n in names],
        )


def read_extract(path) -> Extract:
    """The Extract in ``path`` (extract.json.gz); RecordError with the reason otherwise (also one that would
    decompress to more than EXTRACT_BYTES)."""
    return Extract.parse(read_json(Path(path), EXTRACT_BYTES), str(path))


def write_extract(run_dir: Path, extract: Extract) -> Path:
    """extract.json.gz in ``run_dir``, written whole or not at all: into a new file (never through a link that
    stands at its name), then renamed over the old one."""
    path = Path(run_dir) / EXTRACT
    temp = path.with_name(f".{path.name}.new")
    temp.unlink(missing_ok=True)  # a leftover of a stopped write, or a link: removed, not followed
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt", compresslevel=6) as f:
        json.dump(extract.to_json(), f, separators=(",", ":"))
    temp.replace(path)
    return path


class StepModel:
    """One step of an extract, read as events: what the PNG timeline (detector/lab/present/timeline.py) draws, the
    same that the Traces tab draws from the same rows."""

    def __init__(self, extract: Extract, number: int | None = None):
        number = extract.representative_step if number is None else number
        if str(number) not in extract.steps:
            found = ", ".join(extract.steps)
            raise RecordError(f"the extract has no step {number} (its steps: {found})")
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
