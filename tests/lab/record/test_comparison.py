"""compare.json (detector/lab/record/comparison.py): written by `make compare` and read back the same (tests/lab/
test_compare.py), one of version 1 converted, a field of the wrong type refused in one line naming the file and it, a
value no measure takes left out with one warning naming the file and the field."""

import json

import pytest

from detector.checked import RecordError
from detector.lab.record.comparison import ComparisonRecord, ModeComparison, read_comparison, write_comparison
from detector.lab.record.spread import Spread

STEP = {"median": 43.0, "q1": 42.6, "q3": 43.4, "min": 42.0, "max": 44.0, "n": 10}
# compare.json as `make compare` wrote it before it had a version or ``loader_paced``
VERSION_1 = {
    "created": "2026-01-01T12:00:00",
    "out_dir": "runs/compare/20260101-120000",
    "modes": {
        "train": {
            "labels": ["padded", "packed"],
            "baseline": "padded",
            "regions": {"step": {"padded": {"wall_ms": STEP}, "packed": {"wall_ms": STEP | {"median": 40.0}}}},
            "timed": {"padded": STEP, "packed": None},
            "speedups_vs_padded": {"wall_ms": {"step": {"padded": None, "packed": 1.075}}},
            "step_verdicts": {"packed": 1.075},
            "timed_verdicts": {"packed": None},
            "verdicts": ["- **packed** — ..."],
            "warnings": {"padded": [], "packed": []},
            "noisy": {"padded": False, "packed": False},
        }
    },
    "runs": [{"label": "padded", "strategy": "padded", "mode": "train", "run": "1", "dir": "x", "noisy": None}],
    "files": ["compare.md"],
}


def test_a_comparison_of_version_1_is_read_and_written_back_as_the_current_version(tmp_path):
    (tmp_path / "compare.json").write_text(json.dumps(VERSION_1))
    found = read_comparison(tmp_path)
    train = found.modes["train"]
    assert train.step("padded") == Spread(**STEP) and train.step("packed").median == 40.0
    assert train.timed == {"padded": Spread(**STEP), "packed": None} and train.loader_paced == {}
    assert train.speedups_vs_padded["wall_ms"]["step"] == {"padded": None, "packed": 1.075}
    assert found.runs[0].strategy == "padded" and found.runs[0].data is None
    write_comparison(tmp_path, found)
    assert json.loads((tmp_path / "compare.json").read_text())["version"] == 2
    assert read_comparison(tmp_path / "compare.json") == found


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["modes"]["train"].update(labels="padded"), "compare.json.modes.train.labels is str"),
        (lambda c: c["modes"]["train"]["noisy"].update(packed="yes"), "noisy.packed is str 'yes', expected true or"),
        (lambda c: c["modes"]["train"]["regions"]["step"]["padded"].update(wall_ms=[1]), "step.padded.wall_ms is list"),
        (lambda c: c["runs"][0].pop("strategy"), r"compare.json.runs\[0\].strategy is NoneType"),
        (lambda c: c.update(version=3), "version 3, this detector reads versions 1 and 2"),
        (lambda c: c.pop("modes"), "no modes: not written by make compare"),
    ],
)
def test_a_comparison_of_the_wrong_shape_is_one_line(tmp_path, change, message):
    data = json.loads(json.dumps(VERSION_1))
    change(data)
    (tmp_path / "compare.json").write_text(json.dumps(data))
    with pytest.raises(RecordError, match=message) as err:
        read_comparison(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path / "compare.json") in str(err.value)


def test_a_mode_without_a_step_has_none():
    assert ModeComparison(["padded"], None, {}).step("padded") is None
    assert ComparisonRecord("", "").modes == {}


def test_damaged_spreads_and_speed_ups_are_left_out_with_one_warning_each(tmp_path):
    """`make report` reads compare.json again: a NaN or negative time there is absent, never "nan %" or -124.9."""
    data = json.loads(json.dumps(VERSION_1))
    train = data["modes"]["train"]
    train["regions"]["step"]["packed"]["wall_ms"]["median"] = float("nan")
    train["timed"]["padded"]["q1"] = -124.922
    train["step_verdicts"]["packed"] = "2x"
    train["speedups_vs_padded"]["wall_ms"]["step"]["packed"] = float("inf")
    data["runs"][0]["max_boxes"] = -1
    (tmp_path / "compare.json").write_text(json.dumps(data))
    found = read_comparison(tmp_path)
    file = tmp_path / "compare.json"
    assert found.left_out == [
        f"{file}: modes.train.regions.step.packed.wall_ms.median is NaN, expected a finite number in [0, 1e15]: "
        "modes.train.regions.step.packed.wall_ms left out",
        f"{file}: modes.train.speedups_vs_padded.wall_ms.step.packed is Infinity, expected a finite number in "
        "[0, 1e15]: left out",
        f"{file}: modes.train.timed.padded.q1 is -124.922, expected a finite number in [0, 1e15]: "
        "modes.train.timed.padded left out",
        f"{file}: modes.train.step_verdicts.packed is '2x', expected a finite number in [0, 1e15]: left out",
        f"{file}: runs[0].max_boxes is -1, expected an integer in [0, 1e15]: left out",
    ]
    mode = found.modes["train"]
    assert mode.step("packed") is None and mode.step("padded") == Spread(**STEP)  # the rest read
    assert mode.timed["padded"] == Spread() and mode.step_verdicts == {"packed": None}
    assert found.runs[0].max_boxes is None and "left_out" not in found.to_json()
