"""Ctrl-C (once or twice), SIGTERM and the launcher's death (detector/train/run/interrupt.py): a stop between two
steps, every later signal ignored, one line with exit status 130 or 143 and a checkpoint that resumes exactly; any
other command's Ctrl-C and SIGTERM are one line too."""

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import fails_after
from fault_helpers import TINY, one_error_line, start_training, wait_for_step

from detector.cli import main as cli
from detector.train.checkpoints.state import read_checkpoint
from detector.train.run.interrupt import LAUNCHER_LOST, CommandSignals, DeferredInterrupt, Terminated


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test after 120 s instead of blocking the suite."""
    with fails_after(120):
        yield


# ----------------------------------------------------------------------------- Ctrl-C and SIGTERM


def test_ctrl_c_is_one_line_exit_130_and_the_run_resumes(tmp_path):
    process = start_training(tmp_path)
    wait_for_step(process, 7)  # past the checkpoint of step 6
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)  # reads both pipes: the steps logged since would fill stdout's
    assert process.returncode == 130
    line = one_error_line(err, "interrupted: ")
    assert "the run stopped after step" in line and "train.resume=true" in line
    (kept,) = [int(s) for s in line.split("its last checkpoint is step ")[1].split()[:1]]
    state = read_checkpoint(tmp_path / "default" / "padded")
    assert state["step"] == kept >= 6 and not list((tmp_path / "default" / "padded").glob("*.tmp-*"))
    resume = ["train.steps=100000", f"train.stop_after={kept + 2}", "train.resume=true"]
    assert cli.main(["train", *TINY, f"train.out_dir={tmp_path}", *resume]) == 0
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == kept + 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_within_the_loop_asks_for_a_stop_between_steps_and_a_second_stops_it_at_once(signum):
    """The first signal only sets a flag (no exception inside whatever the loop is calling), which the loop
    reads at the next step; a second raises where it lands; the handlers before are restored."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    expected = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    with DeferredInterrupt() as interrupt:
        assert interrupt.requested is None  # nothing requested yet
        os.kill(os.getpid(), signum)
        time.sleep(0.01)  # Python runs the handler at the next bytecode: no exception here
        assert interrupt.requested == signum
        with pytest.raises(expected) as err:
            os.kill(os.getpid(), signum)
            time.sleep(1)
        assert type(err.value) is expected
        os.kill(os.getpid(), signum)  # the stop is under way: ignored
        time.sleep(0.01)
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_launchers_death_is_one_stop_however_often_linux_signals_it():
    """kill -9 of detector.cli.launch: Linux sends the rank's parent-death signal (LAUNCHER_LOST) each time the rank's
    parent thread ends, two or three times as the launcher's threads end. In the loop that is one stop asked for, as
    SIGTERM's, never the second signal that abandons the stop's checkpoint; a user's SIGTERM after it still is; and
    it asks nothing where a stop is already asked for. Outside the loop the first raises SIGTERM's stop, once."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, LAUNCHER_LOST)}
    with CommandSignals():
        with DeferredInterrupt() as interrupt:
            for _ in range(3):
                os.kill(os.getpid(), LAUNCHER_LOST)
                time.sleep(0.01)
            assert interrupt.requested == signal.SIGTERM
            with pytest.raises(Terminated):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
    with CommandSignals():
        with DeferredInterrupt() as interrupt:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            os.kill(os.getpid(), LAUNCHER_LOST)
            time.sleep(0.01)
            assert interrupt.requested == signal.SIGINT  # Ctrl-C's stop, not escalated
    with pytest.raises(Terminated):
        with CommandSignals():
            os.kill(os.getpid(), LAUNCHER_LOST)
            time.sleep(1)
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_loop_raises_the_stop_it_was_asked_for_and_ignores_later_signals():
    with DeferredInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert isinstance(interrupt.stop(), Terminated)
        os.kill(os.getpid(), signal.SIGINT)  # during the wind-down: ignored
        time.sleep(0.01)


def test_sigterm_stops_the_run_with_a_checkpoint_in_one_line_exit_143_and_it_resumes_exactly(tmp_path):
    """As a scheduler stops a job: SIGTERM to the process group (the data workers ignore it). The run writes a
    checkpoint of the steps so far and says so in one line; resumed, its losses are an uninterrupted run's."""
    process = start_training(tmp_path / "split")
    wait_for_step(process, 7)
    os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 143
    pattern = (
        r"terminated: the run stopped after step (\d+); its last checkpoint is step (\d+) in (\S+): continue with "
    )
    stopped, kept, path = re.fullmatch(pattern + "train.resume=true", one_error_line(err, "terminated: ")).groups()
    assert int(stopped) == int(kept) >= 7 and read_checkpoint(Path(path).parent)["step"] == int(kept)
    run = [*TINY, "train.steps=100000", f"train.stop_after={int(kept) + 2}"]
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'split'}", "train.resume=true"]) == 0
    assert cli.main(["train", *run, f"train.out_dir={tmp_path / 'straight'}"]) == 0
    resumed = read_checkpoint(tmp_path / "split" / "default" / "padded")["losses"]
    straight = read_checkpoint(tmp_path / "straight" / "default" / "padded")["losses"]
    assert resumed == straight and len(straight) == int(kept) + 2


@pytest.mark.parametrize("apart", [0.05, 0.3])
def test_ctrl_c_twice_prints_the_one_line_and_nothing_after(tmp_path, apart):
    """The second Ctrl-C lands in the checkpoint, the workers' or the writer's closing, or the interpreter's exit
    (atexit): ignored, since the stop is under way; nothing but the one line is printed."""
    process = start_training(tmp_path)
    wait_for_step(process, 3)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(apart)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)
    line = one_error_line(err, "interrupted: ")
    assert process.returncode == 130 and "the run stopped after step" in line
    # the checkpoint the line names is the one the manifest commits (a save the second signal cut short never is)
    kept = re.search(r"its last checkpoint is step (\d+) in (\S+checkpoint.json)", line)
    if kept:
        assert read_checkpoint(Path(kept[2]).parent)["step"] == int(kept[1]), line
    else:
        assert "no checkpoint was written" in line and not list(tmp_path.rglob("checkpoint.json")), line
        assert "train.checkpoint_every" not in line, line  # checkpoints were on: the line says what became of them


def test_sigterm_of_any_command_is_one_line_and_exit_143(monkeypatch, capsys):
    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # the command's own handler turns it into Terminated
        time.sleep(5)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "run", terminated)
    assert cli.main(["strategies"]) == 143
    assert capsys.readouterr().err == "terminated\n" and signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_of_any_command_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    assert cli.main(["strategies"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
