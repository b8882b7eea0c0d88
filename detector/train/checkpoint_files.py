"""A checkpoint on disk: a folder of part files, committed by one manifest.

    <run>/checkpoint.json              the manifest: the folder it commits, each file's size and checksums, where
                                       each tensor's rows lie; replaced atomically, so it always names a whole
                                       checkpoint (a save killed at any moment leaves the previous one named)
    <run>/checkpoint-<step>-<token>/   one save (token: the run's, so that a save of the same step by an earlier,
                                       killed attempt is never taken for this one's)
        rank<r>.bin                    process r's share of the state's tensors: raw rows, one span after another
        rank<r>.json                   what rank<r>.bin holds, written once it is on disk (a ``PartRecord``)
        meta.pt                        the rest: step, schedule, RNG states, losses, evaluations, fingerprint

Every file is checksummed in chunks of ``CHUNK`` bytes (sha256 each), so a process that reads part of a file
checks every byte it reads and reads no other: a resume reads the rows each process holds, each byte once. A
torn, truncated, overwritten or foreign checkpoint is refused in one line naming the file.

The manifest is a typed, versioned record (``Manifest``, version 2); the single-file checkpoint.pt of version 1
is still read (``read_legacy``), whole, and replaced by the first save of the resumed run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from detector.errors import UserError

FORMAT = "detector-checkpoint"
VERSION = 2
MANIFEST = "checkpoint.json"
LEGACY = "checkpoint.pt"  # version 1: one file, header + torch.save payload
CHUNK = 64 * 2**20  # bytes per checksum: a partial read over-reads at most one chunk at each end
# each span starts at a multiple of this: any dtype's view of the staging memory is aligned, and each span is whole
# pages, page-locked on its own (checkpointer.py)
ALIGN = 4096
META = "meta.pt"
FIX = "delete it or set train.resume=false to start this run afresh"
HASHERS = 4  # threads that checksum chunks while the writer writes (sha256 runs ~1-2 GB/s on one core)


class CheckpointError(UserError):
    pass


# ----------------------------------------------------------------------------- the records


@dataclass
class Span:
    """Rows ``row .. row + rows - 1`` of a tensor, at byte ``offset`` of ``file``."""

    file: str
    offset: int
    row: int
    rows: int


@dataclass
class TensorEntry:
    shape: list[int]  # the whole tensor's
    dtype: str  # torch's name: "float32"
    spans: list[Span] = field(default_factory=list)


@dataclass
class FileEntry:
    bytes: int
    chunks: list[str]  # sha256 of each CHUNK bytes


@dataclass
class PartRecord:
    """What one process wrote: its file and the spans in it (rank<r>.json)."""

    rank: int
    file: str
    entry: FileEntry
    tensors: dict[str, TensorEntry]
    failed: str = ""  # why the process could not write its part (the commit then fails at once)


@dataclass
class Manifest:
    """The committed checkpoint (checkpoint.json)."""

    step: int
    folder: str
    world_size: int
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    format: str = FORMAT
    version: int = VERSION

    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def to_json(record) -> str:
    body = dataclasses.asdict(record)
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return json.dumps(body, sort_keys=True)


def from_json(text: str, kind: type, path: Path):
    """``kind`` from its JSON, after its own checksum; a garbled or foreign record is one line naming ``path``."""
    try:
        body = json.loads(text)
        digest = body.pop("sha256")
        ok = digest == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is not a detector checkpoint (empty, garbled or foreign): {FIX}")
    if kind is Manifest and (body.get("format"), body.get("version")) != (FORMAT, VERSION):
        raise CheckpointError(f"{path} is a checkpoint of another format {body.get('version')!r}: {FIX}")
    try:
        return build(kind, body)
    except (TypeError, KeyError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable field ({err}): {FIX}") from None


def build(kind: type, body: dict):
    """A dataclass from its ``asdict``, nested records included."""
    nested = {"files": FileEntry, "tensors": TensorEntry}
    values = {}
    for f in dataclasses.fields(kind):
        if f.name not in body:
            continue
        value = body[f.name]
        if f.name in nested and isinstance(value, dict):
            value = {k: build(nested[f.name], v) for k, v in value.items()}
        elif f.name == "spans":
            value = [build(Span, v) for v in value]
        elif f.name == "entry":
            value = build(FileEntry, value)
        values[f.name] = value
    return kind(**values)


# ----------------------------------------------------------------------------- writing


def sync_write(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` on disk, or what it held before (a temporary file, fsync, rename, the folder's fsync)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: np.ndarray, pool: concurrent.futures.Executor) -> FileEntry:
    """Write ``data`` (uint8) to ``path`` and fsync it; its chunks are checksummed by ``pool`` meanwhile (hashlib and
    the file's writes release the GIL: neither waits for the other, nor the training loop for either)."""
    view = memoryview(data)
    spans = [(start, min(start + CHUNK, len(view))) for start in range(0, len(view), CHUNK)]
    digests = [pool.submit(lambda a, b: hashlib.sha256(view[a:b]).hexdigest(), a, b) for a, b in spans]
    with open(path, "wb") as f:
        for a, b in spans:
            f.write(view[a:b])
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(len(view), [d.result() for d in digests])


def disk_speed(folder: Path, data: np.ndarray) -> float:
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


def write_record(folder: Path, record: PartRecord) -> None:
    sync_write(folder / f"rank{record.rank}.json", to_json(record).encode())


def wait_for_parts(folder: Path, world_size: int, timeout: float) -> list[PartRecord]:
    """Every process's record of ``folder`` once all are there; a CheckpointError if one failed or one is missing
    after ``timeout`` seconds (a process that died)."""
    deadline = time.monotonic() + timeout
    while True:
        present = [folder / f"rank{r}.json" for r in range(world_size)]
        if all(p.exists() for p in present):
            records = [from_json(p.read_text(), PartRecord, p) for p in present]
            failed = [f"rank {r.rank}: {r.failed}" for r in records if r.failed]
            if failed:
                raise CheckpointError(f"the save into {folder} failed ({'; '.join(failed)})")
            return records
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(present) if not p.exists()]
            raise CheckpointError(f"rank(s) {missing} wrote no part of {folder} within {timeout:.0f} s")
        time.sleep(0.05)


