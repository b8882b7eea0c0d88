"""The value check every reader of our own records shares (detector/checked.py): a number is finite, in its range and
of its type, or it is damaged; a damaged value costs its field, or the part that holds it, with one warning naming the
file and the field."""

import math

import pytest

from detector.checked import LIMIT, Damaged, LeftOut, all_fit, measure, measured


@pytest.mark.parametrize(
    "value, kind, shown",
    [
        (math.nan, (int, float), "NaN, expected a finite number in [0, 1e15]"),
        (math.inf, (int, float), "Infinity, expected a finite number in [0, 1e15]"),
        (-math.inf, (int, float), "-Infinity, expected a finite number in [0, 1e15]"),
        (-1, (int, float), "-1, expected a finite number in [0, 1e15]"),
        (1e308, (int, float), "1e+308, expected a finite number in [0, 1e15]"),
        ("fast", (int, float), "'fast', expected a finite number in [0, 1e15]"),
        (True, (int, float), "true, expected a finite number in [0, 1e15]"),  # bool is no number
        (None, (int, float), "null, expected a finite number in [0, 1e15]"),  # where one is needed
        (1.5, int, "1.5, expected an integer in [0, 1e15]"),
    ],
)
def test_a_damaged_value_is_named_with_its_field_and_what_was_expected(value, kind, shown):
    with pytest.raises(Damaged) as err:
        measure(value, "run/summary.json.step_ms", kind=kind)
    assert str(err.value) == f"run/summary.json.step_ms is {shown}"
    assert all_fit([1.0, value], kind=kind) is False  # the fast check over many values agrees


def test_a_value_in_its_range_is_kept_as_it_is():
    assert measure(0, "x") == 0 and measure(LIMIT, "x") == LIMIT and measure(-3.5, "x", low=-LIMIT) == -3.5
    assert measured({}, "pin_s", "x") is None and measured({"pin_s": None}, "pin_s", "x", default=0.0) == 0.0
    assert all_fit([]) and all_fit([0, 2.5, LIMIT]) and all_fit([-1, 3], low=-1, high=3, kind=int)
    assert not all_fit([4], high=3, kind=int) and not all_fit([1e308, 1e308]) and not all_fit([math.inf, -math.inf])


def test_a_reader_leaves_out_the_field_or_the_part_and_says_so_once():
    found = LeftOut("run/summary.json")
    data = {"step_ms": math.nan, "images_per_s": 10.0, "wall_clock": {"total_s": -1}}
    assert found.measure(data, "step_ms", "run/summary.json") is None
    assert found.measure(data, "images_per_s", "run/summary.json") == 10.0

    def wall_clock(part, where):
        return measure(part["total_s"], f"{where}.total_s")

    assert found.part(wall_clock, data["wall_clock"], "run/summary.json.wall_clock") is None
    assert found.warnings == [
        "run/summary.json: step_ms is NaN, expected a finite number in [0, 1e15]: left out",
        "run/summary.json: wall_clock.total_s is -1, expected a finite number in [0, 1e15]: wall_clock left out",
    ]
