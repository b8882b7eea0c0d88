"""JSON read with its types and values checked: every reader of a record the project writes and reads again (a training
run's summary, detector/train/observe/summary.py; the lab's records, detector/lab/record/) goes through these, so that a
file of the wrong shape is one line naming the file, the field and what was expected, never a traceback from deep in a
reader.

A number is checked by value where it is read (``measure``: finite, in its range, of its type). A damaged one costs
its field, or the part of the record that holds it (a wall clock, a step, a row), never the record: ``LeftOut``
collects one warning per damage, naming the file and the field, and the readers carry them as ``left_out``."""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

LIMIT = 1e15  # beyond any measure of a step (10^15 ms is 30,000 years; bytes: a petabyte)
NUMBER = (int, float)
CLOCK = 1e18  # µs on a host's clock, which may count from 1970 (1.8e15 µs by now): an instant's bound


class RecordError(ValueError):
    """A file that is not a record this code reads: one line, naming the file and the reason."""


def need(value, kind, where: str):
    """``value`` if it is of ``kind`` (bool is not a number), else RecordError naming ``where``."""
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float, (int, float)))
    if not ok:
        names = {int: "an integer", float: "a number", (int, float): "a number", str: "a string", list: "a list"}
        names |= {dict: "an object", bool: "true or false"}
        raise RecordError(f"{where} is {type(value).__name__} {short(value)}, expected {names.get(kind, kind)}")
    return value


def versioned(data, where: str, version: int) -> int:
    """The version of a record's parsed JSON (1 where it names none: written before records were versioned); a
    RecordError naming ``where`` for what is not a JSON object, or of a version this code does not read."""
    if not isinstance(data, dict):
        raise RecordError(f"{where}: not a JSON object")
    found = data.get("version", 1)
    if found not in (1, version):
        reads = "version 1" if version == 1 else f"versions 1 and {version}"
        raise RecordError(f"{where}: version {short(found)}, this detector reads {reads}")
    return found


def short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def optional(data: dict, key: str, kind, where: str, default=None):
    value = data.get(key, default)
    return default if value is None else need(value, kind, f"{where}.{key}")


def usable(value) -> bool:
    """Whether a measured value can be one: a finite number in [0, LIMIT] (None: not measured)."""
    return value is None or fits(value)


def fits(value, low: float = 0, high: float = LIMIT, kind=NUMBER) -> bool:
    """Whether ``value`` is a finite number of ``kind`` (bool is none) in [low, high]."""
    return isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value) and low <= value <= high


def all_fit(values, low: float = 0, high: float = LIMIT, kind=NUMBER) -> bool:
    """Whether every one of ``values`` fits (``fits``), checked at C's pace: an extract's step holds 10^5 rows."""
    if not set(map(type, values)) <= ({int} if kind is int else {int, float}):
        return False
    try:
        return not values or (math.isfinite(math.fsum(values)) and low <= min(values) and max(values) <= high)
    except (OverflowError, ValueError):  # a sum past a float's range, or inf - inf: not finite values
        return False


class Damaged(RecordError):
    """A value that its field cannot hold (not finite, out of its range, of another type, a row of another shape):
    where the record is read, the field or the part that holds it is left out (``LeftOut``), the rest kept."""

    def __init__(self, where: str, value, expected: str):
        self.where, self.what = where, f"is {short(value)}, expected {expected}"
        super().__init__(f"{where} {self.what}")


def measure(value, where: str, low: float = 0, high: float = LIMIT, kind=NUMBER):
    """``value`` if it is a finite number of ``kind`` in [low, high]; Damaged naming ``where`` otherwise."""
    if not fits(value, low, high, kind):
        expected = "an integer" if kind is int else "a finite number"
        raise Damaged(where, value, f"{expected} in [{bound(low)}, {bound(high)}]")
    return value


def measured(data: dict, key: str, where: str, low: float = 0, high: float = LIMIT, kind=NUMBER, default=None):
    """``data[key]`` checked by ``measure``; ``default`` where it is absent or null (not measured)."""
    value = data.get(key)
    return default if value is None else measure(value, f"{where}.{key}", low, high, kind)


