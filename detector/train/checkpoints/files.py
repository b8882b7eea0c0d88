"""A checkpoint on disk: a folder in torch.distributed.checkpoint's format (DCP), checksummed and committed by a
manifest of ours.

    <run>/checkpoint.json              the manifest (``Manifest``, a typed record): the save folder it commits, its step
                                       and the sha256 of every chunk of every file in that folder; replaced atomically,
                                       so it always names a whole checkpoint (a save killed at any moment leaves the
                                       previous one named)
    <run>/checkpoint-<step>-<token>/   one save, a DCP checkpoint (token: the run's, so that a save of the same step by
                                       an earlier, killed attempt is never taken for this one's)
        .metadata                      DCP's: where every tensor's row chunks lie
        __<r>_<n>.distcp               DCP's: process r's rows
        meta.json                      ours: step, schedule, RNG states, losses, evaluations, fingerprint (JSON)

Anyone reads a save with torch alone: ``torch.distributed.checkpoint.load`` (any number of processes), or
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(folder, "state.pt")`` for one file of every tensor
(``model/<name>``, ``optimizer/<name>/<state>``; ``detector export`` gives the model's own state_dict).

What this module adds to DCP's format: a checksum of every byte (``CHUNK``-byte chunks: a process checks the files
it reads, in parallel, before DCP reads them), so that a torn, truncated, overwritten, missing or foreign file is
refused in one line naming it; and nothing in a checkpoint runs code when it is read: meta.json is JSON, and DCP's
.metadata, a pickle, is read only once its checksum holds, by an unpickler that builds DCP's metadata classes and
nothing else.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import stat
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from detector.checked import RecordError, need, read_json, short, versioned, write_atomically
from detector.errors import UserError, said

if TYPE_CHECKING:  # DCP itself is imported where a checkpoint is written or read (checkpoints/dcp_io.py)
    from torch.distributed.checkpoint.metadata import Metadata

FORMAT = "detector-checkpoint-dcp"
VERSION = 3  # 1: one checkpoint.pt; 2: our own part files (detector before its checkpoints moved to DCP)
MANIFEST = "checkpoint.json"
META = "meta.json"
DCP_METADATA = ".metadata"
CHUNK = 64 * 2**20  # bytes per checksum
HASHERS = 4  # threads that checksum chunks (sha256 runs ~1-2 GB/s on one core)
# threads that read a resume's items (each reads, deserialises and copies to the device what one thread did at about
# 0.9 GB/s); more than the cores the machine has would only take turns
READERS = max(1, min(8, os.cpu_count() or 1))
FIX = "delete it or set train.resume=false to start this run afresh"
FOLDER = re.compile(r"checkpoint-(\d{9})-(\w+)")
FILE = re.compile(r"(\.metadata|meta\.json|__\d+_\d+\.distcp)")  # the only files a save folder holds
HEX = re.compile(r"[0-9a-f]{64}")
MANIFEST_BYTES = 64 * 2**20
LEGACY = "checkpoint.pt"  # version 1's one file
EARLIER = (  # versions 1 and 2: our own formats, which no one else read
    "is a checkpoint of detector before its checkpoints moved to torch.distributed.checkpoint: resume it with that "
    "version (git checkout 230b480), or set train.resume=false to start afresh (the run is moved aside, not deleted)"
)


class CheckpointError(UserError):
    pass


def human_bytes(n: int) -> str:
    """Bytes of a checkpoint, as the command lines say them."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- the manifest


@dataclass
class FileEntry:
    bytes: int
    chunks: list[str]  # sha256 of each CHUNK bytes


