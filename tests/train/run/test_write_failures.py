"""A run's writes that fail (a full disk, a folder it may not write in): a checkpoint's save stopped anywhere in it or
failing in DCP's own writer thread, and TensorBoard's event writer failing in its thread, each end `train` in one
line naming the checkpoint kept, which resumes, never a traceback; a thread's failure no line said is one warning as
the command ends."""

import re
import shutil
import threading
import traceback

import pytest
from conftest import fails_after
from fault_helpers import TINY, one_error_line
from tensorboard.compat.tensorflow_stub.io import gfile
from torch.distributed.checkpoint import filesystem

from detector.cli import main as cli
from detector.train.checkpoints import dcp_io
from detector.train.checkpoints import files as checkpoint_files
from detector.train.checkpoints.state import CheckpointError, read_checkpoint


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test after 120 s instead of blocking the suite."""
    with fails_after(120):
        yield


# ----------------------------------------------------------------------------- a save that fails


@pytest.fixture(scope="module")
def stopped_once(tmp_path_factory):
    """`train` of TINY's 6 steps stopped after step 3 (its checkpoint), trained once for the module: its out_dir."""
    out = tmp_path_factory.mktemp("stopped")
    assert cli.main(["train", *TINY, "train.steps=6", f"train.out_dir={out}", "train.stop_after=3"]) == 0
    return out


@pytest.fixture
def stopped(stopped_once, tmp_path):
    """``tmp_path`` holding a copy of that run (resume's checks ignore train.out_dir, a run control)."""
    shutil.copytree(stopped_once, tmp_path, symlinks=True, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("where", ["the data", "the checksums", "the manifest"])
def test_a_save_stopped_anywhere_keeps_the_previous_checkpoint(stopped, tmp_path, monkeypatch, where, capsys):
    """The writer of step 6's save fails (a full disk, a kill) while DCP writes its files, while they are checksummed
    or while the manifest is replaced: the manifest still names step 3's checkpoint, which resumes; the run says what
    failed, in one line."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3
    owner, name = {
        "the data": (dcp_io.Writer, "write_data"),
        "the checksums": (checkpoint_files, "file_entry"),
        "the manifest": (checkpoint_files, "commit"),
    }[where]

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(owner, name, failing)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "No space left on device" in line and "the last checkpoint is step 3" in line, line
    monkeypatch.undo()
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == 3
    summary = cli.main(["train", *run, "train.resume=true", "train.stop_after=4"])
    assert summary == 0 and read_checkpoint(tmp_path / "default" / "padded")["step"] == 4


# ----------------------------------------------------------------------------- a thread's failure


def test_a_full_disk_in_a_writer_thread_of_dcps_is_the_saves_line_and_no_traceback(
    stopped, tmp_path, monkeypatch, capsys
):
    """DCP writes a save's second file in a thread of its own, whose exception Python's hook printed as a traceback
    (`Exception in thread Thread-3 (_write_files_from_queue)`) while DCP carried on without its items. The save fails
    in the run's one line, naming its step and the checkpoint kept; --debug prints the thread's traceback too."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3
    write = filesystem._write_files_from_queue

    def _write_files_from_queue(*args, **kwargs):  # the name Python gives DCP's thread, after its target
        if threading.current_thread().name != "checkpoint-writer":  # DCP's own thread, not the save's
            args[1].get_nowait()  # a file of the save taken from the queue, then the disk is full
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_files_from_queue", _write_files_from_queue)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: the checkpoint of step 6 could not be written ([Errno 28] No space left on device); the last "
        f"checkpoint is step 3 in {tmp_path / 'default' / 'padded' / 'checkpoint.json'}"
    )
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == 3  # never committed without its items
    hook = threading.excepthook
    with pytest.raises(CheckpointError) as debug:
        cli.main(["train", "--debug", *run, "train.resume=true"])
    assert "in _write_files_from_queue" in "".join(traceback.format_exception(debug.value.__cause__))
    assert threading.excepthook is hook  # restored after a command called in a process


