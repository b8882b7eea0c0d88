"""A run resumed from its checkpoint (detector/train/checkpoints/): a damaged checkpoint refused in one line naming
the file; its files' checks begun before the model is built, taken by the resume, or cancelled; a resume that gives
the curve and the summary of an uninterrupted run; and another configuration (or train.resume=false) that moves the
unfinished run aside and says how to continue it. Each on a detector of a few thousand parameters (CPU, milliseconds
a step)."""

import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from train_helpers import RUN, losses, run_dir, tiny_cfg

from detector.train.checkpoints import files as checkpoint_files
from detector.train.checkpoints.state import CheckpointError, read_checkpoint
from detector.train.run import folder as run_folder
from detector.train.run.entry import run_training


def same_losses(resumed: list[float], straight: list[float]) -> None:
    """A resumed run's losses against an uninterrupted run's: the same within float32's rounding. Two fresh CPU runs
    in one process have differed by 1.2e-7 at a step before any resume, under a full suite's load of 12 workers on 16
    cores (the CPU's BLAS may sum in another order); test_training_loop's exact-resume test allows the same."""
    assert len(resumed) == len(straight), (resumed, straight)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- checkpoints that cannot be trusted


def damage(run: Path, how: str) -> Path:
    """Damage the committed checkpoint of ``run`` as ``how`` says; the file damaged."""
    manifest = run / "checkpoint.json"
    folder = run / json.loads(manifest.read_text())["folder"]
    where = {"manifest": manifest, "part": folder / "__0_0.distcp", "meta": folder / "meta.json"}
    path = (where | {"metadata": folder / ".metadata"})[how.split()[0]]
    raw = bytearray(path.read_bytes())
    kind = how.split()[1]
    if kind == "overwritten":
        raw[len(raw) // 2 : len(raw) // 2 + 4096] = b"\xff" * min(4096, len(raw) - len(raw) // 2)
    elif kind == "zeroed":
        raw[len(raw) // 2 : len(raw) // 2 + 4096] = bytes(min(4096, len(raw) - len(raw) // 2))
    elif kind == "truncated":
        raw = raw[: len(raw) // 2]
    elif kind == "garbage":
        raw = bytearray(b"not a checkpoint at all\n" * 100)
    elif kind == "empty":
        raw = bytearray()
    elif kind == "edited":  # a well-formed manifest, one value changed
        raw = bytearray(bytes(raw).replace(b'"step": 3', b'"step": 4'))
    elif kind == "missing":
        path.unlink()
        return path
    path.write_bytes(bytes(raw))
    return path


DAMAGES = [
    f"{where} {kind}"
    for where in ("part", "meta", "metadata")
    for kind in ("overwritten", "zeroed", "truncated", "missing")
]
DAMAGES += ["manifest garbage", "manifest empty", "manifest edited", "manifest truncated"]


@pytest.fixture(scope="module")
def stopped_once(tmp_path_factory):
    """A run of RUN stopped after its checkpoint of step 3, trained once for the module: its out_dir."""
    out = tmp_path_factory.mktemp("stopped")
    run_training(tiny_cfg(out, *RUN, "train.stop_after=3"))
    return out


@pytest.fixture
def stopped(stopped_once, tmp_path):
    """``tmp_path`` holding a copy of that run (resume's checks ignore train.out_dir, a run control), to damage."""
    shutil.copytree(stopped_once, tmp_path, symlinks=True, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The summary of a run of RUN not interrupted, trained once for the module: the losses a resume must match."""
    return run_training(tiny_cfg(tmp_path_factory.mktemp("straight"), *RUN))[0]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(stopped, tmp_path, how):
    path = damage(run_dir(tmp_path), how)
    with pytest.raises(CheckpointError) as err:
        run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))
    message = str(err.value)
    assert str(path) in message and "train.resume=false" in message and "\n" not in message, message


def test_an_intact_checkpoint_reads_back(stopped, tmp_path):
    state = read_checkpoint(run_dir(tmp_path))
    assert state["step"] == 3 and len(state["losses"]) == 3


@pytest.fixture
def verifying(monkeypatch):
    """The threads that check a checkpoint's files, one name a call of checkpoint_files.verify."""
    threads, verify = [], checkpoint_files.verify

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return verify(*args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "verify", recorded)
    return threads


def test_the_checks_begun_before_the_model_is_built_serve_the_resume(tmp_path, verifying, capsys, straight):
    run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))
    assert verifying == []  # a fresh run checks nothing
    cfg = tiny_cfg(tmp_path, *RUN)
    with run_folder.early_check(cfg, None) as checks:
        assert checks is not None and checks.manifest.step == 3
        again = run_training(cfg, None, checks)[0]
    assert verifying == ["checkpoint-verify"], verifying  # once, in the background: the resume took its outcome
    assert again.resumed_at == 3
    same_losses(again.losses, straight.losses)
    assert f"resuming {run_dir(tmp_path)} at step 3" in capsys.readouterr().out


def test_checks_the_command_found_none_to_begin_are_not_begun_again_by_the_run(
    stopped, tmp_path, verifying, monkeypatch
):
    """The command begins the checks (None: it found no checkpoint to continue); the run takes that answer, and
    begins its own only where its caller began none (a run from Python)."""
    begun = []
    monkeypatch.setattr(checkpoint_files.Verification, "start", classmethod(lambda cls, *a: begun.append(a)))
    run_training(tiny_cfg(tmp_path, *RUN), None, None)  # as the command passes what early_check found
    assert begun == [] and verifying == ["MainThread"]  # the resume checked the files itself, once
    run_training(tiny_cfg(tmp_path / "python", *RUN))  # from Python: begun here (none found: a fresh folder)
    assert len(begun) == 1


def test_checks_of_a_checkpoint_replaced_since_they_began_are_not_taken(stopped, tmp_path, verifying):
    checks = checkpoint_files.Verification.start(run_dir(tmp_path), steps=6)
    later = dataclasses.replace(checks.manifest, step=4)  # as if a save of step 4 had committed since
    assert checks.result(later) is False and not checks.thread.is_alive()
    assert checkpoint_files.Verification.start(run_dir(tmp_path), steps=3) is None  # a complete run continues nothing


def test_no_checks_begin_where_the_run_will_not_continue_and_cancelled_ones_stop(stopped_once, tmp_path, verifying):
    with run_folder.early_check(tiny_cfg(tmp_path, *RUN), None) as checks:
        assert checks is None  # no checkpoint
    shutil.copytree(stopped_once, tmp_path, symlinks=True, dirs_exist_ok=True)  # the run stopped after step 3
    with run_folder.early_check(tiny_cfg(tmp_path, *RUN, "train.resume=false"), None) as checks:
        assert checks is None
    (run_dir(tmp_path) / "checkpoint.json").write_text("{")  # unreadable: the resume says so, in its turn
    with run_folder.early_check(tiny_cfg(tmp_path, *RUN), None) as checks:
        assert checks is None


def test_cancelled_checks_stop_at_the_next_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_files, "CHUNK", 4096)  # a checkpoint of many chunks
    run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))
    hashed, release, digest = [], threading.Event(), checkpoint_files.chunk_digest

    def slow(path, start, size):
        hashed.append(start)
        release.wait(10)
        return digest(path, start, size)

    monkeypatch.setattr(checkpoint_files, "chunk_digest", slow)
    checks = checkpoint_files.Verification.start(run_dir(tmp_path), steps=6)
    while not hashed:
        time.sleep(0.01)
    checks.stopped.set()
    release.set()
    checks.cancel()
    chunks = sum(len(entry.chunks) for entry in checks.manifest.files.values())
    assert len(hashed) <= checkpoint_files.HASHERS < chunks, (len(hashed), chunks)
    assert isinstance(checks.error, checkpoint_files.Cancelled)


