"""Checkpoints in torch.distributed.checkpoint's format with our checks on top (detector/train/checkpoints/): what
torch alone reads of them, and every file or record that does not describe what it holds refused in one line."""

import builtins
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import ROOT, child_env
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from train_helpers import tiny_cfg

from detector.cli import main as cli
from detector.train.checkpoints import dcp_io, files
from detector.train.checkpoints.state import CheckpointError, read_checkpoint
from detector.train.run.entry import run_training

RUN = ["device=cpu", "data.num_workers=0", "train.steps=6", "train.checkpoint_every=3"]


def run_dir(tmp_path) -> Path:
    return tmp_path / "default" / "padded"


@pytest.fixture(scope="module")
def stopped_once(tmp_path_factory) -> Path:
    """The run of ``stopped``, trained once for the module: its out_dir."""
    out = tmp_path_factory.mktemp("stopped")
    run_training(tiny_cfg(out, *RUN, "train.stop_after=3"))
    return out


@pytest.fixture
def stopped(stopped_once, tmp_path) -> Path:
    """A run stopped after its checkpoint of step 3: the folder a resume reads (a copy of the module's run, which
    each test may damage as it likes)."""
    shutil.copytree(stopped_once, tmp_path, symlinks=True, dirs_exist_ok=True)
    return run_dir(tmp_path)


