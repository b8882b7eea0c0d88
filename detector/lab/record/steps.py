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


@dataclass
class Extract:
    """extract.json.gz: every active step as the lab models it (detector/lab/measure/extract.py builds it, and documents
    its rows), its names stored once. ``steps`` maps the step's number, as text, to its model."""

    about: dict
    gpu: bool
    representative_step: int
    steps: dict[str, dict]
    names: list[str]
    version: int = EXTRACT_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, data, where: str) -> Extract:
        if not isinstance(data, dict):
            raise RecordError(f"{where}: not a JSON object")
        if data.get("version") != EXTRACT_VERSION:
            raise RecordError(f"{where}: version {short(data.get('version'))}, this detector reads {EXTRACT_VERSION}")
        steps = need(data.get("steps"), dict, f"{where}: steps")
        names = need(data.get("names"), list, f"{where}: names")
        for number, step in steps.items():
            check_step(step, f"{where}: step {number}", len(names))
        return cls(
            about=optional(data, "about", dict, where, {}),
            gpu=need(data.get("gpu"), bool, f"{where}: gpu"),
            representative_step=need(data.get("representative_step"), int, f"{where}: representative_step"),
            steps=steps,
            names=[need(n, str, f"{where}: names") for n in names],
        )


ROWS = {"regions": 3, "calls": 6}  # the length of each row of a step's lists


def check_step(step, where: str, names: int) -> None:
    """RecordError unless ``step`` has the shape that extract.step_extract writes (names index the name table)."""
    need(step, dict, where)
    need(step.get("dur"), (int, float), f"{where}.dur")
    optional(step, "start", (int, float), where)  # absent in extracts written before ranks were aligned
    for key, width in ROWS.items():
        for row in need(step.get(key), list, f"{where}.{key}"):
            if not isinstance(row, list) or len(row) != width:
                raise RecordError(f"{where}.{key} has a row {short(row)}, expected {width} values")
    for name, *_ in step["regions"]:
        need(name, str, f"{where}.regions")
    for row in step["calls"]:
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in row) or not 0 <= row[3] < names:
            raise RecordError(
                f"{where}.calls has a row {short(row)} that is not [start, dur, thread, name, region, flags]"
            )
    for thread in need(step.get("threads"), list, f"{where}.threads"):
        need(thread, dict, f"{where}.threads")
        need(thread.get("ops"), list, f"{where}.threads.ops")
    for stream in need(step.get("streams"), list, f"{where}.streams"):
        need(stream, dict, f"{where}.streams")
        for row in need(stream.get("events"), list, f"{where}.streams.events"):
            if not isinstance(row, list) or len(row) != 5 or not 0 <= row[4] < len(step["calls"]):
                raise RecordError(f"{where}.streams has an event {short(row)} not launched by one of its calls")
    need(step.get("why"), dict, f"{where}.why")
    if step.get("memory") is not None:  # absent in extracts of runs that recorded no memory
        check_memory_rows(step["memory"], f"{where}.memory", names)


def check_memory_rows(memory, where: str, names: int) -> None:
    """RecordError unless a step's ``memory`` has the shape extract.memory_rows writes."""
    need(memory, dict, where)
    need(memory.get("device"), str, f"{where}.device")
    for key in ("start", "events"):
        need(memory.get(key), int, f"{where}.{key}")
    for row in need(memory.get("rows"), list, f"{where}.rows"):
        numbers = isinstance(row, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in row)
        if not numbers or len(row) != 4 or not -1 <= row[3] < names:
            raise RecordError(f"{where} has a row {short(row)} that is not [start, allocated, bytes, operator]")


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
        self.dur = self.step["dur"]

    def regions(self) -> list[tuple[str, float, float]]:
        """(region, start, duration) µs from the step's start, on the step's thread."""
        return [(name, start, dur) for name, start, dur in self.step["regions"]]

    def region_of_call(self, call: int) -> str:
        index = self.step["calls"][call][4]
        return self.step["regions"][index][0] if index >= 0 else OTHER

    def calls(self, flag: int) -> list[float]:
        """The starts (µs) of the step's calls with ``flag`` (LAUNCH or SYNC)."""
        return [start for start, _, _, _, _, flags in self.step["calls"] if flags & flag]

    def gpu_events(self) -> list[tuple[str, float, float, str, str]]:
        """(stream, start, duration, category, the region whose call launched it) of the GPU work the step
        launched, whenever it ran."""
        return [
            (stream["stream"], start, dur, CATEGORIES[category], self.region_of_call(call))
            for stream in self.step["streams"]
            for start, dur, category, _, call in stream["events"]
        ]

    def end(self) -> float:
        """µs from the step's start to the end of its host part or of the last GPU work it launched."""
        return max([self.dur] + [start + dur for _, start, dur, _, _ in self.gpu_events()])

    def memory(self) -> tuple[int, list[tuple[float, int, int, str, str]]] | None:
        """(bytes allocated when the step began, [(µs from its start, bytes allocated after, the event's bytes, its
        operator, the region it fell in)]) of the step's allocator events; None where the profile recorded none."""
        memory = self.step.get("memory")
        if memory is None:
            return None
        regions = sorted((start, start + dur, name) for name, start, dur in self.regions())
        starts = [a for a, _, _ in regions]

        def region_at(t: float) -> str:
            i = bisect_right(starts, t) - 1
            return regions[i][2] if i >= 0 and t < regions[i][1] else OTHER

        rows = [
            (t, allocated, size, self.names[op] if op >= 0 else "", region_at(t))
            for t, allocated, size, op in memory["rows"]
        ]
        return memory["start"], rows
