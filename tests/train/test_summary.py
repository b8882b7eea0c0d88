"""A training run's summary.json (detector/train/summary.py): one typed record, written and read back the same; a
summary of version 1 (written before the record was typed) converted; a file of the wrong shape refused in one line
naming the file and the field."""

import json
import math

import pytest

from detector.checked import RecordError
from detector.train import summary
from detector.train.summary import Checkpoints, Save, TrainingSummary
from detector.train.wallclock import PARTS, Account

# A version-1 summary as `make train` wrote it before the record was typed: no version, no wall clock, no checkpoints
VERSION_1 = {
    "experiment": "cpu_smoke",
    "run": "padded",
    "strategy": "padded",
    "device": "cpu",
    "world_size": 1,
    "global_batch": 4,
    "steps": 6,
    "resumed_at": 0,
    "final_loss": 0.91,
    "eval": {"mean_iou": 0.2, "boxes": 12},
    "step_ms": 3.0,
    "device_step_ms": 2.5,
    "device_idle_ms": 0.1,
    "data_wait_ms": 0.2,
    "images_per_s": 1333.3,
    "device_images_per_s": 1600.0,
    "timed_steps": 1,
    "peak_memory_gib": None,
    "history": [[3, 0.95], [6, 0.91]],
    "losses": [1.0, 0.95, 0.9, 0.93, 0.91, 0.89],
    "evals": [[6, {"mean_iou": 0.2, "boxes": 12}]],
    "checkpoint_step": 6,
    "eval_step": 6,
}


def test_a_summary_is_written_and_read_back_the_same(tmp_path):
    wall = Account(dict.fromkeys(PARTS, 1.0), 7.0, 1 / 7, 0.5, 3.4)
    saves = Checkpoints([Save(3, 1024, 0.01, 0.2), Save(6, 1024, 0.01, None)], 1e9, 2048, False, 0.0, 2**30)
    record = TrainingSummary(
        [(3, 0.95), (6, 0.91)], [1.0] * 6, run="padded", steps=6, final_loss=0.91, wall_clock=wall, checkpoints=saves
    )
    record.write(tmp_path / "summary.json")
    assert not list(tmp_path.glob("*.tmp-*")), "written to a temporary file, then renamed"
    assert summary.read(tmp_path) == record == summary.read(tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text())["version"] == summary.VERSION


def test_a_summary_of_version_1_is_converted(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(VERSION_1))
    found = summary.read(tmp_path)
    assert found.version == 2 and (found.wall_clock, found.checkpoints) == (None, None)  # not recorded then
    assert found.history == [(3, 0.95), (6, 0.91)] and found.evals == [(6, {"mean_iou": 0.2, "boxes": 12})]
    assert (found.steps, found.step_ms, found.eval["mean_iou"]) == (6, 3.0, 0.2)
    (tmp_path / "summary.json").write_text(json.dumps({"history": [[50, 1.2]]}))  # the least a reader needs
    least = summary.read(tmp_path)
    assert least.history == [(50, 1.2)] and math.isnan(least.final_loss) and least.step_ms is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"step_ms": "fast"}, "summary.json.step_ms is str 'fast', expected a number"),
        ({"history": [[50, "low"]]}, r"summary.json.history\[0\] is str 'low', expected a number"),
        ({"history": [50]}, r"summary.json.history\[0\] is 50, expected \[step, value\]"),
        ({"eval": {"mean_iou": "high"}}, "summary.json.eval.mean_iou is str 'high', expected a number"),
        ({"wall_clock": {"seconds": {}, "total_s": 1}}, "summary.json.wall_clock.seconds.start-up is NoneType"),
        ({"checkpoints": {"saves": [{"step": 3}]}}, r"summary.json.checkpoints.saves\[0\].bytes is NoneType"),
        ({"version": 3}, "summary.json: version 3, this detector reads versions 1 and 2"),
    ],
)
def test_a_summary_of_the_wrong_shape_is_one_line_naming_the_field(tmp_path, change, message):
    (tmp_path / "summary.json").write_text(json.dumps(VERSION_1 | change))
    with pytest.raises(RecordError, match=message) as err:
        summary.read(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path / "summary.json") in str(err.value)


def test_a_file_that_is_no_training_summary_is_refused(tmp_path):
    with pytest.raises(RecordError, match="summary.json: no such file"):
        summary.read(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"strategy": "padded", "mode": "train"}))  # a profile's
    with pytest.raises(RecordError, match=r"no loss curve \(history\): not written by make train"):
        summary.read(tmp_path)