def fail_tensorboard(monkeypatch, after: int, err: OSError) -> None:
    """TensorBoard's event writer fails with ``err`` in its thread (as on a full disk) from its ``after``-th write."""
    writes = []

    def failing(self, filename, content, mode):
        writes.append(filename)
        if len(writes) > after:
            raise err
        return write(self, filename, content, mode)

    write = gfile.LocalFileSystem._write
    monkeypatch.setattr(gfile.LocalFileSystem, "_write", failing)


def test_tensorboards_writer_failing_in_its_thread_stops_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """A full disk under TensorBoard's event writer: its thread printed a traceback, then the loop's next write raised
    its exception again, which was the run's whole line: `error: [Errno 28] No space left on device`."""
    run = [*TINY, "train.steps=12", f"train.out_dir={tmp_path}"]
    fail_tensorboard(monkeypatch, 40, OSError(28, "No space left on device"))
    assert cli.main(["train", *run]) == 2
    err = capsys.readouterr().err
    pattern = (
        rf"error: TensorBoard's event file in {tmp_path / 'default' / 'padded'} could not be written \(\[Errno 28\] No "
        r"space left on device\); the run stopped after step (\d+); its last checkpoint is step (\d+) in \S+"
        r"checkpoint.json: continue with train.resume=true"
    )
    stopped, kept = map(int, re.fullmatch(pattern, one_error_line(err)).groups())
    assert 3 <= kept <= stopped and kept % 3 == 0  # the line names the checkpoint the manifest does
    assert read_checkpoint(tmp_path / "default" / "padded")["step"] == kept


def test_a_run_folder_tensorboard_may_not_write_in_is_a_path_not_bytes(stopped, tmp_path, monkeypatch, capsys):
    """A resume into a folder made immutable (chattr +i): TensorBoard's writer, which names its file in bytes, failed
    in its thread with a traceback, and the line was `[Errno 1] Operation not permitted: b'.../events.out...'`."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3
    folder = tmp_path / "default" / "padded"

    def refused(self, filename, content, mode):
        raise PermissionError(1, "Operation not permitted", filename)  # bytes, as TensorBoard's GFile gives it

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", refused)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert re.fullmatch(
        rf"error: \[Errno 1\] Operation not permitted: '{folder}/events\.out\.tfevents\.\S+'; the run stopped after "
        rf"step 3; its last checkpoint is step 3 in {folder / 'checkpoint.json'}: continue with train.resume=true",
        line,
    ), line


def test_tensorboards_writer_failing_as_a_save_fails_leaves_the_saves_line(stopped, tmp_path, monkeypatch, capsys):
    """A full disk fails the save, then TensorBoard's writer as the run closes it: its exception replaced the save's
    line with `error: [Errno 28] No space left on device`."""
    run = [*TINY, "train.steps=6", f"train.out_dir={tmp_path}"]  # stopped: its run, stopped after step 3

    def full(*args, **kwargs):
        fail_tensorboard(monkeypatch, 0, OSError(28, "No space left on device"))  # from now on
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_io.Writer, "write_data", full)
    capsys.readouterr()
    assert cli.main(["train", *run, "train.resume=true"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: the checkpoint of step 6 could not be written ([Errno 28] No space left on device)")
    assert "the last checkpoint is step 3" in line


def test_a_threads_failure_nothing_said_is_one_warning_line_as_the_command_ends(monkeypatch, capsys):
    """Where no line of the command says it (the command ended well), and never a traceback."""

    def raises_in_a_thread(*args):
        thread = threading.Thread(target=lambda: 1 / 0, name="eval-picture")
        thread.start()
        thread.join()
        return 0

    monkeypatch.setattr(cli, "run", raises_in_a_thread)
    assert cli.main(["strategies"]) == 0
    assert capsys.readouterr().err == (
        "warning: thread eval-picture ended with ZeroDivisionError: division by zero (its traceback: --debug)\n"
    )
