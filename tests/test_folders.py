"""New output folders (detector/lab/folders.py ``new_run_dir``), the one way every command makes one: made
atomically, so that commands started in the same second each get their own, under a race too."""

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from detector.checked import RecordError
from detector.lab import folders


def test_commands_in_the_same_second_each_get_their_own_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(folders.time, "strftime", lambda _: "20260101-120000")  # one second for all of them
    start = threading.Barrier(16)

    def make(_):
        start.wait()  # all at once: a check before the creation would hand two of them the same name
        return folders.new_run_dir(tmp_path / "compare")

    with ThreadPoolExecutor(16) as pool:
        made = list(pool.map(make, range(16)))
    assert len(set(made)) == 16 and all(p.is_dir() for p in made)
    assert sorted(p.name for p in made) == sorted(["20260101-120000", *(f"20260101-120000-{i}" for i in range(2, 17))])


def test_a_finished_work_folder_moves_into_a_new_one_and_never_onto_another_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(folders.time, "strftime", lambda _: "20260101-120000")
    (tmp_path / "20260101-120000").mkdir()
    (tmp_path / "20260101-120000" / "report.md").write_text("another run's")
    work = tmp_path / "current"
    work.mkdir()
    (work / "report.md").write_text("this run's")
    final = folders.new_run_dir(tmp_path)
    os.replace(work, final)  # as make report and bench memory finish
    assert final.name == "20260101-120000-2" and (final / "report.md").read_text() == "this run's"
    assert (tmp_path / "20260101-120000" / "report.md").read_text() == "another run's"


def test_a_resumable_work_folder_is_resumed_with_the_same_overrides_only(tmp_path, capsys):
    work = folders.prepare_work(tmp_path, ["a=1"])
    (work / "part").write_text("done")
    assert folders.prepare_work(tmp_path, ["a=1"]) == work and (work / "part").exists()
    fresh = folders.prepare_work(tmp_path, ["a=2"])
    assert fresh == work and not (work / "part").exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("unfinished-")]
    assert len(aside) == 1 and (aside[0] / "part").read_text() == "done"


def test_a_work_folders_state_is_one_record_written_and_read_again(tmp_path):
    work = folders.prepare_work(tmp_path, ["a=1", "b=x y"])
    state = folders.WorkState.read(work / folders.STATE)
    assert state.overrides == ["a=1", "b=x y"] and state.version == folders.STATE_VERSION
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # written atomically: no temporary left
    # version 1, written before the record had a version: read as it is
    (work / folders.STATE).write_text(json.dumps({"overrides": ["a=1"], "started": "2026-01-01T00:00:00+00:00"}))
    assert folders.WorkState.read(work / folders.STATE).overrides == ["a=1"]


def test_a_damaged_work_state_is_one_line_naming_the_file_and_field_and_the_folder_kept_aside(tmp_path, capsys):
    work = folders.prepare_work(tmp_path, ["a=1"])
    (work / "part").write_text("done")
    state = work / folders.STATE
    state.write_text(json.dumps({"overrides": ["a=1", 2], "started": "2026-01-01T00:00:00+00:00", "version": 2}))
    with pytest.raises(RecordError) as err:
        folders.WorkState.read(state)
    assert str(err.value) == f"{state}.overrides[1] is int 2, expected a string"
    assert folders.prepare_work(tmp_path, ["a=1"]) == work and not (work / "part").exists()
    out = capsys.readouterr().out
    assert f"an unfinished report ({state}.overrides[1] is int 2, expected a string) is kept in " in out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("unfinished-")]
    assert len(aside) == 1 and (aside[0] / "part").read_text() == "done"
