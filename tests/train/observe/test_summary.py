"""A training run's summary.json (detector/train/observe/summary.py): one typed record, written and read back the same;
a summary of version 1 (written before the record was typed) converted; a file of the wrong shape refused in one line
naming the file and the field; a damaged value left out with one warning naming the file and the field."""

import json
import math
import re

import pytest

from detector.checked import RecordError
from detector.train.observe import summary
from detector.train.observe.board import Board
from detector.train.observe.summary import Checkpoints, Save, TrainingSummary
from detector.train.observe.wallclock import PARTS, Account

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
    wall = Account(dict.fromkeys(PARTS, 1.0), 7.0, 1 / 7, 0.5, 3.4, {"model and optimizer": 0.5}, (2, 6))
    saves = Checkpoints([Save(3, 1024, 0.01, 0.2), Save(6, 1024, 0.01, None)], 1e9, 2048, False, 0.0, 2**30)
    record = TrainingSummary(
        [(3, 0.95), (6, 0.91)], [1.0] * 6, run="padded", steps=6, final_loss=0.91, wall_clock=wall, checkpoints=saves
    )
    record.write(tmp_path / "summary.json")
    assert not list(tmp_path.glob("*.tmp-*")), "written to a temporary file, then renamed"
    assert summary.read(tmp_path) == record == summary.read(tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text())["version"] == summary.VERSION


def test_the_closing_line_counts_the_steps_that_found_no_batch_ready():
    wall = Account(dict.fromkeys(PARTS, 1.0), 7.0, 1 / 7, 0.0, 3.4, None, (2, 6))
    assert "data 1.0 s (2 of 6 steps stalled)," in wall.line()
    assert "stalled" not in Account(dict.fromkeys(PARTS, 1.0), 7.0, 1 / 7, 0.0).line()  # an older summary's


@pytest.mark.parametrize("stalls", [[7, 6], [1], [1.5, 6], [-1, 6]])
def test_stall_counts_that_cannot_be_are_refused_naming_the_field(stalls):
    data = Account(dict.fromkeys(PARTS, 1.0), 7.0, 1 / 7, 0.0).__dict__ | {"data_stalls": stalls}
    with pytest.raises(RecordError, match=r"wall_clock\.data_stalls"):
        Account.parse(data, "wall_clock")


def test_the_wall_clock_scalars_are_named_like_every_other_tag():
    """goodput/ holds one tag per part, each of lower-case words joined by underscores (``goodput/start_up_s``, not
    ``start-up_s``)."""

    class Recorded(Board):  # a board that keeps the tags it is given
        def __init__(self):
            super().__init__()
            self.tags = []

        def scalar(self, tag, value, step):
            self.tags.append(tag)

    writer = Recorded()
    Account(dict.fromkeys(PARTS, 1.0), 7.0, 1 / 7, 0.5, 3.4).add_scalars(writer, 6)
    assert writer.tags[:3] == ["goodput/share", "goodput/start_up_s", "goodput/first_step_s"], writer.tags
    assert len(writer.tags) == len(PARTS) + 1 and all(re.fullmatch(r"goodput/[a-z_]+", t) for t in writer.tags)


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
        ({"losses": [1.0, "low"]}, "summary.json.losses is str 'low', expected a number"),
        ({"history": [[50, "low"]]}, r"summary.json.history\[0\] is str 'low', expected a number"),
        ({"history": [50]}, r"summary.json.history\[0\] is 50, expected \[step, value\]"),
        ({"eval": {"mean_iou": "high"}}, "summary.json.eval.mean_iou is str 'high', expected a number"),
        ({"wall_clock": [1]}, r"summary.json.wall_clock is list \[1\], expected an object"),
        ({"checkpoints": {"saves": [3]}}, r"summary.json.checkpoints.saves\[0\] is int 3, expected an object"),
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


WALL_CLOCK = {"seconds": dict.fromkeys(PARTS, 1.0), "total_s": 7.0, "goodput": 1 / 7, "checkpoint_background_s": 0.5}
CHECKPOINTS = {"saves": [{"step": 3, "bytes": 1024, "blocked_s": 0.01, "written_s": 0.2}], "staging_bytes": 2048}
FILE = "summary.json"  # the warnings name it by its path: tmp_path / FILE


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, 1e308, "fast"])
def test_a_damaged_measure_is_left_out_with_one_warning_naming_the_file_and_the_field(tmp_path, value):
    """The measure is None, as if not measured; the rest of the summary is read as it is."""
    (tmp_path / FILE).write_text(json.dumps(VERSION_1 | {"step_ms": value, "images_per_s": value}))
    found = summary.read(tmp_path)
    shown = json.dumps(value) if not isinstance(value, str) else repr(value)
    assert found.left_out == [
        f"{tmp_path / FILE}: {key} is {shown}, expected a finite number in [0, 1e15]: left out"
        for key in ("step_ms", "images_per_s")
    ]
    assert (found.step_ms, found.images_per_s) == (None, None)
    assert (found.device_step_ms, found.steps, found.history) == (2.5, 6, [(3, 0.95), (6, 0.91)])  # the rest kept