@dataclass
class Manifest:
    """The committed checkpoint (checkpoint.json)."""

    step: int
    folder: str
    world_size: int  # the processes that wrote it
    files: dict[str, FileEntry]
    format: str = FORMAT
    version: int = VERSION

    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def parse(cls, data, where: str) -> Manifest:
        """The manifest of parsed JSON, every field checked against what a save folder can hold; RecordError naming
        ``where`` and the field otherwise."""
        if isinstance(data, dict) and data.get("version") == 2:
            raise RecordError(f"{where} {EARLIER}")
        versioned(data, where, VERSION)
        if data.get("format") != FORMAT:
            raise RecordError(f"{where}: format {short(data.get('format'))}, not a {FORMAT} manifest")
        folder = need(data.get("folder"), str, f"{where}.folder")
        if not FOLDER.fullmatch(folder):
            raise RecordError(f"{where}.folder is {short(folder)}, expected a save folder checkpoint-<step>-<token>")
        files = {}
        for name, entry in need(data.get("files"), dict, f"{where}.files").items():
            at = f"{where}.files[{short(name)}]"
            if not FILE.fullmatch(name):
                raise RecordError(f"{at}: not a file a save holds (.metadata, meta.json, __<r>_<n>.distcp)")
            size = need(need(entry, dict, at).get("bytes"), int, f"{at}.bytes")
            chunks = [need(c, str, f"{at}.chunks") for c in need(entry.get("chunks"), list, f"{at}.chunks")]
            if size < 0 or len(chunks) != max(1, -(-size // CHUNK)) or not all(HEX.fullmatch(c) for c in chunks):
                raise RecordError(f"{at}: {size} bytes with {len(chunks)} checksums, expected one sha256 a chunk")
            files[name] = FileEntry(size, chunks)
        for needed in (DCP_METADATA, META):
            if needed not in files:
                raise RecordError(f"{where}.files has no {needed}: not a whole save")
        step = need(data.get("step"), int, f"{where}.step")
        if step < 1 or int(FOLDER.fullmatch(folder)[1]) != step:
            raise RecordError(f"{where}.step is {step}, its folder {folder}'s is another")
        return cls(step, folder, need(data.get("world_size"), int, f"{where}.world_size"), files)


def regular_file(path: Path) -> bool:
    """Whether ``path`` is a plain file (not a folder, a FIFO or a dangling link): only such is read."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def read_manifest(run_dir: Path) -> Manifest:
    path = run_dir / MANIFEST
    if not regular_file(path):
        what = "a dangling link" if path.is_symlink() else "not a file"
        raise CheckpointError(f"{path} is {what}: {FIX}")
    try:
        return Manifest.parse(read_json(path, MANIFEST_BYTES), str(path))
    except RecordError as err:
        raise CheckpointError(f"{err}; {FIX}") from None


def exists(run_dir: Path) -> bool:
    """Whether ``run_dir`` names a checkpoint (a manifest, or something in its place: a resume says what is wrong)."""
    path = run_dir / MANIFEST
    return path.exists() or path.is_symlink() or (run_dir / LEGACY).exists()


def manifest_path(run_dir: Path) -> Path:
    """The file that names ``run_dir``'s committed checkpoint: where a run's lines say it can continue from."""
    return run_dir / MANIFEST


def committed_step(run_dir: Path) -> int:
    """The step of ``run_dir``'s committed checkpoint (0: it holds none); CheckpointError where its manifest cannot be
    read."""
    return read_manifest(run_dir).step if exists(run_dir) else 0


def earlier_format(run_dir: Path) -> str | None:
    """Why ``run_dir``'s checkpoint cannot be resumed by this version (one of our formats before DCP), or None."""
    if (run_dir / LEGACY).exists() and not (run_dir / MANIFEST).exists():
        return f"{run_dir / LEGACY} {EARLIER}"
    if not regular_file(run_dir / MANIFEST):  # a FIFO would block the read: the resume says what it is
        return None
    try:
        data = read_json(run_dir / MANIFEST, MANIFEST_BYTES)
    except RecordError:
        return None  # the resume's read of the manifest says what is wrong with it
    return f"{run_dir / MANIFEST} {EARLIER}" if isinstance(data, dict) and data.get("version") == 2 else None


def manifest_digest(run_dir: Path) -> str | None:
    """What identifies the checkpoint ``run_dir`` holds (None: none): the processes of a run compare it."""
    path = run_dir / MANIFEST
    if not regular_file(path):
        return "not a file" if exists(run_dir) else None
    with path.open("rb") as f:
        return hashlib.sha256(f.read(MANIFEST_BYTES)).hexdigest()


# ----------------------------------------------------------------------------- checksums


def file_entry(path: Path, pool: concurrent.futures.Executor) -> FileEntry:
    """``path``'s size and the sha256 of each of its chunks, in ``pool``'s threads."""
    size = path.stat().st_size
    starts = range(0, max(size, 1), CHUNK)
    return FileEntry(size, list(pool.map(lambda start: chunk_digest(path, start, min(CHUNK, size - start)), starts)))


def chunk_digest(path: Path, start: int, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = size
        while left > 0:
            block = f.read(min(left, 8 * 2**20))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


class Cancelled(Exception):
    """The checks were stopped: the run did not continue the checkpoint (``Verification.cancel``)."""


Spans = dict[str, list[tuple[int, int]]]  # a save's file name -> byte ranges of it, (offset, length) each


def verify(folder: Path, manifest: Manifest, stopped: threading.Event | None = None, spans: Spans | None = None) -> int:
    """Every chunk of every file of a committed save against the manifest, in HASHERS threads; one line naming a file
    that is missing, of another size or whose bytes do not match. ``stopped``: once set, the chunks left raise
    Cancelled. ``spans``: only the chunks that hold these byte ranges (each file's size still checked). Returns the
    bytes it read."""

    def check(job) -> tuple[Path, int, bool]:
        path, i, expected, size = job
        if stopped is not None and stopped.is_set():
            raise Cancelled
        return path, i, chunk_digest(path, i * CHUNK, size) == expected

    jobs = []
    for name, entry in manifest.files.items():
        path = folder / name
        if not regular_file(path):
            raise CheckpointError(f"{path} is missing (named by {folder.parent / MANIFEST}): {FIX}")
        size = path.stat().st_size
        if size != entry.bytes:
            raise CheckpointError(f"{path} is truncated or overwritten ({size} of {entry.bytes} bytes): {FIX}")
        chunks = range(len(entry.chunks)) if spans is None else chunks_of(spans.get(name, []))
        jobs += [(path, i, entry.chunks[i], min(CHUNK, size - i * CHUNK)) for i in chunks]
    with concurrent.futures.ThreadPoolExecutor(HASHERS) as pool:
        for path, i, ok in pool.map(check, jobs):
            if not ok:
                raise CheckpointError(f"{path} is corrupt (bytes {i * CHUNK}.. do not match their checksum): {FIX}")
    return sum(job[-1] for job in jobs)


def chunks_of(ranges: list[tuple[int, int]]) -> list[int]:
    """The checksum chunks that hold ``ranges`` ((offset, length) each), in order."""
    found = set()
    for offset, length in ranges:
        found.update(range(offset // CHUNK, (offset + max(length, 1) - 1) // CHUNK + 1))
    return sorted(found)


def tensor_spans(metadata: Metadata, keys) -> Spans:
    """Where the tensors ``keys`` lie in a save's files (DCP's storage data: each chunk of a tensor, one range)."""
    keys, out = set(keys), {}
    for index, where in metadata.storage_data.items():
        if index.fqn in keys:
            out.setdefault(where.relative_path, []).append((where.offset, where.length))
    return out


class Verification:
    """``verify`` of every file of a committed checkpoint, begun in the background by the command that will likely
    continue it (detector/train/run/folder.py, ``early_check``): the files are read while the interpreter imports
    the compiler and the model and optimizer are built, so that the resume waits only for what is left of the
    read, and DCP's load then reads the same bytes from the page cache. The resume takes its outcome where the
    manifest it reads is the one checked (``result``), and checks again otherwise."""

    def __init__(self, run_dir: Path, manifest: Manifest):
        self.manifest, self.folder = manifest, run_dir / manifest.folder
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.check, name="checkpoint-verify", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, run_dir: Path, steps: int) -> Verification | None:
        """The checks of ``run_dir``'s checkpoint, begun; None where there is none a run of ``steps`` steps would
        continue: no manifest, one that cannot be read (the resume says what is wrong with it), a complete run."""
        if not regular_file(run_dir / MANIFEST):
            return None
        try:
            manifest = read_manifest(run_dir)
        except (CheckpointError, OSError):
            return None
        return cls(run_dir, manifest) if manifest.step < steps else None

    def check(self) -> None:
        try:
            verify(self.folder, self.manifest, self.stopped)
        except BaseException as err:  # raised by ``result``, in the resume's thread, as ``verify`` would have there
            self.error = err

    def result(self, manifest: Manifest) -> bool:
        """Whether these checks were of ``manifest``, once they are done (raising what they found); False: of
        another (the checkpoint changed since they began), check it again."""
        if manifest != self.manifest:
            self.cancel()
            return False
        self.thread.join()
        if self.error is not None:
            raise self.error
        return True

    def cancel(self) -> None:
        """Stop the checks (the chunks being hashed finish) and wait for their thread."""
        self.stopped.set()
        self.thread.join()


def root(err: BaseException) -> BaseException:
    """The failure inside DCP's CheckpointException (whose message holds every process's traceback): the first
    process's own exception (an OSError, or one of ours, as it was raised); the OSError behind either (``cause``)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, found = min(failures.items())
        found = found[0] if isinstance(found, tuple) else found
        found = cause(found) if isinstance(found, BaseException) else found
        if isinstance(found, (CheckpointError, OSError)):
            return found
        if isinstance(found, BaseException):
            return RuntimeError(f"process {rank}: {type(found).__name__}: {found}")
    return cause(err)


def one_line(err: BaseException) -> str:
    """``err`` said in one line of at most 300 characters (a checkpoint's own lines name it)."""
    text = said(err)
    return text if len(text) <= 300 else text[:297] + "..."


def cause(err: BaseException) -> BaseException:
    """The OSError that ``err`` was raised in handling, where there is one (torch.save's zip writer, on a full disk:
    RuntimeError ``unexpected pos 704 vs 598``, raised in handling ``[Errno 28] No space left on device``); else
    ``err``."""
    seen, found = set(), err
    while found is not None and id(found) not in seen:
        if isinstance(found, OSError):
            return found
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return err


BACKGROUND_NICE = 10  # a thread's niceness while it writes or checksums a save (0 is the loader's and the step's)


def background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: a thread's own niceness, which threads it starts inherit)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the save runs at the process's priority


# ----------------------------------------------------------------------------- writing


def disk_speed(folder: Path, data) -> float:
    """Bytes per second of a write of ``data`` with fsync into ``folder``, the file then removed: the disk's own
    speed, which a save is held against."""
    probe = folder / f"disk-probe-{os.getpid()}"
    start = time.perf_counter()
    try:
        with open(probe, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
    finally:
        probe.unlink(missing_ok=True)
    return len(data) / max(time.perf_counter() - start, 1e-9)


def commit(run_dir: Path, manifest: Manifest) -> None:
    """Replace the manifest by ``manifest`` (the commit), then remove the older saves' folders."""
    write_atomically(run_dir / MANIFEST, manifest.to_json().encode())
    remove_older(run_dir, run_dir / manifest.folder)


def save_folders(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.glob("checkpoint-*") if p.is_dir() and FOLDER.fullmatch(p.name)]


def remove_older(run_dir: Path, committed: Path) -> None:
    """Remove every save folder but ``committed`` and this run's later saves (under way): earlier saves, and the
    pieces of saves that an earlier, killed attempt never committed."""
    step, token = parse_folder(committed)
    for folder in save_folders(run_dir):
        other_step, other_token = parse_folder(folder)
        if folder != committed and not (other_token == token and other_step > step):
            shutil.rmtree(folder, ignore_errors=True)


def parse_folder(folder: Path) -> tuple[int, str]:
    found = FOLDER.fullmatch(folder.name)
    return int(found[1]), found[2]


def folder_name(step: int, token: str) -> str:
    return f"checkpoint-{step:09d}-{token}"