def resume(tmp_path) -> str:
    """The one line a resume of ``tmp_path``'s run is refused with."""
    with pytest.raises(CheckpointError) as refused:
        run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))
    message = str(refused.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def save_folder(run: Path) -> Path:
    return run / json.loads((run / files.MANIFEST).read_text())["folder"]


def resign(run: Path) -> None:
    """Rewrite the manifest's checksums to what the save folder now holds, as a forger would."""
    manifest = json.loads((run / files.MANIFEST).read_text())
    folder = run / manifest["folder"]
    with files.concurrent.futures.ThreadPoolExecutor(2) as pool:
        for name in manifest["files"]:
            entry = files.file_entry(folder / name, pool)
            manifest["files"][name] = {"bytes": entry.bytes, "chunks": entry.chunks}
    (run / files.MANIFEST).write_text(json.dumps(manifest))


# ----------------------------------------------------------------------------- what anyone reads


def test_torch_alone_reads_a_checkpoint_and_its_tensors_are_the_runs(stopped, tmp_path):
    state = read_checkpoint(stopped)
    out = tmp_path / "state.pt"
    dcp_to_torch_save(save_folder(stopped), out)
    plain = torch.load(out, weights_only=True)
    assert set(plain) == set(state["tensors"]) and all(torch.equal(plain[k], v) for k, v in state["tensors"].items())
    assert {"model/head.1.weight", "optimizer/head.1.weight/exp_avg"} <= set(plain) and state["step"] == 3
    meta = json.loads((save_folder(stopped) / files.META).read_text())  # JSON: reading it runs no code
    assert meta["step"] == 3 and len(meta["losses"]) == 3


def test_every_save_gets_its_line(tmp_path, capsys):
    run_training(tiny_cfg(tmp_path, *RUN[:3], "train.checkpoint_every=1", "train.steps=12"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("checkpoint step ")]
    assert [int(line.split()[2].rstrip(":")) for line in lines] == list(range(1, 13))


# ----------------------------------------------------------------------------- refused, each in one line


def test_a_forged_metadata_of_another_dtype_re_signed_is_refused_not_trained_on(stopped, tmp_path):
    path = save_folder(stopped) / files.DCP_METADATA
    metadata = dcp_io.MetadataUnpickler(path.open("rb")).load()
    metadata.state_dict_metadata["model/head.1.weight"].properties.dtype = torch.float64
    path.write_bytes(pickle.dumps(metadata))
    resign(stopped)
    message = resume(tmp_path)
    assert "checkpoint.json holds model/head.1.weight as [32, 512] float64, this model as [32, 512] float32" in message


def test_a_forged_metadata_of_fewer_rows_re_signed_is_refused(stopped, tmp_path):
    path = save_folder(stopped) / files.DCP_METADATA
    metadata = dcp_io.MetadataUnpickler(path.open("rb")).load()
    head = metadata.state_dict_metadata["model/head.1.weight"]
    chunk = head.chunks[0]
    head.chunks[0] = type(chunk)(offsets=chunk.offsets, sizes=torch.Size([chunk.sizes[0] - 1, *chunk.sizes[1:]]))
    path.write_bytes(pickle.dumps(metadata))
    resign(stopped)
    message = resume(tmp_path)
    assert "the chunks of model/head.1.weight hold 15872 of the 16384 values of its rows 0..31" in message, message


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/detector-checkpoint-ran-code",))


def test_a_foreign_metadata_pickle_re_signed_runs_no_code(stopped, tmp_path):
    Path("/tmp/detector-checkpoint-ran-code").unlink(missing_ok=True)
    (save_folder(stopped) / files.DCP_METADATA).write_bytes(pickle.dumps(Payload()))
    resign(stopped)
    assert "is not DCP's metadata (posix.system is not part of DCP's metadata)" in resume(tmp_path)
    assert not Path("/tmp/detector-checkpoint-ran-code").exists()


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda m: m["files"].update({"../../../../etc/passwd": m["files"]["meta.json"]}), "not a file a save holds"),
        (lambda m: m["files"].update({"meta.pt": m["files"]["meta.json"]}), "not a file a save holds"),
        (lambda m: m.update(files=list(m["files"])), "files is list"),
        (lambda m: m["files"]["meta.json"].update(chunks=[]), "checksums, expected one sha256 a chunk"),
        (lambda m: m["files"]["meta.json"].update(bytes=-4096), "checksums, expected one sha256 a chunk"),
        (lambda m: m["files"]["meta.json"].update(bytes=10**12), "checksums, expected one sha256 a chunk"),
        (lambda m: m.update(folder="../elsewhere"), "expected a save folder checkpoint-<step>-<token>"),
        (lambda m: m.update(step=4), "its folder"),
        (lambda m: m.pop("files"), "files is NoneType"),
        (lambda m: m.update(version=9), "version 9"),
    ],
)
def test_a_manifest_that_does_not_describe_a_save_is_refused(stopped, tmp_path, change, expected):
    manifest = json.loads((stopped / files.MANIFEST).read_text())
    change(manifest)
    (stopped / files.MANIFEST).write_text(json.dumps(manifest))
    message = resume(tmp_path)
    assert expected in message and str(stopped / files.MANIFEST) in message and "train.resume=false" in message


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda raw: b"[" * 100_000 + b"]" * 100_000, "nested about {limit} deep or more"),
        (lambda raw: raw.replace(b'"step": 3', b'"step": ' + b"9" * 10_000), "step is float Infinity, expected an"),
        (lambda raw: raw.replace(b'"step"', b'"st\xffep"'), "not JSON (byte 0xff at offset"),
    ],
    ids=["nested-100000-deep", "a-10000-digit-step", "not-utf-8"],
)
def test_a_manifest_or_meta_the_json_parser_refuses_is_one_line(stopped, tmp_path, change, expected):
    """checkpoint.json nested 100,000 deep was a RecursionError traceback; and so was meta.json (re-signed). The depth
    said is the interpreter's recursion limit as the file is read (torch's compiler raises it to 2000)."""
    expected = expected.format(limit=sys.getrecursionlimit())
    path = stopped / files.MANIFEST
    original = path.read_bytes()
    path.write_bytes(change(original))
    message = resume(tmp_path)
    assert expected in message and str(path) in message and "train.resume=false" in message, message
    path.write_bytes(original)
    meta = save_folder(stopped) / files.META
    meta.write_bytes(change(meta.read_bytes()))
    resign(stopped)
    message = resume(tmp_path)
    assert expected in message and "is not a checkpoint's meta.json" in message, message


def test_a_meta_of_a_later_version_is_refused_in_one_line(stopped, tmp_path):
    """meta.json names its version; one this code does not read is refused (re-signed: its checksum holds), not
    resumed as if it were this version's."""
    meta = save_folder(stopped) / files.META
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"version": 2}))
    resign(stopped)
    message = resume(tmp_path)
    assert f"{meta}: version 2, this detector reads version 1" in message and "train.resume=false" in message, message


@pytest.mark.parametrize("what", ["a folder", "a FIFO", "a dangling link"])
def test_a_manifest_that_is_not_a_file_is_refused_and_never_waited_on(stopped, tmp_path, what):
    path = stopped / files.MANIFEST
    path.unlink()
    if what == "a folder":
        path.mkdir()
    elif what == "a FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to(stopped / "nowhere.json")
    message = resume(tmp_path)
    assert str(path) in message and ("dangling link" if what == "a dangling link" else "not a file") in message


