"""Checkpoints off the step's path: the step waits only while its state is copied to host memory; a thread writes it.

A save, on every process at once:

1. (the step waits) this process's share of the state (``checkpoint.state_pieces``, ``written_rows``) is copied into
   its staging memory: host memory of exactly that share, page-locked on a GPU (``cudaHostRegister``, once per run,
   in a thread while the first steps run, its pages touched first) so that the device-to-host copy runs at the
   link's speed;
2. (a thread) the share is written to ``rank<r>.bin`` of the save's folder and checksummed in chunks meanwhile
   (``HASHERS`` threads), fsync'd, and described in ``rank<r>.json``; process 0 writes the rest (``meta.pt``), waits
   for every process's record and commits the save by replacing the manifest (checkpoint_files.py).

A new save first waits for the previous one. Host memory for a save is the process's share of the state and no more
(the writer and the checksums read the staging memory in place). Process 0 measures the disk once (a write of up to
``PROBE`` bytes with fsync) and logs each save against it when the save is committed::

    checkpoint step 20: 12.2 GiB from 2 processes, step blocked 0.41 s, written in 14.2 s (the disk alone: 12.9 s
    at 1.01 GB/s)

Where the process has no GPU the staging memory is plain host memory, and the copy the step waits for a memcpy.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from detector.train import checkpoint_files as files
from detector.train.checkpoint import Piece, written_rows
from detector.train.checkpoint_files import CheckpointError, TensorEntry

PROBE = 256 * 2**20  # bytes of the disk's speed test (with fsync): enough to pass any write cache of the page cache
COMMIT_TIMEOUT = 600.0  # seconds process 0 waits for the other processes' parts before it gives the save up


def share_bytes(pieces: list[Piece], rank: int, world_size: int) -> int:
    """The staging memory for this process's share of ``pieces``: their rows, each span aligned."""
    return sum(span_bytes(piece, rows) for piece, rows in writes(pieces, rank, world_size))


def writes(pieces: list[Piece], rank: int, world_size: int) -> list[tuple[Piece, tuple[int, int]]]:
    return [(p, rows) for p in pieces if (rows := written_rows(p, rank, world_size)) is not None]


