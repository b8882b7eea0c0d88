"""Honest throughput (detector/train/observe/progress.py, wallclock.py): the wall clock with the device's time and
idle time beside it (none on the CPU), the idle time between steps, where the run's wall clock went (its parts,
goodput and start-up in summary.json and TensorBoard), and an ETA that neither the first step nor an evaluation
stretches."""

import re
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_helpers import run_dir, tiny_cfg

from detector import data
from detector.train.observe.progress import StepClock
from detector.train.observe.summary import read
from detector.train.run.entry import run_training


def test_throughput_is_wall_clock_with_the_device_time_beside_it(tmp_path, monkeypatch):
    draw = data.FaceSampler.draw_batch  # what the loader calls

    def slow(self, indices, out):
        time.sleep(0.01 * len(indices))  # a data pipeline that cannot keep up
        return draw(self, indices, out)

    monkeypatch.setattr(data.FaceSampler, "draw_batch", slow)
    summary = run_training(tiny_cfg(tmp_path, "train.steps=8", "train.checkpoint_every=0", "data.num_workers=0"))[0]
    assert summary.data_wait_ms > 30  # 4 images x 10 ms
    assert summary.step_ms >= summary.device_step_ms + summary.data_wait_ms * 0.9
    assert summary.images_per_s < summary.device_images_per_s
    # on the CPU nothing runs ahead: the whole wait is idle time between steps
    assert summary.device_idle_ms >= summary.data_wait_ms * 0.9


def test_a_cpu_run_logs_no_device_or_idle_figures(tmp_path, capsys):
    """On the CPU the host is the device: its time is the wall clock's, and nothing sits idle waiting for it."""
    run_training(tiny_cfg(tmp_path, "device=cpu", "train.steps=4", "train.log_every=2", "train.checkpoint_every=0"))
    out = capsys.readouterr().out.replace(str(tmp_path), "<tmp>")  # whose name holds the test's, "...device..."
    lines = [line for line in out.splitlines() if line.startswith(("step ", "done: "))]
    assert len(lines) == 3 and not [line for line in lines if "device" in line or "idle" in line], lines
    assert re.fullmatch(
        r"step +2/4  loss \d\.\d{4}  lr \S+  step +\d+\.\d ms \(data wait \d+\.\d\) .* eta \S+", lines[0]
    )
    assert re.fullmatch(
        r"done: \S+  final loss \d\.\d{4}  median step \d+\.\d ms  \d+ img/s by the wall clock", lines[2]
    )


def test_the_step_clock_reports_the_idle_time_between_steps():
    clock = StepClock(torch.device("cpu"))
    for pause in (0.0, 0.03, 0.0):
        time.sleep(pause)
        clock.start()
        clock.stop()
    (_, first), (_, after_pause), (_, back_to_back) = clock.read()
    assert first == 0.0  # nothing before the first step
    assert after_pause >= 30 > back_to_back
    clock.start()
    clock.stop()
    assert clock.read()[0][1] < 30  # measured from the last step of the previous read
    time.sleep(0.05)
    clock.set_aside(0.05)  # an evaluation's time, timed on its own
    clock.start()
    clock.stop()
    assert 0.0 <= clock.read()[0][1] < 30  # the idle time before that step less it, never below zero


def test_the_summary_says_where_the_wall_clock_went(tmp_path):
    summary = run_training(tiny_cfg(tmp_path, "train.steps=6", "train.checkpoint_every=3", "data.num_workers=0"))[0]
    wall = summary.wall_clock
    assert set(wall.seconds) == {"start-up", "first step", "steps", "data", "evaluations", "checkpoints", "end"}
    assert wall.data_stalls[1] == 6 and 0 <= wall.data_stalls[0] <= 6  # every step's wait for its batch counted
    assert wall.total_s == pytest.approx(sum(wall.seconds.values()))
    assert wall.seconds["start-up"] > 0 and wall.seconds["first step"] > 0 and wall.seconds["steps"] > 0
    assert 0 < wall.goodput < 1 and wall.goodput == pytest.approx(wall.seconds["steps"] / wall.total_s)
    assert wall.images_per_s_lived == pytest.approx(6 * 4 / wall.total_s)
    assert [s.step for s in summary.checkpoints.saves] == [3, 6]
    assert read(run_dir(tmp_path)) == summary  # summary.json is the record, read back the same
    # the start-up's parts: from the process's start to the run, then each part the run timed, and the rest
    parts = wall.startup
    assert list(parts)[0] == "interpreter and imports" and parts["interpreter and imports"] > 0
    assert {"model and optimizer", "loader", "held-out set", "checkpoint staging", "other"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(wall.seconds["start-up"])
    scalars = EventAccumulator(str(run_dir(tmp_path))).Reload().Tags()["scalars"]
    assert {"goodput/share", "goodput/start_up_s", "checkpoint/blocked_s", "checkpoint/written_s"} <= set(scalars)


def test_the_eta_and_the_first_log_lines_step_come_from_the_steps_after_the_first(tmp_path, monkeypatch, capsys):
    """A first step of 2 s (a cold compile) must not make the ETA of 30 steps of milliseconds read 10 s, nor the
    first log line's step time read its share of the window (400 ms): the first step is timed apart."""
    from detector.train.run.step import TrainStep

    real, calls = TrainStep.__call__, []

    def first_slow(self, batch):
        if not calls:
            time.sleep(2.0)
        calls.append(1)
        return real(self, batch)

    monkeypatch.setattr(TrainStep, "__call__", first_slow)
    run = ["device=cpu", "train.steps=30", "train.log_every=5", "train.checkpoint_every=0", "data.num_workers=0"]
    run_training(tiny_cfg(tmp_path, *run))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step      5/30"))
    minutes, seconds = re.search(r"eta (\d+)m(\d+)s", line).groups()
    assert int(minutes) * 60 + int(seconds) < 3, line  # 25 steps of a few ms, not 25 x (2 s / 5)
    assert float(re.search(r"step +([\d.]+) ms", line).group(1)) < 300, line  # the steps 2-5, not 2 s / 5


def test_the_eta_is_not_stretched_by_an_evaluation(tmp_path, monkeypatch, capsys):
    """An evaluation of 2 s at step 10 lies inside the next log window: the ETA of the steps after it is theirs. (The
    evaluations after it, at 20, 30 and 40, come after the line read: they take their own time.)"""
    from detector.train.evaluate.evaluation import Evaluation

    real = Evaluation.__call__

    def slow(self, step, *args, **kwargs):
        if step == 10:
            time.sleep(2.0)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(Evaluation, "__call__", slow)
    run = ["device=cpu", "train.steps=40", "train.log_every=5", "train.eval_every=10", "data.num_workers=0"]
    run_training(tiny_cfg(tmp_path, *run, "train.checkpoint_every=0"))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step     15/40"))
    minutes, seconds = re.search(r"eta (\d+)m(\d+)s", line).groups()
    assert int(minutes) * 60 + int(seconds) < 5, line  # 25 steps of ms, not 25 x (2 s / 5); evals at 20-40 not in it
