"""A non-finite loss (detector/train/run/training_loop.py): it stops the run naming the step and keeps the last good
checkpoint, or with train.nonfinite=skip its updates are skipped and the run finishes; the strategy whose loss turns
NaN is tests/conftest.py's ``nan_from_step_4``."""

import pytest
import torch
from train_helpers import RUN, run_dir, tiny_cfg

from detector.train.checkpoints.state import read_checkpoint
from detector.train.run.entry import run_training
from detector.train.run.training_loop import NonFiniteLoss


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_good_checkpoint(tmp_path, nan_from_step_4):
    cfg = tiny_cfg(tmp_path, *RUN, f"train.strategy={nan_from_step_4}")
    with pytest.raises(NonFiniteLoss, match="not finite at step 4.*last good checkpoint is step 3"):
        run_training(cfg)
    state = read_checkpoint(run_dir(tmp_path, nan_from_step_4))
    assert state["step"] == 3 and all(torch.isfinite(p).all() for p in state["model"].values())


def test_nonfinite_skip_skips_those_updates_and_finishes(tmp_path, nan_from_step_4, capsys):
    cfg = tiny_cfg(tmp_path, *RUN, f"train.strategy={nan_from_step_4}", "train.nonfinite=skip")
    summary = run_training(cfg)[0]
    assert summary.steps == 6 and "skipped the update of step(s) [4]" in capsys.readouterr().out
    state = read_checkpoint(run_dir(tmp_path, nan_from_step_4))
    assert all(torch.isfinite(p).all() for p in state["model"].values())
