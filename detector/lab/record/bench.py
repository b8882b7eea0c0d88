"""A `make bench` target's result file, ``<dir of bench.out>/<target>.json``: one typed, versioned record,
``BenchResult``, that every target writes (detector/bench/__init__.py ``save``) and the shape report reads again for
bench losses' cases (detector/lab/measure/costs.py, through ``LossCase``).

``read`` raises RecordError, one line naming the file and the field, for a file that is not such a record. Version 1
(no ``version`` key: written before the record was typed) is read as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from detector.checked import measure, measured, need, optional, plain, read_json, versioned, write_atomically

VERSION = 2  # 1: no "version" key
BENCH_BYTES = 64 * 2**20  # a target's cases and their times are tens of kB; a larger file is not one


@dataclass
class LossCase:
    """One case of bench losses (detector/bench/losses.py ``bench_case``) as its readers need it: the strategy, the
    batch, the boxes' distribution and count, and the median forward+backward (None: not timed)."""

    strategy: str
    distribution: str
    batch_size: int
    valid_boxes: int
    forward_backward_ms: float | None

    @classmethod
    def parse(cls, data, where: str) -> LossCase:
        need(data, dict, where)
        timed = optional(data, "forward_backward_ms", dict, where)
        return cls(
            strategy=need(data.get("strategy"), str, f"{where}.strategy"),
            distribution=need(data.get("distribution"), str, f"{where}.distribution"),
            batch_size=measure(data.get("batch_size"), f"{where}.batch_size", low=1, kind=int),
            valid_boxes=measure(data.get("valid_boxes"), f"{where}.valid_boxes", kind=int),
            forward_backward_ms=None if timed is None else measured(timed, "median", f"{where}.forward_backward_ms"),
        )


@dataclass
class BenchResult:
    """What a target measured (``results``: its own rows), on which machine (``device``, ``torch``, ``cuda`` on a GPU)
    and with which ``bench`` configuration; ``max_boxes``: the slots per image its cases hold, where it says."""

    target: str
    device: str
    torch: str
    config: dict
    results: list | dict
    cuda: str | None = None
    max_boxes: int | None = None
    version: int = VERSION

    def write(self, path: Path) -> None:
        """``path`` holds this result or what it held before, whenever the process is stopped."""
        write_atomically(path, json.dumps(plain(self), indent=2).encode())

    @classmethod
    def parse(cls, data, where: str) -> BenchResult:
        """The record of parsed JSON; RecordError naming ``where`` and the first field of the wrong shape."""
        versioned(data, where, VERSION)
        results = data.get("results")
        if not isinstance(results, (list, dict)):
            need(results, list, f"{where}.results")
        return cls(
            target=need(data.get("target"), str, f"{where}.target"),
            device=need(data.get("device"), str, f"{where}.device"),
            torch=optional(data, "torch", str, where, "?"),
            config=optional(data, "config", dict, where, {}),
            results=results,
            cuda=optional(data, "cuda", str, where),
            max_boxes=None if data.get("max_boxes") is None else measured(data, "max_boxes", where, 1, kind=int),
        )

    def loss_cases(self, where: str) -> list[LossCase]:
        """bench losses' cases; RecordError naming ``where`` and the first case of the wrong shape."""
        rows = need(self.results, list, f"{where}.results")
        return [LossCase.parse(row, f"{where}.results[{i}]") for i, row in enumerate(rows)]


def read(path) -> BenchResult:
    """The result in ``path``; RecordError, one line naming the file and the field, otherwise."""
    return BenchResult.parse(read_json(path, BENCH_BYTES), str(path))