def commit(run_dir: Path, folder: Path, step: int, records: list[PartRecord], meta: FileEntry) -> Manifest:
    """Write the manifest naming ``folder`` (the commit), then remove the older saves' folders."""
    tensors: dict[str, TensorEntry] = {}
    for record in records:
        for key, entry in record.tensors.items():
            whole = tensors.setdefault(key, TensorEntry(entry.shape, entry.dtype))
            if (whole.shape, whole.dtype) != (entry.shape, entry.dtype):
                raise RuntimeError(f"checkpoint: rank {record.rank}'s {key} is {entry.shape} {entry.dtype}")
            whole.spans += [Span(record.file, s.offset, s.row, s.rows) for s in entry.spans]
    for key, entry in tensors.items():
        entry.spans = covering(key, entry)
    files = {record.file: record.entry for record in records} | {META: meta}
    manifest = Manifest(step, folder.name, len(records), files, tensors)
    sync_write(run_dir / MANIFEST, to_json(manifest).encode())
    remove_older(run_dir, folder)
    (run_dir / LEGACY).unlink(missing_ok=True)  # a version-1 checkpoint, now replaced
    return manifest


def covering(key: str, entry: TensorEntry) -> list[Span]:
    """The spans in row order, a 0-dim value (written by every process that holds it) once; an error unless they
    cover each row exactly once (the ways of sharing give each row one writer)."""
    spans, row = [], 0
    for span in sorted(entry.spans, key=lambda s: s.row):
        if span.row < row and span.rows == 1 and not entry.shape:
            continue
        if span.row != row:
            how = "twice" if span.row < row else "by no one"
            raise RuntimeError(f"checkpoint: {key}'s rows {row}.. are written {how}")
        spans.append(span)
        row += span.rows
    if row != (entry.shape[0] if entry.shape else 1):
        raise RuntimeError(f"checkpoint: {key} has {row} of {entry.shape} rows")
    return spans