@pytest.mark.parametrize("when", ["before a save", "before a resume"])
def test_a_run_folder_made_read_only_is_one_line(tmp_path, monkeypatch, capsys, when):
    """As chmod -w would do to a user without root (root writes anyway, so the folder's refusal is staged), or
    chattr +i: the save's folder, or the run's lock before a resume, cannot be made."""
    from train_helpers import TINY

    args = ["train", *TINY, *RUN, f"train.out_dir={tmp_path}"]
    assert cli.main([*args, "train.stop_after=3"]) == 0
    real = Path.mkdir if when == "before a save" else builtins.open

    def refused(path, *rest, **kwargs):
        if ("checkpoint-" in str(path)) if when == "before a save" else str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *rest, **kwargs)

    monkeypatch.setattr(*((Path, "mkdir") if when == "before a save" else (builtins, "open")), refused)
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Permission denied" in err and "\n" not in err, err
    if when == "before a save":  # the run resumed the checkpoint of step 3: the save's line names it, as a write's
        assert err.startswith("error: the checkpoint of step 6 could not be written ([Errno 13] Permission denied: ")
        assert err.endswith(f"); the last checkpoint is step 3 in {run_dir(tmp_path) / files.MANIFEST}"), err


# ----------------------------------------------------------------------------- chunks, read in parallel


def test_a_save_in_row_chunks_resumes_exactly_read_by_several_threads(tmp_path, monkeypatch):
    """Each tensor lies in chunks of at most CHUNK_BYTES; the resume reads them in READERS threads, each a run of
    them, into the very rows they came from: the losses are an uninterrupted run's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from detector.train.checkpoints import writer as checkpointer

    straight = run_training(tiny_cfg(tmp_path / "straight", *RUN))[0]
    monkeypatch.setattr(checkpointer, "CHUNK_BYTES", 4096)  # the head's weight in rows of a few KiB
    monkeypatch.setattr(files, "READERS", 3)
    run_training(tiny_cfg(tmp_path, *RUN, "train.stop_after=3"))
    metadata = dcp_io.Reader(save_folder(run_dir(tmp_path))).read_metadata()
    chunks = {
        key: [(c.offsets[0], c.sizes[0]) for c in md.chunks]
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and md.size.numel() * md.properties.dtype.itemsize > 4096
    }
    assert "model/head.1.weight" in chunks
    for key, spans in chunks.items():  # several chunks, one after the other, covering every row once
        rows = metadata.state_dict_metadata[key].size[0]
        spans.sort()
        assert len(spans) > 1 and spans[0][0] == 0 and sum(size for _, size in spans) == rows, (key, spans)
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:], strict=False)), (key, spans)
    readers = set()
    resolve = dcp_io.RowsLoadPlanner.resolve_tensor

    def recorded(self, read_item):
        readers.add(threading.current_thread().name)
        return resolve(self, read_item)

    monkeypatch.setattr(dcp_io.RowsLoadPlanner, "resolve_tensor", recorded)
    cut, real_groups = [], dcp_io.read_groups

    def groups(items, storage, parts):
        cut.append(real_groups(items, storage, parts))
        return cut[-1]

    monkeypatch.setattr(dcp_io, "read_groups", groups)
    again = run_training(tiny_cfg(tmp_path, *RUN, "train.resume=true"))[0]
    assert again.resumed_at == 3 and len(again.losses) == len(straight.losses) == 6
    # within float32's rounding, as test_training_loop's exact-resume test: two fresh CPU runs in one loaded
    # worker can differ
    torch.testing.assert_close(torch.tensor(again.losses), torch.tensor(straight.losses), rtol=1e-6, atol=0)
    # the read cut into READERS runs, each handed to a reader thread; a pool may hand a run to a thread whose first run
    # is done before the next starts (a loaded machine), so the threads seen are 1 to 3, never the command's own
    assert [len(g) > 0 for g in cut[-1]] == [True] * 3, cut
    assert 1 <= len(readers) <= 3 and all(name.startswith("checkpoint-read") for name in readers), readers


def test_the_reads_are_cut_into_runs_of_a_file_of_about_equal_bytes():
    from types import SimpleNamespace as Item

    storage = {  # two files, items out of order; one item as large as the rest together
        i: Item(relative_path=path, offset=offset, length=length)
        for i, (path, offset, length) in enumerate(
            [("b", 0, 10), ("a", 30, 10), ("a", 0, 30), ("b", 10, 10), ("a", 40, 60), ("b", 20, 10)]
        )
    }
    items = [Item(storage_index=i) for i in storage]
    groups = dcp_io.read_groups(items, storage, 3)
    where = [[(storage[it.storage_index].relative_path, storage[it.storage_index].offset) for it in g] for g in groups]
    assert where == [[("a", 0), ("a", 30)], [("a", 40)], [("b", 0), ("b", 10), ("b", 20)]]
    assert [len(g) for g in dcp_io.read_groups(items, storage, 1)] == [6]
    assert [len(g) for g in dcp_io.read_groups(items, storage, 9)] == [1] * 6  # never an empty run
    assert dcp_io.read_groups([], storage, 4) == []


def test_a_checkpoint_saved_where_more_gpus_were_visible_restores_those_this_process_sees(monkeypatch):
    """Rank 0 of 2 processes on 2 GPUs saves both devices' generator states; one process on one GPU resumes it: the
    state of the device it has is restored, and the other's is left (it raised IndexError deep in torch)."""
    from detector.train.checkpoints import state as checkpoint

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state.clone())))
    state = checkpoint.rng_state() | {
        "cuda": [checkpoint.encode(torch.full((16,), i, dtype=torch.uint8)) for i in (7, 9)]
    }
    checkpoint.set_rng_state(state)
    assert [(device, int(s[0])) for device, s in restored] == [(0, 7)]


