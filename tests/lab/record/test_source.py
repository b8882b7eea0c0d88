"""A run's data source in its record (detector/lab/record/source.py): written by `make profile`, read back (older
summaries without it too), shown on the run's card and in `make compare`, which says when runs came from different
boxes."""

import json

import pytest
from annotation_helpers import coco_json, widerface_text, write_coco
from lab_helpers import edit_summary, make_run

from detector.checked import RecordError
from detector.config.schema import load_config
from detector.lab.compare import run_compare
from detector.lab.present.text import run_card
from detector.lab.record.run import read_summary
from detector.lab.record.source import DataSource

WIDER = {"boxes": "widerface:gt.txt", "over_max_boxes": "truncate", "images": 12880, "total_boxes": 159424}
WIDER |= {"largest": 1968, "truncated": 21, "dropped": 3512}


def test_the_source_of_a_configuration(tmp_path):
    (tmp_path / "gt.txt").write_text(widerface_text([3, 0, 9, 1], seed=2))
    source = f"widerface:{tmp_path / 'gt.txt'}"
    cfg = load_config(["preset=cpu", f"data.boxes={source}", "data.max_boxes=4"], announce=None)
    assert DataSource.of(cfg.data) == DataSource(source, "truncate", 4, 13, 9, 1, 5)
    fit = load_config(["preset=cpu", f"data.boxes={source}", "data.over_max_boxes=fit"], announce=None)
    assert DataSource.of(fit.data) == DataSource(source, "fit", 4, 13, 9, 0, 0)
    assert DataSource.of(load_config(["preset=cpu"], announce=None).data) == DataSource("synthetic", "truncate")


def test_boxes_clipped_to_their_image_are_announced_and_recorded(tmp_path):
    data = coco_json([2, 1])
    data["annotations"][0]["bbox"] = [600.0, 400.0, 100.0, 100.0]  # past the right and the bottom of 640 x 480
    source = f"coco:{write_coco(tmp_path / 'c.json', data)}"
    lines = []
    cfg = load_config(["preset=cpu", f"data.boxes={source}"], announce=lines.append)
    assert "; 1 box partly outside the image clipped to it; " in lines[1]
    recorded = DataSource.of(cfg.data)
    assert recorded.clipped == 1 and recorded.describe().endswith("none over the slots; 1 box clipped to the image)")


def test_an_older_summary_has_no_source_and_a_newer_one_reads_back(tmp_path):
    run = make_run(tmp_path, "padded", "20261122-031500", gpu=False)
    older = read_summary(run)
    assert older.data is None and "boxes: synthetic" in run_card(older)  # written before data.boxes
    edit_summary(run, lambda s: s.update(data=WIDER))
    newer = read_summary(run)
    assert newer.data == DataSource(**WIDER) and newer.to_json()["data"] == WIDER | {"clipped": 0}
    assert (
        "boxes: widerface:gt.txt (12,880 images, 1,968 boxes at most; 21 images over the slots lost 3,512 boxes)"
        in (run_card(newer))
    )
    edit_summary(run, lambda s: s["data"].update(boxes=3))
    with pytest.raises(RecordError, match=r"summary.json: data.boxes is int 3, expected a string"):
        read_summary(run)
    edit_summary(run, lambda s: s["data"].update(boxes="widerface:gt.txt", dropped="many"))
    damaged = read_summary(run)  # a count that is none: the source left out, the run read
    assert damaged.data is None and damaged.left_out == [
        f"{run / 'summary.json'}: data.dropped is 'many', expected an integer in [0, 1e15]: data left out"
    ]


def test_compare_shows_each_runs_boxes_and_says_when_they_differ(tmp_path, capsys):
    root = tmp_path / "profile"
    edit_summary(make_run(root, "padded", "20261122-031500"), lambda s: s.update(data=WIDER))
    make_run(root, "packed", "20261122-031600", scale=0.5)  # an older run: synthetic boxes
    comparison = run_compare(root, out_dir=tmp_path / "out")
    out = capsys.readouterr().out
    assert "| run folder |" in out and " | boxes |" in out  # the runs table, split by its columns to fit a window
    assert (
        " | widerface:gt.txt (12,880 images, 1,968 boxes at most; 21 images over the slots lost 3,512 boxes) |" in out
    )
    assert "**Runs over different boxes** (their times are of different work): padded: widerface:gt.txt" in out
    described = {r["strategy"]: r for r in json.loads((tmp_path / "out" / "compare.json").read_text())["runs"]}
    assert described["padded"]["data"] == WIDER | {"clipped": 0} and described["packed"]["data"] is None
    assert "Runs over different boxes" in comparison.texts["train"]

    edit_summary(next((root / "packed").iterdir()), lambda s: s.update(data=WIDER))
    run_compare(root, out_dir=tmp_path / "again")
    assert "Runs over different boxes" not in capsys.readouterr().out