def save_folders(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+-\w+", p.name)]


def remove_older(run_dir: Path, committed: Path) -> None:
    """Remove every save folder but ``committed`` and this run's later saves (under way): earlier saves, and the
    pieces of saves that an earlier, killed attempt never committed."""
    step, token = parse_folder(committed)
    for folder in save_folders(run_dir):
        other_step, other_token = parse_folder(folder)
        if folder != committed and not (other_token == token and other_step > step):
            shutil.rmtree(folder, ignore_errors=True)


def parse_folder(folder: Path) -> tuple[int, str]:
    _, step, token = folder.name.split("-", 2)
    return int(step), token


def folder_name(step: int, token: str) -> str:
    return f"checkpoint-{step:09d}-{token}"


# ----------------------------------------------------------------------------- reading


def exists(run_dir: Path) -> bool:
    return (run_dir / MANIFEST).exists() or (run_dir / LEGACY).exists()


def manifest_digest(run_dir: Path) -> str | None:
    """What identifies the checkpoint ``run_dir`` holds (None: none): the processes of a run compare it."""
    for name in (MANIFEST, LEGACY):
        path = run_dir / name
        if path.exists():
            with path.open("rb") as f:
                return hashlib.sha256(f.read(1 << 20)).hexdigest()
    return None


class Reader:
    """The committed checkpoint of a run folder: its manifest, its meta, and any rows of any tensor, each chunk read
    checked against its checksum. Construction checks the manifest and every file's size."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / MANIFEST
        try:
            text = self.path.read_text()
        except UnicodeDecodeError:
            text = ""
        self.manifest: Manifest = from_json(text, Manifest, self.path)
        self.folder = run_dir / self.manifest.folder
        for name, entry in self.manifest.files.items():
            path = self.folder / name
            size = path.stat().st_size if path.exists() else None
            if size is None:
                raise CheckpointError(f"{path} is missing (named by {self.path}): {FIX}")
            if size != entry.bytes:
                raise CheckpointError(f"{path} is truncated or overwritten ({size} of {entry.bytes} bytes): {FIX}")
        self.cached: tuple[str, int, np.ndarray] | None = None  # the last chunk read: spans share chunks
        self.bytes_read = 0

    def meta(self) -> dict:
        data = self.read_bytes(META, 0, self.manifest.files[META].bytes)
        # our own file, holding numpy's and Python's RNG states: not loadable with weights_only=True
        return torch.load(io.BytesIO(data.tobytes()), map_location="cpu", weights_only=False)

    def shape(self, key: str) -> tuple[int, ...] | None:
        entry = self.manifest.tensors.get(key)
        return None if entry is None else tuple(entry.shape)

    def read(self, key: str, row: int, rows: int) -> torch.Tensor:
        """Rows ``row .. row + rows - 1`` of tensor ``key`` (a 0-dim tensor: row 0 of 1), on the CPU."""
        entry = self.manifest.tensors[key]
        dtype = getattr(torch, entry.dtype)
        out = torch.empty([rows, *entry.shape[1:]] if entry.shape else [], dtype=dtype)
        row_bytes = math.prod(entry.shape[1:]) * out.element_size()
        buffer = out.view(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8)
        for span in entry.spans:
            lo, hi = max(row, span.row), min(row + rows, span.row + span.rows)
            if lo < hi:
                start = span.offset + (lo - span.row) * row_bytes
                buffer[(lo - row) * row_bytes : (hi - row) * row_bytes] = self.read_bytes(
                    span.file, start, (hi - lo) * row_bytes
                )
        return out

    def read_bytes(self, name: str, start: int, size: int) -> np.ndarray:
        """Bytes ``start .. start + size - 1`` of file ``name``, from the chunks that hold them, each checked."""
        out = np.empty(size, np.uint8)
        at = start
        while at < start + size:
            index = at // CHUNK
            chunk = self.chunk(name, index)
            a = at - index * CHUNK
            n = min(len(chunk) - a, start + size - at)
            out[at - start : at - start + n] = chunk[a : a + n]
            at += n
        return out

    def chunk(self, name: str, index: int) -> np.ndarray:
        if self.cached and self.cached[:2] == (name, index):
            return self.cached[2]
        entry, path = self.manifest.files[name], self.folder / name
        size = min(CHUNK, entry.bytes - index * CHUNK)
        data = np.empty(size, np.uint8)
        with open(path, "rb") as f:
            f.seek(index * CHUNK)
            got = f.readinto(memoryview(data))
        if got != size or hashlib.sha256(memoryview(data)).hexdigest() != entry.chunks[index]:
            raise CheckpointError(f"{path} is corrupt (bytes {index * CHUNK}.. do not match their checksum): {FIX}")
        self.bytes_read += size
        self.cached = (name, index, data)
        return data


# ----------------------------------------------------------------------------- version 1, read whole

LEGACY_MAGIC = b"detector-checkpoint v1"
LEGACY_HEADER = re.compile(re.escape(LEGACY_MAGIC) + rb" sha256=[0-9a-f]{64} bytes=[0-9]{1,20}")


def read_legacy(path: Path) -> dict:
    """The state of a version-1 checkpoint.pt (one header line, then a torch.save payload), after its checks."""
    with path.open("rb") as f:
        header = f.readline(200).rstrip(b"\n")
        if not LEGACY_HEADER.fullmatch(header):
            raise CheckpointError(f"{path} is not a detector checkpoint (empty, foreign or garbled header): {FIX}")
        fields = dict(item.split(b"=", 1) for item in header[len(LEGACY_MAGIC) :].split())
        payload = f.read()
    if len(payload) != int(fields[b"bytes"]):
        raise CheckpointError(f"{path} is truncated ({len(payload)} of {int(fields[b'bytes'])} bytes): {FIX}")
    if hashlib.sha256(payload).hexdigest().encode() != fields[b"sha256"]:
        raise CheckpointError(f"{path} is corrupt (its checksum does not match its contents): {FIX}")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