def test_the_first_save_times_the_disk_by_a_write_of_probe_bytes(tmp_path, monkeypatch, capsys):
    """Where no probe ran before the first save (any cadence but the automatic one), that save measures the disk with
    PROBE bytes of its largest staged chunk: its first chunk may be a few bytes (a bias), whose write with fsync times
    the disk's latency, and a 12 GiB save was then said to need days (the disk alone at 0.00 GB/s)."""
    from detector.train.checkpoints import writer as checkpointer

    writes = []
    measure = files.disk_speed

    def spy(folder, data):
        writes.append(len(data))
        return measure(folder, data)

    monkeypatch.setattr(files, "disk_speed", spy)
    monkeypatch.setattr(checkpointer, "PROBE", 16384)  # more than the first chunk, less than the largest
    run_training(tiny_cfg(tmp_path, *RUN))
    assert writes == [16384]  # once, PROBE bytes
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("checkpoint step")]
    assert len(lines) == 2 and all(" GB/s)" in line for line in lines), lines


def test_code_outside_the_package_goes_through_its_door():
    """Outside detector/train/checkpoints/, code imports the package's face (a run folder's checkpoint, outside a run)
    and manager.py (a run's checkpoints; what reads a checkpoint's state) and none of its other modules: those are
    the door's own, free to change behind it."""
    import ast

    import detector

    root = Path(detector.__file__).parent
    package = root / "train" / "checkpoints"
    behind = {f"detector.train.checkpoints.{p.stem}" for p in package.glob("*.py")} - {
        "detector.train.checkpoints.__init__",
        "detector.train.checkpoints.manager",
    }
    reached = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(package):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            reached += [f"{path.relative_to(root)}: {name}" for name in names if name in behind]
    assert len(behind) == 5 and not reached, reached  # cadence, dcp_io, files, state, writer


def test_a_run_imports_dcp_only_where_a_checkpoint_is_written_or_read(tmp_path):
    """DCP (with DTensor and sympy: a fraction of a second) is imported by the first save's thread, a resume or an
    export, never with the run's code: a fresh run starts its steps without it. The first save then imports it."""
    code = (
        "import sys\n"
        "import detector.cli.main, detector.train.run.entry, detector.train.run.training_loop\n"
        "import detector.train.evaluate.export\n"
        "print('before', 'torch.distributed.checkpoint' in sys.modules)\n"
        "from detector.config.schema import load_config\n"
        f"cfg = load_config({list(RUN)!r} + ['train.out_dir=' + sys.argv[1], 'train.steps=2'], announce=None)\n"
        "detector.train.run.entry.run_training(cfg)\n"
        "print('after', 'torch.distributed.checkpoint' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(("before", "after"))]
    assert done.returncode == 0 and lines == ["before False", "after True"], (done.stdout, done.stderr[-2000:])
