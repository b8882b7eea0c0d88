"""The strategy sweep's sweep.json (detector/lab/sweep.py): each run's summary.json record, read back through the
project's reader, and written whole or not at all."""

import json
import math

import pytest
from conftest import stop_before_rename

from detector.checked import read_json
from detector.lab.sweep import write_sweep
from detector.train.observe.summary import SUMMARY_BYTES, TrainingSummary


def summary(run: str, final_loss: float) -> TrainingSummary:
    times = {"step_ms": 3.0, "device_idle_ms": 0.1, "data_wait_ms": 0.2, "images_per_s": 1333.0}
    times |= {"device_images_per_s": 1600.0}
    return TrainingSummary([(3, 0.95), (6, final_loss)], run=run, final_loss=final_loss, **times)


def test_sweep_json_reads_back_and_a_stop_while_it_is_written_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """sweep.json was written in place (``write_text``): a sweep stopped in its write left half a file. A run whose loss
    went NaN is JSON's NaN, as in its summary.json."""
    first = [summary("padded", 0.91), summary("packed", math.nan)]
    write_sweep(tmp_path, first, {"cuda_op": "needs a GPU"})
    stop_before_rename(monkeypatch, "sweep.json")
    with pytest.raises(KeyboardInterrupt):
        write_sweep(tmp_path, [summary("padded", 0.5)], {})
    data = read_json(tmp_path / "sweep.json", SUMMARY_BYTES)
    runs = [TrainingSummary.parse(run, f"sweep.json.runs[{i}]") for i, run in enumerate(data["runs"])]
    assert [json.dumps(run.to_json()) for run in runs] == [json.dumps(s.to_json()) for s in first]  # NaN == NaN here
    assert data["skipped"] == {"cuda_op": "needs a GPU"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
