"""JSON read with its types checked: every reader of a record the project writes and reads again (a training run's
summary, detector/train/summary.py; the lab's records, detector/lab/record/) goes through these, so that a file of the
wrong shape is one line naming the file, the field and what was expected, never a traceback from deep in a reader."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

LIMIT = 1e15  # beyond any measure of a step (10^15 ms is 30,000 years; bytes: a petabyte)


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
        raise RecordError(f"{where}: version {short(found)}, this detector reads versions 1 and {version}")
    return found


def short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def optional(data: dict, key: str, kind, where: str, default=None):
    value = data.get(key, default)
    return default if value is None else need(value, kind, f"{where}.{key}")


def usable(value) -> bool:
    """Whether a measured value can be one: a finite number in [0, LIMIT] (None: not measured)."""
    return value is None or (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= LIMIT
    )


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
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise RecordError(f"{path}: not JSON ({type(err).__name__}: {str(err)[:60]})") from None