def span_bytes(piece: Piece, rows: tuple[int, int]) -> int:
    start, stop = rows
    row_bytes = (
        piece.tensor[0].numel() * piece.tensor.element_size() if piece.tensor.dim() else piece.tensor.element_size()
    )
    return -(-(stop - start) * row_bytes // files.ALIGN) * files.ALIGN


@dataclass
class Save:
    """One save under way or done: its timings (seconds) and size."""

    step: int
    folder: Path
    started: float  # perf_counter at the save's call
    blocked: float = 0.0  # the step's wait: for the previous save to finish, then the copy to host memory
    waited: float = 0.0  # of which for the previous save
    bytes: int = 0  # this process's share
    written: float | None = None  # from the call until committed (process 0) or this process's part is on disk
    total_bytes: int = 0  # every process's (process 0, once committed)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Checkpointer:
    """A run's saves (see the module docstring): ``save`` from the loop, ``poll`` between steps for the lines of
    saves committed since, ``wait`` for the one under way, ``close`` at the end."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, device: torch.device, token: str):
        self.run_dir, self.rank, self.world_size, self.device, self.token = run_dir, rank, world_size, device, token
        self.pool = concurrent.futures.ThreadPoolExecutor(
            files.HASHERS, thread_name_prefix="checksum", initializer=background_priority
        )
        self.staging: torch.Tensor | None = None
        self.registered: list[int] = []  # the page-locked spans' addresses (cudaHostRegister), one per span
        self.pinned = False  # whether every span was page-locked
        self.pinning: threading.Thread | None = None
        self.probing: threading.Thread | None = None
        self.pin_seconds = 0.0
        self.disk_speed: float | None = None  # bytes/s, process 0's measure
        self.current: Save | None = None
        self.saves: list[Save] = []
        self.committed_step = -1  # process 0: the step of the checkpoint the manifest names
        self.part_name = f"rank{rank}.bin"  # this process's file of each save

    # -------------------------------------------------------------------- staging memory

    def prepare(self, pieces: list[Piece], probe: bool = False) -> None:
        """Allocate the staging memory for this process's share of ``pieces`` and, on a GPU, page-lock it in a thread
        while the first steps run; with ``probe``, measure the disk in a thread meanwhile (``write_estimate``)."""
        spans = writes(pieces, self.rank, self.world_size)
        self.staging = torch.empty(sum(span_bytes(p, rows) for p, rows in spans), dtype=torch.uint8)
        if self.device.type == "cuda" and self.staging.numel():
            self.pinning = threading.Thread(target=self.pin, args=([span_bytes(p, r) for p, r in spans],), daemon=True)
            self.pinning.start()
        if probe:
            self.probing = threading.Thread(target=self.probe, name="disk-probe", daemon=True)
            self.probing.start()

    def probe(self) -> None:
        """The disk's speed, by a write of up to PROBE bytes (incompressible: a random MiB repeated) with fsync."""
        background_priority()
        n = min(PROBE, max(self.state_bytes(), 2**20))
        block = np.frombuffer(os.urandom(2**20), np.uint8)
        data = np.tile(block, -(-n // block.size))[:n]
        try:
            self.disk_speed = files.disk_speed(self.run_dir, data)
        except OSError:
            pass  # the first save says so, naming the file

    def state_bytes(self) -> int:
        """The bytes of a save of every process (this process's share times their number)."""
        return (0 if self.staging is None else self.staging.numel()) * self.world_size

    def write_estimate(self, wait: bool = True) -> float | None:
        """Seconds a save takes to write: the last save's, else the state's bytes at the disk's speed (``probe``);
        None while the probe runs and ``wait`` is false."""
        written = [s.written for s in self.saves if s.written and s.error is None]
        if written:
            return written[-1]
        if self.probing is not None:
            if not wait and self.probing.is_alive():
                return None
            self.probing.join()
        return self.state_bytes() / self.disk_speed if self.disk_speed else 0.0

    def pin(self, sizes: list[int]) -> None:
        """Page-lock the staging memory, span by span (a copy never crosses two registrations). Its pages are first
        touched here, outside the driver: cudaHostRegister of untouched memory faults every page in while it holds
        the driver's lock, and every CUDA call of the steps, the loader's copies too, waits for it (12 GiB: most of
        a minute and a half of data stalls at seed scale)."""
        start = time.perf_counter()
        self.staging.fill_(0)
        cudart, at, done = torch.cuda.cudart(), self.staging.data_ptr(), []
        for size in sizes:
            if int(cudart.cudaHostRegister(at, size, 0)) != 0:  # 0 = cudaHostRegisterDefault
                break
            done.append(at)
            at += size
        self.registered, self.pinned = done, len(done) == len(sizes)
        self.pin_seconds = time.perf_counter() - start

    def ready_staging(self, size: int) -> torch.Tensor:
        if self.pinning is not None:
            self.pinning.join()
            self.pinning = None
        if self.staging is None or self.staging.numel() < size:  # a share larger than prepared (not expected)
            self.unpin()
            self.staging = torch.empty(size, dtype=torch.uint8)
        return self.staging

    def unpin(self) -> None:
        if self.pinning is not None:
            self.pinning.join()
            self.pinning = None
        for at in self.registered or ():
            torch.cuda.cudart().cudaHostUnregister(at)
        self.registered = []

    # -------------------------------------------------------------------- saving

    def save(self, step: int, pieces: list[Piece], meta: dict | None) -> Save:
        """Copy this process's share of ``pieces`` to host memory, then write it in a thread; ``meta`` (process 0:
        the rest of the state) is serialised now. Returns the save, ``blocked`` set."""
        started = time.perf_counter()
        waited = self.wait()
        spans = writes(pieces, self.rank, self.world_size)
        size = sum(span_bytes(p, rows) for p, rows in spans)
        staging = self.ready_staging(size)
        tensors: dict[str, TensorEntry] = {}
        offset = 0
        for piece, (a, b) in spans:
            source = piece.tensor[a:b] if piece.tensor.dim() else piece.tensor
            n = source.numel() * source.element_size()
            staging[offset : offset + n].view(source.dtype).view(source.shape).copy_(source, non_blocking=True)
            entry = tensors.setdefault(
                piece.key, TensorEntry(list(piece.shape), str(source.dtype).removeprefix("torch."))
            )
            entry.spans.append(files.Span(self.part_name, offset, piece.row + a, b - a))
            offset += span_bytes(piece, (a, b))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies, after the step's last update
        payload = None
        if meta is not None:
            buffer = io.BytesIO()
            torch.save(meta, buffer)
            payload = buffer.getvalue()
        save = Save(step, self.run_dir / files.folder_name(step, self.token), started, bytes=size)
        save.blocked, save.waited = time.perf_counter() - started, waited
        save.folder.mkdir(parents=True, exist_ok=True)
        self.current = save
        threading.Thread(
            target=self.write,
            args=(save, staging[:offset].numpy(), tensors, payload),
            name="checkpoint-writer",
            daemon=True,  # a process that must end now (a second Ctrl-C, a kill) leaves the save unfinished:
        ).start()  # the manifest still names the previous checkpoint
        return save

    def write(self, save: Save, data: np.ndarray, tensors: dict, payload: bytes | None) -> None:
        name = self.part_name
        background_priority()
        try:
            if self.rank == 0 and self.disk_speed is None and len(data):
                self.disk_speed = files.disk_speed(save.folder, data[:PROBE])
            try:
                entry = files.write_file(save.folder / name, data, self.pool)
                files.write_record(save.folder, files.PartRecord(self.rank, name, entry, tensors))
            except BaseException as err:
                files.write_record(
                    save.folder, files.PartRecord(self.rank, name, files.FileEntry(0, []), {}, repr(err))
                )
                raise
            if self.rank == 0:
                meta = files.write_file(save.folder / files.META, np.frombuffer(payload, np.uint8), self.pool)
                records = files.wait_for_parts(save.folder, self.world_size, COMMIT_TIMEOUT)
                manifest = files.commit(self.run_dir, save.folder, save.step, records, meta)
                save.total_bytes = manifest.total_bytes()
                self.committed_step = save.step
        except BaseException as err:
            save.error = err
        finally:
            save.written = time.perf_counter() - save.started
            save.done.set()

    def wait(self) -> float:
        """Wait for the save under way (committed, on process 0); seconds waited. Raises if it failed."""
        save, self.current = self.current, None
        if save is None:
            return 0.0
        start = time.perf_counter()
        save.done.wait()
        self.saves.append(save)
        if save.error is not None:
            kept = f"the last checkpoint is step {self.committed_step} in {self.run_dir / files.MANIFEST}"
            if self.committed_step < 1:
                kept = "no checkpoint was written before it"
            raise CheckpointError(
                f"the checkpoint of step {save.step} could not be written ({save.error}); {kept}"
            ) from save.error
        return time.perf_counter() - start

    def poll(self) -> list[Save]:
        """The saves finished since the last poll (at most the one under way); raises if it failed."""
        if self.current is not None and self.current.done.is_set():
            self.wait()
            return [self.saves[-1]]
        return []

    def close(self, wait: bool) -> float:
        """Finish: wait for the save under way (``wait``), or leave it (a process that must stop now; the manifest
        names the previous checkpoint); free the staging memory. Seconds waited."""
        waited = 0.0
        try:
            if wait:
                waited = self.wait()
        finally:
            if self.current is None or self.current.done.is_set():
                self.unpin()
            self.pool.shutdown(wait=False)
        return waited

    def line(self, save: Save) -> str:
        """Process 0's log line of a committed save."""
        processes = f" from {self.world_size} processes" if self.world_size > 1 else ""
        text = (
            f"checkpoint step {save.step}: {size(save.total_bytes)}{processes}, step blocked "
            f"{save.blocked:.2f} s"
            + (f" ({save.waited:.2f} s of it for the previous save)" if save.waited > 0.01 else "")
            + f", written in {save.written:.1f} s"
        )
        if self.disk_speed:
            text += f" (the disk alone: {save.total_bytes / self.disk_speed:.1f} s at {self.disk_speed / 1e9:.2f} GB/s)"
        return text

    def record(self) -> dict:
        """What the run's summary keeps of its saves (process 0)."""
        return {
            "saves": [
                {"step": s.step, "bytes": s.total_bytes or s.bytes, "blocked_s": s.blocked, "written_s": s.written}
                for s in self.saves
                if s.error is None
            ],
            "disk_bytes_per_s": self.disk_speed,
            "staging_bytes": 0 if self.staging is None else self.staging.numel(),
            "staging_pinned": self.pinned,
            "pin_s": self.pin_seconds,
            "host_peak_bytes": host_peak(),  # this process's, the whole run's: the staging memory is in it
        }


BACKGROUND_NICE = 10  # a thread's niceness while it writes or checksums a save (0 is the loader's and the step's)


def background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: a thread's own niceness): a save's writing and checksums then
    take the cores the loader's workers and the step leave, and never a core from them."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the save runs at the process's priority


def host_peak() -> int | None:
    """This process's peak resident memory (Linux's VmHWM), or None where /proc does not tell."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def token() -> str:
    """A run attempt's token (process 0's, sent to the others): its save folders are its own (checkpoint_files.py)."""
    return f"{time.strftime('%Y%m%d%H%M%S')}p{os.getpid()}"


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
