"""The value check every reader of our own records shares (detector/checked.py): a number is finite, in its range and
of its type, or it is damaged; a damaged value costs its field, or the part that holds it, with one warning naming the
file and the field. The read of a record's JSON: a file nested past the parser's depth or not in Unicode is one line
naming it; a number past a float's range is read as infinity, which its field refuses by value."""

import dataclasses
import gzip
import math
import sys

import pytest

from detector.checked import LIMIT, Damaged, LeftOut, RecordError, all_fit, measure, measured, plain, read_json


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


@pytest.mark.parametrize(
    "raw, said",
    [
        (
            b"[" * 100_000 + b"]" * 100_000,
            "lists or objects nested about {limit} deep or more: not a record this detector writes",
        ),
        (gzip.compress(b'{"a": ' * 100_000), "lists or objects nested about {limit} deep or more"),  # gzipped
        (b'{"step": "\xff"}', "not JSON (byte 0xff at offset 10 is not utf-8 text)"),
        ('{"step": 3}'.encode("utf-16-le") + b"}", "not JSON (byte 0x7d at offset 22 is not utf-16-le text)"),  # odd
    ],
    ids=["deep", "deep-gzipped", "not-utf-8", "not-utf-16"],
)
def test_a_file_nested_too_deep_or_not_in_unicode_is_one_line_naming_it(tmp_path, raw, said):
    """Nested 100,000 deep, checkpoint.json was a RecursionError traceback; a byte that is not UTF-8 is named with its
    offset."""
    path = tmp_path / "record.json"
    path.write_bytes(raw)
    with pytest.raises(RecordError) as err:
        read_json(path, 2**20)
    # the depth said is the interpreter's recursion limit as the file is read (torch's compiler raises it to 2000)
    said = said.format(limit=sys.getrecursionlimit())
    assert str(err.value).startswith(f"{path}: {said}") and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
def test_a_record_in_another_unicode_encoding_is_read_as_its_utf_8_twin(tmp_path, encoding):
    """JSON's RFC 4627 encodings, with a byte order mark or without (an editor's save of a record)."""
    text = '{"step": 3, "name": "caf\u00e9"}'
    (tmp_path / "record.json").write_bytes(text.encode(encoding))
    assert read_json(tmp_path / "record.json", 2**20) == {"step": 3, "name": "café"}


@pytest.mark.parametrize("number", ["1e999", "9" * 310, "9" * 10_000, "-" + "9" * 10_000])
def test_a_number_beyond_a_floats_range_is_read_as_infinity_and_its_field_refuses_it(tmp_path, number):
    """A 310-digit integer was an OverflowError in ``fits`` (a profile summary's compare: a traceback), a 10,000-digit
    one a ValueError of Python's 4300-digit limit; each is now infinity, as 1e999 is, and its field says so."""
    path = tmp_path / "summary.json"
    path.write_text(f'{{"step_ms": {number}, "steps": {"9" * 300}}}')
    data = read_json(path, 2**20)
    assert data["steps"] == int("9" * 300)  # an integer a float can hold stays exact
    with pytest.raises(Damaged, match=r"summary.json.step_ms is -?Infinity, expected a finite number in \[0, 1e15\]"):
        measured(data, "step_ms", str(path))


@dataclasses.dataclass
class _Part:
    rows: list
    why: dict


@dataclasses.dataclass
class _Whole:
    name: str
    parts: list[_Part]
    by_name: dict[str, _Part]
    empty: list
    none: object = None


def test_plain_is_asdict_without_copying_the_rows():
    """What a record writes: asdict's dicts and lists, field for field (dataclasses in lists and dicts included), but
    its rows handed over as they stand (an extract's hundreds of thousands of numbers), not copied leaf by leaf."""
    rows = [[0.5, 1, "a"], [2.0, 3, "b"]]
    part = _Part(rows=rows, why={"forward": {"ms": 1.5}})
    whole = _Whole(name="w", parts=[part, _Part([], {})], by_name={"p": part}, empty=[])
    assert plain(whole) == dataclasses.asdict(whole)
    assert plain(whole)["parts"][0]["rows"] is rows and plain(whole)["by_name"]["p"]["rows"] is rows
    assert plain(whole)["parts"][0] is not plain(whole)["by_name"]["p"]  # a dict per place, as asdict's
    assert plain([part, 3]) == [dataclasses.asdict(part), 3] and plain(_Part) is _Part  # a class is no record
