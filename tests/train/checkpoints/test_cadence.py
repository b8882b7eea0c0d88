"""train.checkpoint_every=auto (detector/train/checkpoints/cadence.py): a save is never due before the one before it is
written."""

import re

import pytest
from train_helpers import tiny_cfg

from detector.train.checkpoints import cadence
from detector.train.checkpoints.cadence import Cadence, interval_steps
from detector.train.run.entry import run_training


def test_the_interval_is_a_minute_of_steps_or_four_writes_whichever_is_longer():
    assert interval_steps(0.030, 1.0) == 2000  # 60 s of 30-ms steps: the disk is fast
    assert interval_steps(0.019, 14.0) == 3158  # 14 s x 4 = 56 s < 60 s
    assert interval_steps(0.019, 30.0) == 6316  # a slow disk: 4 x 30 s = 120 s of steps
    assert interval_steps(10.0, 0.0) == 6  # long steps: still a minute


def test_steps_that_save():
    fixed = Cadence(3, steps=10)
    assert [s for s in range(1, 11) if fixed.due(s)] == [3, 6, 9]
    auto = Cadence(-1, steps=10)
    assert auto.undecided and not any(auto.due(s) for s in range(1, 11))  # nothing is due before it is decided
    auto.decide(step_seconds=15.0, write_seconds=1.0)  # 60 s: every 4 steps
    assert [s for s in range(1, 11) if auto.due(s)] == [4]  # not 8: the final save follows 2 steps later
    assert not any(Cadence(0, steps=10).due(s) for s in range(1, 11))


def test_an_auto_run_says_its_cadence_and_saves_at_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cadence, "MIN_SECONDS", 0.05)  # a few of the tiny model's steps
    run = ["train.steps=40", "train.log_every=5", "data.num_workers=0", "device=cpu"]
    summary = run_training(tiny_cfg(tmp_path, *run))[0]
    out = capsys.readouterr().out
    assert "checkpoints: every minute of steps or more, as the disk allows (set after the first steps)" in out
    found = re.search(r"checkpoints: every (\d+) steps \(train.checkpoint_every=auto: about [\d.]+ s of", out)
    assert found, out
    every = int(found[1])
    saved = [s.step for s in summary.checkpoints.saves]
    assert saved[-1] == 40 and all(s % every == 0 and 40 - s >= every for s in saved[:-1]), (every, saved)
    assert saved[0] > 5  # decided at the first log line past the first steps


@pytest.mark.parametrize("every", ["-2", "auto"])
def test_a_cadence_that_is_not_one_is_refused(tmp_path, every):
    from detector.errors import ConfigError

    with pytest.raises(ConfigError, match="train.checkpoint_every"):
        tiny_cfg(tmp_path, f"train.checkpoint_every={every}")
