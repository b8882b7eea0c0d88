"""A measure's spread over steps: its median, quartiles, min, max and count, the one shape in which every record of
the lab holds a distribution (a profile run's regions, its timed steps, compare.json)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from detector.checked import RecordError, measured, need


@dataclass(frozen=True)
class Spread:
    """The median, quartiles (inclusive method), min, max and count of a measure's values over steps; all None
    with n = 0 where it has none. ``low`` and ``high`` are the quartiles: the interval of the speed-up rule
    (detector/lab/present/tables.py)."""

    median: float | None = None
    q1: float | None = None
    q3: float | None = None
    min: float | None = None
    max: float | None = None
    n: int = 0

    @classmethod
    def of(cls, values) -> Spread:
        values = [v for v in values if v is not None]
        if not values:
            return cls()
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
        return cls(statistics.median(values), q1, q3, min(values), max(values), len(values))

    @property
    def low(self) -> float | None:
        return self.q1

    @property
    def high(self) -> float | None:
        return self.q3

    def __bool__(self) -> bool:
        return self.n > 0 and self.median is not None

    def relative_iqr(self) -> float | None:
        """(q3 - q1) / median: how widely the steps spread, as a share of the median."""
        return (self.q3 - self.q1) / self.median if self and self.median > 0 else None

    @classmethod
    def parse(cls, data, where: str) -> Spread:
        """RecordError for no spread, Damaged for a value no measure takes (a reader leaves the spread out)."""
        need(data, dict, where)
        values = {key: measured(data, key, where) for key in ("median", "q1", "q3", "min", "max")}
        n = measured(data, "n", where, kind=int, default=0)
        if n and values["median"] is None:
            raise RecordError(f"{where} has n={n} but no median")
        return cls(**values, n=n) if n else cls()