def bound(x: float) -> str:
    return f"{x:g}".replace("e+", "e")  # 1e15, not 1e+15


class LeftOut:
    """What a reader of ``file`` left out: one warning per damaged value, naming the file and the field, and what
    the damage cost (the field, or the part that holds it)."""

    def __init__(self, file):
        self.file = str(file)
        self.warnings: list[str] = []

    def measure(self, data: dict, key: str, where: str, low=0, high=LIMIT, kind=NUMBER, default=None):
        """``measured(...)``, or ``default`` and a warning where the value is damaged."""
        try:
            return measured(data, key, where, low, high, kind, default)
        except Damaged as err:
            self.warn(err, "left out")
            return default

    def part(self, parse, data, where: str, *args):
        """``parse(data, where, *args)``, or None and one warning where a value in it is damaged: the part (named
        by ``where``) left out."""
        try:
            return parse(data, where, *args)
        except Damaged as err:
            self.warn(err, f"{self.field(where)} left out")
            return None

    def field(self, where: str) -> str:
        return where.removeprefix(self.file).lstrip(".: ")  # a reader's ``where`` starts with its file

    def warn(self, err: Damaged, cost: str) -> None:
        self.warnings.append(f"{self.file}: {self.field(err.where)} {err.what}: {cost}")


def plain(record) -> Any:
    """A record (dataclasses, dicts and lists of them) as the dicts and lists JSON writes, as ``dataclasses.asdict``
    gives it, but with a list of values (a row, a list of rows) handed over as it stands rather than copied leaf by
    leaf: an extract holds hundreds of thousands of numbers, and asdict's deep copy took most of its write. The
    result shares those lists with the record: write it, do not change them in place."""
    if is_dataclass(record) and not isinstance(record, type):
        return {f.name: plain(getattr(record, f.name)) for f in fields(record)}
    if isinstance(record, dict):
        return {key: plain(value) for key, value in record.items()}
    if isinstance(record, (list, tuple)) and any(isinstance(v, dict) or is_dataclass(v) for v in record):
        return [plain(value) for value in record]
    return record


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` on disk, or what it held before, whenever the process is stopped: a new temporary file
    beside it (never written through a link that stands at its name), fsync, a rename over it, the folder's fsync.
    Every record the project writes and reads again is written so."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover of a stopped write, or a link: removed, not followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path, limit: int) -> Any:
    """The JSON of a file (gzipped or not) of at most ``limit`` bytes; RecordError naming it otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            stream = gzip.open(f) if head == b"\x1f\x8b" else f
            raw = stream.read(limit + 1)
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except (OSError, EOFError) as err:
        raise RecordError(f"{path}: cannot read it ({type(err).__name__}: {err})") from None
    if len(raw) > limit:
        packed = " decompressed" if head == b"\x1f\x8b" else ""
        raise RecordError(f"{path}: larger than {limit // 2**20} MiB{packed}: not a record this lab writes")
    try:
        return json.loads(raw, parse_int=integer)  # UTF-8, a BOM or UTF-16 and 32, as JSON's RFC 4627 read them
    except UnicodeDecodeError as err:
        where = f"byte {err.object[err.start]:#04x} at offset {err.start}"
        raise RecordError(f"{path}: not JSON ({where} is not {err.encoding} text)") from None
    except ValueError as err:
        raise RecordError(f"{path}: not JSON ({type(err).__name__}: {str(err)[:60]})") from None
    except RecursionError:
        deep = f"lists or objects nested about {sys.getrecursionlimit()} deep or more"
        raise RecordError(f"{path}: {deep}: not a record this detector writes") from None


def integer(digits: str) -> int | float:
    """A JSON integer: an int, or where it is beyond a float's range a float (inf), as 1e999 is read: a reader's check
    (``fits``) then refuses it by value, naming its field, where Python's int would be an OverflowError there, or
    past 4300 digits a ValueError of the parser."""
    return int(digits) if len(digits) <= 300 else float(digits)
