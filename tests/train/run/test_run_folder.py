"""Run folders (detector/train/run/folder.py): one process to a folder (a lock, removed however the run ends, and
not fooled by a lock file replaced while it is opened), and a re-run that never hides or deletes an earlier run:
it is moved to a visible sibling, and the line says where."""

import json

import pytest
from train_helpers import RUN, run_dir, tiny_cfg

from detector.errors import UserError
from detector.train.run import folder as run_folder
from detector.train.run.entry import run_training
from detector.train.run.training_loop import NonFiniteLoss


def test_a_second_process_on_one_run_folder_is_refused(tmp_path):
    with run_folder.locked(run_dir(tmp_path)):
        with pytest.raises(UserError, match="is in use by pid"):
            run_training(tiny_cfg(tmp_path, *RUN))


def test_the_lock_file_is_removed_when_the_run_ends_however_it_ends(tmp_path, nan_from_step_4):
    lock = run_dir(tmp_path).with_name("padded.lock")
    run_training(tiny_cfg(tmp_path, *RUN))
    assert run_dir(tmp_path).is_dir() and not lock.exists()
    with pytest.raises(NonFiniteLoss):
        run_training(tiny_cfg(tmp_path, *RUN, f"train.strategy={nan_from_step_4}"))
    assert not run_dir(tmp_path, nan_from_step_4).with_name(f"{nan_from_step_4}.lock").exists()


def test_a_lock_file_removed_by_its_holder_while_another_opened_it_is_not_a_lock(tmp_path, monkeypatch):
    """The holder removes its file before it unlocks: a process that had opened the old file and locks it then
    holds nothing, so it opens the new file, which a third process may hold (and then it is refused)."""
    run = run_dir(tmp_path)
    lock_path = run.with_name("padded.lock")
    real_open, opened = open, []

    def open_then_lose_the_race(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        if path == lock_path and not opened:  # the first open: another run ends and a third one starts here
            opened.append(file)
            lock_path.unlink()
            third = real_open(lock_path, "a+")
            run_folder.fcntl.flock(third, run_folder.fcntl.LOCK_EX | run_folder.fcntl.LOCK_NB)
            third.write("pid 4242")
            third.flush()
            opened.append(third)
        return file

    monkeypatch.setattr("builtins.open", open_then_lose_the_race)
    with pytest.raises(UserError, match="is in use by pid 4242"):
        with run_folder.locked(run):
            pass
    assert opened[0].closed
    opened[1].close()


def visible_runs(folder) -> dict[str, int]:
    """Run folder name -> steps of its summary (0 without one); a hidden entry fails the test."""
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    runs_ = {}
    for p in folder.iterdir():
        if p.is_dir():
            summary = p / "summary.json"
            runs_[p.name] = json.loads(summary.read_text())["steps"] if summary.exists() else 0
    return runs_


def test_a_re_run_keeps_every_earlier_run_visible_and_says_where(tmp_path, capsys):
    folder = run_dir(tmp_path).parent
    run_training(tiny_cfg(tmp_path, *RUN))  # 6 steps
    run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))  # a fresh run, stopped (or killed) after step 3
    out = capsys.readouterr().out
    (earlier,) = [name for name in visible_runs(folder) if name != "padded"]
    assert earlier.startswith("padded-") and visible_runs(folder) == {earlier: 6, "padded": 3}
    assert f"{run_dir(tmp_path)} held an earlier run (6 steps, final loss " in out
    assert f"moved to {folder / earlier}/ (nothing is deleted)" in out

    run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))  # a resume continues in place
    assert "held an earlier run" not in capsys.readouterr().out
    assert visible_runs(folder) == {earlier: 6, "padded": 6}
    run_training(tiny_cfg(tmp_path, *RUN))  # and a third run keeps both
    assert sorted(visible_runs(folder).values()) == [6, 6, 6]


def test_a_fresh_run_that_fails_leaves_the_earlier_run_where_it_said(tmp_path, nan_from_step_4, capsys):
    run = [*RUN, f"train.strategy={nan_from_step_4}"]
    run_training(tiny_cfg(tmp_path, *run, "train.nonfinite=skip"))  # 6 steps; the strategy's NaNs from now on
    with pytest.raises(NonFiniteLoss):
        run_training(tiny_cfg(tmp_path, *run))
    folder = run_dir(tmp_path, nan_from_step_4).parent
    (earlier,) = [name for name in visible_runs(folder) if name != nan_from_step_4]
    assert visible_runs(folder)[earlier] == 6 and f"moved to {folder / earlier}/" in capsys.readouterr().out


def test_hidden_runs_of_earlier_versions_are_given_a_visible_name(tmp_path, capsys):
    run_training(tiny_cfg(tmp_path, *RUN))
    folder = run_dir(tmp_path)
    folder.rename(folder.with_name(f".{folder.name}.previous-1795617542820514288"))  # as the old `replacing` left it
    run_training(tiny_cfg(tmp_path, *RUN))
    assert "was hidden in .padded.previous-1795617542820514288/: moved to" in capsys.readouterr().out
    assert sorted(visible_runs(folder.parent).values()) == [6, 6]