# ----------------------------------------------------------------------------- resumes


def test_a_resumed_run_logs_the_curve_of_an_uninterrupted_one(tmp_path):
    run = ["train.steps=6", "train.checkpoint_every=1", "train.log_every=2"]
    straight = run_training(tiny_cfg(tmp_path / "straight", *run))[0]
    run_training(tiny_cfg(tmp_path / "split", *run, "train.stop_after=3"))  # stops inside a log window
    resumed = run_training(tiny_cfg(tmp_path / "split", *run, "train.resume=true"))[0]
    assert [s for s, _ in resumed.history] == [2, 4, 6]
    torch.testing.assert_close(losses([resumed.to_json()]), losses([straight.to_json()]), rtol=1e-6, atol=0)


def test_a_run_killed_before_its_summary_is_finished_by_resume(tmp_path):
    complete = run_training(tiny_cfg(tmp_path, *RUN))[0]
    (run_dir(tmp_path) / "summary.json").unlink()  # killed after the final checkpoint, before the summary
    again = run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))[0]
    assert again.final_loss == complete.final_loss and again.history == complete.history
    assert json.loads((run_dir(tmp_path) / "summary.json").read_text())["steps"] == 6


def test_the_same_command_again_continues_an_unfinished_run(stopped, tmp_path, capsys, straight):
    # stopped: as a run killed after its checkpoint of step 3
    again = run_training(tiny_cfg(tmp_path, *RUN))[0]
    assert (
        f"resuming {run_dir(tmp_path)} at step 3 (its checkpoint, this configuration; train.resume=false starts afresh)"
        in capsys.readouterr().out
    )
    assert again.resumed_at == 3
    same_losses(again.losses, straight.losses)


def test_another_configuration_or_resume_false_moves_the_unfinished_run_aside_and_says_how_to_continue_it(
    tmp_path, capsys
):
    for fresh in (["train.lr=0.02"], ["train.resume=false"]):
        run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))
        capsys.readouterr()
        summary = run_training(tiny_cfg(tmp_path, *RUN, *fresh))[0]
        line = next(line for line in capsys.readouterr().out.splitlines() if "held an earlier run" in line)
        assert "It was unfinished: to continue it instead" in line and "its config.yaml" in line, line
        assert summary.resumed_at == 0
