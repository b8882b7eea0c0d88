"""Checkpoints off the step's path: the step waits only while its state is copied to host memory; a thread writes it.

A save, on every process at once:

1. (the step waits) this process's share of the state (``checkpoint.state_pieces``, ``written_rows``) is copied into
   its staging memory: host memory of exactly that share, a tensor a span, page-locked on a GPU (``cudaHostRegister``,
   once per run, in a thread while the first steps run, its pages touched first) so that the device-to-host copy runs
   at the link's speed;
2. (a thread of ours, at a lower CPU priority) ``torch.distributed.checkpoint.save`` writes every process's rows as
   chunks of one DCP checkpoint (``dcp_io.RowsSavePlanner``; its plans travel on a gloo group of the checkpoints' own,
   never beside a step's collectives), each process then checksums the files it wrote, and process 0 commits the save by
   replacing the manifest (checkpoints/files.py). This is DCP's ``async_save``, a stage and then ``save`` in a thread,
   with our stager: staging memory page-locked once, which DCP's would lock at the first save, in the step's way, and a
   thread that goes on to checksum and commit.

A new save first waits for the previous one. Host memory for a save is the process's share of the state and no more.
Process 0 measures the disk once (a write of up to ``PROBE`` bytes with fsync) and logs each save against it::

    checkpoint step 20: 12.2 GiB from 2 processes, step blocked 0.41 s, written in 14.2 s (the disk alone: 12.9 s
    at 1.01 GB/s)

A stop that cannot wait for the save under way (a second Ctrl-C, a lost process) abandons it: it is then never
committed, so the line that names the last checkpoint names the one the manifest does (``abandon``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from detector.checked import write_atomically
from detector.train.checkpoints import files
from detector.train.checkpoints.files import CheckpointError, background_priority, human_bytes, one_line
from detector.train.checkpoints.state import Piece, meta_bytes, written_rows
from detector.train.distributed.processes import lost_peer

PROBE = 256 * 2**20  # bytes of the disk's speed test (with fsync): enough to pass any write cache of the page cache
# A save's rows lie in chunks of at most this many bytes (each a chunk of DCP's metadata, its own staging buffer): a
# resume reads them in parallel (dcp_io.Reader), where a tensor of one piece (the head's 4.3 GB weight at
# seed scale, and its two AdamW moments) would be read, deserialised and copied by one thread.
CHUNK_BYTES = 256 * 2**20
PIN_LEAST = 2**20  # spans smaller than this stay pageable: they may share a page with another allocation
WRITERS = 2  # DCP's writer threads (and files) of a save beside the steps, at a lower priority
# A save the run waits for (its last, a stop's) has the machine to itself: its writes and checksums take more threads,
# at the step's priority, where a save beside the steps takes WRITERS and HASHERS checksummers at a lower one
ALONE_THREADS = max(2, min(8, os.cpu_count() or 1))
SAVE_TIMEOUT = datetime.timedelta(
    seconds=600
)  # the checkpoints' gloo group: a process gone ends a save, never hangs it


def writes(pieces: list[Piece], rank: int, world_size: int) -> list[tuple[Piece, tuple[int, int]]]:
    """The rows of ``pieces`` that process ``rank`` writes, in chunks of at most CHUNK_BYTES."""
    return [
        (p, chunk)
        for p in pieces
        if (rows := written_rows(p, rank, world_size)) is not None
        for chunk in row_chunks(p, rows)
    ]


def row_chunks(piece: Piece, rows: tuple[int, int]) -> list[tuple[int, int]]:
    """``rows`` of ``piece`` cut into ranges of at most CHUNK_BYTES (at least one row each)."""
    if not piece.tensor.dim():
        return [rows]
    row_bytes = max(piece.tensor[:1].nbytes, 1)
    step = max(CHUNK_BYTES // row_bytes, 1)
    return [(start, min(start + step, rows[1])) for start in range(rows[0], rows[1], step)]


def span_source(piece: Piece, rows: tuple[int, int]) -> torch.Tensor:
    return piece.tensor[rows[0] : rows[1]] if piece.tensor.dim() else piece.tensor


@dataclass
class Save:
    """One save under way or done: its timings (seconds) and size."""

    step: int
    folder: Path
    started: float  # perf_counter at the save's call
    blocked: float = 0.0  # the step's wait: for the previous save to finish, then the copy to host memory
    waited: float = 0.0  # of which for the previous save
    bytes: int = 0  # this process's share
    # from the end of the wait for the previous save until committed (process 0) or this process's part is on disk:
    # its own write, which the disk's time is held against and the next save's estimate (the wait is in ``blocked``)
    written: float | None = None
    total_bytes: int = 0  # every process's (process 0, once committed)
    error: BaseException | None = None
    alone: bool = False  # the run waits for it (its last save, a stop's): nothing runs beside it
    done: threading.Event = field(default_factory=threading.Event)


class Checkpointer:
    """A run's saves (see the module docstring): ``save`` from the loop, ``poll`` between steps for the saves finished
    since, ``wait`` for the one under way, ``close`` at the end. Every process makes one, at the same point."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, device: torch.device, token: str, resumed: int = 0):
        """``token``: the run attempt's (``token()``, process 0's, the same on every process); ``resumed``: the step
        of the checkpoint the run resumed from (0: none)."""
        self.run_dir, self.rank, self.world_size, self.device, self.token = run_dir, rank, world_size, device, token
        self.group = dist.new_group(backend="gloo", timeout=SAVE_TIMEOUT) if world_size > 1 else None
        self.pool = concurrent.futures.ThreadPoolExecutor(
            files.HASHERS, thread_name_prefix="checksum", initializer=background_priority
        )
        self.staging: list[torch.Tensor] = []  # a tensor a span of this process's share
        self.registered: list[int] = []  # the page-locked spans' addresses (cudaHostRegister)
        self.pinned = False  # whether every span of PIN_LEAST bytes or more was page-locked
        self.pinning: threading.Thread | None = None
        self.probing: threading.Thread | None = None
        self.pin_seconds = 0.0
        self.disk_speed: float | None = None  # bytes/s, process 0's measure
        self.current: Save | None = None
        self.saves: list[Save] = []
        self.finished: list[Save] = []  # finished since the last ``poll``: each gets its line
        # the step the manifest names (process 0's; a save commits it), the run's one "last checkpoint" as
        # checkpoints/manager.py reads it, and the step of the last save started (every process's alike)
        self.committed_step = resumed or -1
        self.started_step = resumed or -1
        self.lock, self.abandoned = threading.Lock(), False

    # -------------------------------------------------------------------- staging memory

    def prepare(self, pieces: list[Piece], probe: bool = False) -> None:
        """Allocate the staging memory for this process's share of ``pieces`` and, on a GPU, page-lock it in a thread
        while the first steps run; with ``probe``, measure the disk in a thread meanwhile (``write_estimate``)."""
        self.staging = [torch.empty(span_source(p, r).nbytes, dtype=torch.uint8) for p, r in self.spans(pieces)]
        if self.device.type == "cuda" and self.staging:
            self.pinning = threading.Thread(target=self.pin, name="checkpoint-pinning", daemon=True)
            self.pinning.start()
        if probe:
            self.probing = threading.Thread(target=self.probe, name="disk-probe", daemon=True)
            self.probing.start()

    def spans(self, pieces: list[Piece]) -> list[tuple[Piece, tuple[int, int]]]:
        """The rows of ``pieces`` this process writes, each (key, first row) once (a 0-dim state that each block of a
        layer holds, the same in each, is one value of the checkpoint)."""
        seen, out = set(), []
        for piece, rows in writes(pieces, self.rank, self.world_size):
            where = (piece.key, tuple(piece.offsets(rows[0])))
            if where not in seen:
                seen.add(where)
                out.append((piece, rows))
        return out

    def pin(self) -> None:
        """Page-lock the staging memory, span by span. Its pages are first touched here, outside the driver:
        cudaHostRegister of untouched memory faults every page in while it holds the driver's lock, and every CUDA
        call of the steps, the loader's copies too, waits for it (12 GiB: most of a minute and a half of data
        stalls at seed scale)."""
        start = time.perf_counter()
        cudart, done, large = torch.cuda.cudart(), [], [t for t in self.staging if t.numel() >= PIN_LEAST]
        for tensor in large:
            tensor.fill_(0)
            if int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)) != 0:  # 0 = cudaHostRegisterDefault
                break
            done.append(tensor.data_ptr())
        self.registered, self.pinned = done, len(done) == len(large)
        self.pin_seconds = time.perf_counter() - start

    def probe(self) -> None:
        """The disk's speed, by a write of up to PROBE bytes (incompressible: a random MiB repeated) with fsync."""
        background_priority()
        n = min(PROBE, max(self.state_bytes(), 2**20))
        block = np.frombuffer(os.urandom(2**20), np.uint8)
        try:
            self.disk_speed = files.disk_speed(self.run_dir, np.tile(block, -(-n // block.size))[:n])
        except OSError:
            pass  # the first save says so, naming the file

    def measure_disk(self, folder: Path, staged: list[torch.Tensor]) -> None:
        """The disk's speed, at the first save where no probe ran: a write of PROBE bytes of the largest staged chunk
        (the first may be a bias of a few bytes, whose write times the disk's latency), else of random bytes."""
        largest = max(staged, key=lambda t: t.numel() * t.element_size()).reshape(-1).view(torch.uint8)
        if largest.numel() >= min(PROBE, self.state_bytes()):
            self.disk_speed = files.disk_speed(folder, largest[:PROBE].numpy())
        else:
            self.probe()

    def state_bytes(self) -> int:
        """The bytes of a save of every process (this process's share times their number)."""
        return sum(t.numel() for t in self.staging) * self.world_size

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

    def unpin(self) -> None:
        if self.pinning is not None:
            self.pinning.join()
            self.pinning = None
        for at in self.registered:
            torch.cuda.cudart().cudaHostUnregister(at)
        self.registered = []

    # -------------------------------------------------------------------- saving

    def save(self, step: int, pieces: list[Piece], meta: dict | None, alone: bool = False) -> Save:
        """Copy this process's share of ``pieces`` to host memory, then write it in a thread; ``meta`` (process 0:
        the rest of the state) is serialised now; ``alone``: the run waits for this save (ALONE_THREADS). Returns the
        save, ``blocked`` set."""
        started = time.perf_counter()
        waited = self.wait()
        if self.pinning is not None:
            self.pinning.join()
            self.pinning = None
        spans = self.spans(pieces)
        if len(spans) != len(self.staging):  # a share other than prepared (not expected): staged anew
            self.unpin()
            self.staging = [torch.empty(span_source(p, r).nbytes, dtype=torch.uint8) for p, r in spans]
        staged = []
        for (piece, rows), memory in zip(spans, self.staging, strict=True):
            source = span_source(piece, rows)
            view = memory.view(source.dtype).view(source.shape)
            view.copy_(source, non_blocking=True)
            staged.append((piece.key, piece.offsets(rows[0]), torch.Size(piece.shape), view))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies, after the step's last update
        payload = meta_bytes(meta) if meta is not None else None
        folder = self.run_dir / files.folder_name(step, self.token)
        save = Save(step, folder, started, bytes=self.state_bytes(), alone=alone)
        self.started_step = step
        save.blocked, save.waited = time.perf_counter() - started, waited
        try:
            save.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(self.failed(step, err)) from None
        self.current = save
        threading.Thread(
            target=self.write,
            args=(save, staged, payload),
            name="checkpoint-writer",
            daemon=True,  # a process that must end now (a second Ctrl-C, a kill) leaves the save unfinished:
        ).start()  # the manifest still names the previous checkpoint
        return save

    def write(self, save: Save, staged: list, payload: bytes | None) -> None:
        if not save.alone:
            background_priority()
        try:
            if self.rank == 0 and self.disk_speed is None and staged:
                self.measure_disk(save.folder, [view for *_, view in staged])
            if payload is not None:
                write_atomically(save.folder / files.META, payload)
            # DCP's imports, at the run's first save, in this thread (dcp_io's docstring)
            from detector.train.checkpoints import dcp_io

            dcp_io.write(save.folder, staged, ALONE_THREADS if save.alone else WRITERS, self.group)
            self.commit(save)
        except BaseException as err:
            save.error = err
        finally:
            save.written = time.perf_counter() - save.started - save.waited
            save.done.set()

    def commit(self, save: Save) -> None:
        """Checksum the files this process wrote; process 0 gathers every process's and commits the save, unless a
        stop abandoned it meanwhile."""
        try:
            mine = self.checksums(save)
        except OSError as err:  # every process still reaches the gather: none waits there for good
            mine = f"process {self.rank} could not checksum its files ({one_line(err)})"
        found = [mine]
        if self.group is not None:
            found = [None] * self.world_size
            dist.all_gather_object(found, mine, group=self.group)
        failed = [f for f in found if isinstance(f, str)]
        if failed:
            raise CheckpointError(failed[0])
        if self.rank != 0:
            return
        entries = {name: entry for part in found for name, entry in part.items()}
        for name in (files.DCP_METADATA, files.META):
            entries[name] = files.file_entry(save.folder / name, self.pool)
        manifest = files.Manifest(save.step, save.folder.name, self.world_size, entries)
        with self.lock:
            if self.abandoned:
                raise CheckpointError("abandoned by a stop that could not wait for it")
            files.commit(self.run_dir, manifest)
            self.committed_step = save.step
        save.total_bytes = manifest.total_bytes()

    def checksums(self, save: Save) -> dict[str, files.FileEntry]:
        """The entries of the files this process wrote of ``save``: in the run's background pool, or for a save the
        run waits for in ALONE_THREADS at the step's priority."""
        written = sorted(save.folder.glob(f"__{self.rank}_*.distcp"))
        if not save.alone:
            return {p.name: files.file_entry(p, self.pool) for p in written}
        with concurrent.futures.ThreadPoolExecutor(ALONE_THREADS, thread_name_prefix="checksum") as pool:
            return {p.name: files.file_entry(p, pool) for p in written}

    def abandon(self) -> int:
        """No save under way is committed from now on (a stop that cannot wait); the step the manifest names."""
        with self.lock:
            self.abandoned = True
            return self.committed_step

    def wait(self) -> float:
        """Wait for the save under way (committed, on process 0); seconds waited. Raises if it failed."""
        save, self.current = self.current, None
        if save is None:
            return 0.0
        start = time.perf_counter()
        save.done.wait()
        self.saves.append(save)
        self.finished.append(save)
        if save.error is not None:
            lost = lost_peer(files.root(save.error)) if self.world_size > 1 else None
            if lost is not None:  # another process died during the save: that is what the run says
                raise lost from save.error
            raise CheckpointError(self.failed(save.step, files.root(save.error))) from save.error
        return time.perf_counter() - start

    def failed(self, step: int, err: BaseException) -> str:
        """The line of a save of ``step`` that failed with ``err``: the save, why, and the checkpoint the run keeps."""
        kept = f"the last checkpoint is step {self.committed_step} in {self.run_dir / files.MANIFEST}"
        if self.committed_step < 1:
            kept = "no checkpoint was written before it"
        return f"the checkpoint of step {step} could not be written ({one_line(err)}); {kept}"

    def poll(self) -> list[Save]:
        """The saves finished since the last poll (a save that a new save waited for too); raises if one failed."""
        if self.current is not None and self.current.done.is_set():
            self.wait()
        found, self.finished = self.finished, []
        return found

    def close(self, wait: bool) -> float:
        """Finish: wait for the save under way (``wait``), or abandon it (a process that must stop now; the manifest
        names the previous checkpoint); free the staging memory and the group. Seconds waited."""
        waited = 0.0
        try:
            if wait:
                waited = self.wait()
            else:
                self.abandon()
        finally:
            if self.current is None or self.current.done.is_set():
                self.unpin()
                if self.group is not None:
                    dist.destroy_process_group(self.group)
                    self.group = None
            self.pool.shutdown(wait=False)
        return waited

    def line(self, save: Save) -> str:
        """Process 0's log line of a committed save."""
        processes = f" from {self.world_size} processes" if self.world_size > 1 else ""
        text = (
            f"checkpoint step {save.step}: {human_bytes(save.total_bytes)}{processes}, step blocked "
            f"{save.blocked:.2f} s"
            + (f" ({save.waited:.2f} s of it for the previous save)" if save.waited > 0.01 else "")
            + f", written in {save.written:.1f} s"
        )
        if self.disk_speed and save.total_bytes >= PROBE:  # a smaller write times the disk's latency, not its speed
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
            "staging_bytes": sum(t.numel() for t in self.staging),
            "staging_pinned": self.pinned,
            "pin_s": self.pin_seconds,
            "host_peak_bytes": host_peak(),  # this process's, the whole run's: the staging memory is in it
        }


def host_peak() -> int | None:
    """This process's peak resident memory (Linux's VmHWM), or None where /proc does not tell."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def token() -> str:
    """A run attempt's token (process 0's, sent to the others): its save folders are its own (checkpoints/files.py)."""
    return f"{time.strftime('%Y%m%d%H%M%S')}p{os.getpid()}"
