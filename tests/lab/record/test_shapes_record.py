"""shapes.json (detector/lab/record/shapes.py): written by `make shapes` and read back the same (tests/lab/
test_shapes.py), one of version 1 read and written back as the current version, a field of the wrong type or a damaged
value refused in one line naming the file and the field."""

import json

import pytest

from detector.checked import RecordError
from detector.lab.record.shapes import Memory, ProfiledStep, read_shapes, write_shapes
from detector.lab.record.spread import Spread

STEP = {"median": 101.0, "q1": 100.5, "q3": 101.5, "min": 100.0, "max": 102.0, "n": 10}
# shapes.json as `make shapes` wrote it before it had a version, a memory section or noisy runs
VERSION_1 = {
    "source": "widerface:wider_like.txt",
    "device": "cpu",
    "images": 300,
    "boxes": 4280,
    "max_boxes": 32,
    "over_max_boxes": "truncate",
    "batch_size": 16,
    "histogram": [[0, 0, 46], [1, 31, 251], [32, 32, 0], [33, 1086, 3]],
    "padding": 0.811,
    "over": {"images": 3, "dropped": 2469},
    "batch": {"slots": 512, "boxes": 96.9},
    "costs": {
        "source": "bench/losses.json (cpu, torch 2.13.0)",
        "file": "bench/losses.json",
        "strategies": [
            {"strategy": "packed", "per_slot_ms": 1e-4, "per_box_ms": 2e-3, "measured": "batch 16 x 32 slots"},
            {"strategy": "padded", "per_slot_ms": 1e-3, "per_box_ms": 0.0, "measured": "batch 16 x 32 slots"},
        ],
    },
    "predicted": {
        "strategy": "packed",
        "ties": [],
        "reason": "packed pays mostly for the boxes",
        "ranking": [["packed", 0.244, "boxes"], ["padded", 0.512, "slots"]],
    },
    "measured": {
        "profile_dir": "runs/profile",
        "runs": {"padded": [STEP, "runs/profile/padded/20261122-030000"]},
        "fastest": ["padded"],
        "disagreements": [["packed", "padded", 2.0]],
    },
}


def test_a_shape_report_of_version_1_is_read_and_written_back_as_the_current_version(tmp_path):
    (tmp_path / "shapes.json").write_text(json.dumps(VERSION_1))
    found = read_shapes(tmp_path)
    assert found.histogram[-1] == (33, 1086, 3) and found.over.dropped == 2469 and found.batch.slots == 512
    assert [c.strategy for c in found.costs.costs] == ["packed", "padded"] and found.costs.file == "bench/losses.json"
    assert found.predicted.ranking[0] == ("packed", 0.244, "boxes")
    assert found.measured.runs == {"padded": ProfiledStep(Spread(**STEP), "runs/profile/padded/20261122-030000")}
    assert found.measured.noisy == {} and found.memory == Memory() and found.auto == ""  # added after version 1
    write_shapes(tmp_path, found)
    written = json.loads((tmp_path / "shapes.json").read_text())
    assert written["version"] == 2
    assert {k: v for k, v in written.items() if k not in ("version", "memory", "auto")} == VERSION_1 | {
        "measured": VERSION_1["measured"] | {"noisy": {}}
    }
    assert read_shapes(tmp_path / "shapes.json") == found


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.update(images="300"), r"shapes.json.images is '300', expected an integer"),
        (lambda s: s["over"].update(dropped=-1), r"shapes.json.over.dropped is -1, expected an integer in \[0, "),
        (lambda s: s.update(padding=1.5), r"shapes.json.padding is 1.5, expected a finite number in \[0, 1\]"),
        (lambda s: s["histogram"][1].pop(), r"shapes.json.histogram\[1\] has 2 values, expected 3"),
        (lambda s: s["costs"]["strategies"][1].pop("per_box_ms"), r"costs.strategies\[1\].per_box_ms is null"),
        (lambda s: s["predicted"]["ranking"][0].__setitem__(1, "fast"), r"predicted.ranking\[0\]\[1\] is 'fast'"),
        (lambda s: s["measured"]["runs"]["padded"][0].update(median=None), r"measured.runs.padded\[0\] has n=10"),
        (lambda s: s["measured"].update(fastest="padded"), r"shapes.json.measured.fastest is str 'padded'"),
        (lambda s: s.update(version=3), "version 3, this detector reads versions 1 and 2"),
        (lambda s: s.pop("histogram"), "no histogram: not written by make shapes"),
    ],
)
def test_a_shape_report_of_the_wrong_shape_is_one_line(tmp_path, change, message):
    data = json.loads(json.dumps(VERSION_1))
    change(data)
    (tmp_path / "shapes.json").write_text(json.dumps(data))
    with pytest.raises(RecordError, match=message) as err:
        read_shapes(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path / "shapes.json") in str(err.value)