@pytest.mark.parametrize(
    "change, warning",
    [
        (
            {"wall_clock": WALL_CLOCK | {"seconds": dict.fromkeys(PARTS, 1.0) | {"steps": math.nan}}},
            "wall_clock.seconds.steps is NaN, expected a finite number in [0, 1e15]: wall_clock left out",
        ),
        (
            {"wall_clock": WALL_CLOCK | {"seconds": {}}},
            "wall_clock.seconds.start-up is null, expected a finite number in [0, 1e15]: wall_clock left out",
        ),
        (
            {"wall_clock": WALL_CLOCK | {"goodput": 1.5}},
            "wall_clock.goodput is 1.5, expected a finite number in [0, 1]: wall_clock left out",
        ),
        (
            {"checkpoints": CHECKPOINTS | {"saves": [CHECKPOINTS["saves"][0] | {"blocked_s": -math.inf}]}},
            "checkpoints.saves[0].blocked_s is -Infinity, expected a finite number in [0, 1e15]: checkpoints left out",
        ),
        (
            {"checkpoints": CHECKPOINTS | {"saves": [{"step": 3}]}},
            "checkpoints.saves[0].bytes is null, expected an integer in [0, 1e15]: checkpoints left out",
        ),
    ],
    ids=["nan-seconds", "no-seconds", "goodput-over-1", "blocked-inf", "no-bytes"],
)
def test_a_damaged_value_in_a_part_leaves_that_part_out(tmp_path, change, warning):
    """The wall clock and the checkpoints are each read whole or not at all: their parts add up to each other."""
    whole = VERSION_1 | {"wall_clock": WALL_CLOCK, "checkpoints": CHECKPOINTS}
    (tmp_path / FILE).write_text(json.dumps(whole | change))
    found = summary.read(tmp_path)
    assert found.left_out == [f"{tmp_path / FILE}: {warning}"]
    part = next(iter(change))
    assert getattr(found, part) is None and found.step_ms == 3.0
    kept = ({"wall_clock", "checkpoints"} - {part}).pop()
    assert getattr(found, kept) is not None


def test_a_damaged_count_or_history_point_is_left_out_and_a_nan_loss_is_kept(tmp_path):
    """A run whose loss went non-finite wrote NaN losses: those are what it measured, not damage."""
    history = [[3, math.nan], [-6, 0.91], [9, 0.9]]
    change = {"history": history, "final_loss": math.nan, "losses": [math.nan], "steps": 2.5, "checkpoint_step": -1}
    (tmp_path / FILE).write_text(json.dumps(VERSION_1 | change))
    found = summary.read(tmp_path)
    assert found.left_out == [
        f"{tmp_path / FILE}: history[1] is -6, expected an integer in [0, 1e15]: history[1] left out",
        f"{tmp_path / FILE}: steps is 2.5, expected an integer in [0, 1e15]: left out",
    ]
    assert [step for step, _ in found.history] == [3, 9] and math.isnan(found.history[0][1])
    assert math.isnan(found.final_loss) and math.isnan(found.losses[0])
    assert (found.steps, found.checkpoint_step) == (0, -1)  # the default where damaged; -1: no checkpoint


def test_what_was_left_out_is_not_written_back(tmp_path):
    (tmp_path / FILE).write_text(json.dumps(VERSION_1 | {"step_ms": math.nan}))
    found = summary.read(tmp_path)
    assert found.left_out and "left_out" not in found.to_json() and found.to_json()["version"] == summary.VERSION
    found.write(tmp_path / FILE)
    again = json.loads((tmp_path / FILE).read_text())
    assert "left_out" not in again and again["step_ms"] is None and summary.read(tmp_path).left_out == []


def test_full_collections_are_counted_with_their_pauses_and_the_step_they_followed(monkeypatch):
    """The interpreter's full collections within the steps (wallclock.FullCollections): each counted, timed, the
    longest with its step; the younger generations' collections are not full ones; none, no line. The pauses are the
    test's (a clock read at each collection's start and end): a loaded machine's would order nothing."""
    import gc
    import types

    from detector.train.observe import wallclock
    from detector.train.observe.wallclock import FullCollections

    readings = iter([10.0, 10.1, 20.0, 20.5])  # the first full collection pauses 0.1 s, the second 0.5 s
    monkeypatch.setattr(wallclock, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    step = [3]
    gc.disable()  # the collections the test makes alone
    try:
        with FullCollections(lambda: step[0]) as collections:
            assert collections.line() is None
            gc.collect(0)
            gc.collect(1)
            assert collections.count == 0
            gc.collect()
            step[0] = 9
            gc.collect()  # the longer pause: it follows step 9
    finally:
        gc.enable()
    assert collections.count == 2 and collections.after == 9
    assert 0 < collections.longest <= collections.seconds
    assert (collections.longest, collections.seconds) == pytest.approx((0.5, 0.6))
    assert collections.line().startswith("garbage collection: 2 full collections of the interpreter's objects")
    assert collections.line().endswith("0.60 s in all (the longest 0.50 s, after step 9)")
    gc.collect()
    assert collections.count == 2  # the callback left with the block
