"""detector.lab.measure.timing: the statistics every timer returns, and the one timing loop on the CPU."""

import time

from detector.lab.measure.timing import Stats, event_ms, wall_ms
from detector.lab.present.tables import spread_cell


def test_stats_are_median_and_quartiles_and_scale_per_call():
    stats = Stats.of([5.0, 1.0, 2.0, 3.0, 4.0])
    assert (stats.median, stats.low, stats.high, stats.n) == (3.0, 2.0, 4.0, 5)
    assert Stats.of([7.0]) == Stats(7.0, 7.0, 7.0, 1)
    assert stats / 2 == Stats(1.5, 1.0, 2.0, 5)
    assert spread_cell(stats) == "3.00 [2.00–4.00]"


def test_timers_stop_at_max_seconds_once_they_have_three_samples():
    stats = event_ms(lambda: time.sleep(0.01), "cpu", warmup=0, repeats=100, max_seconds=0.0)
    assert stats.n == 3 and 5 < stats.low <= stats.median <= stats.high
    assert wall_ms(lambda: None, "cpu", warmup=1, repeats=4).n == 4
