"""Batches drawn by worker processes straight into a ring of reusable shared-memory slots.

Why not torch's DataLoader: a batch of 1024 images of 256 px is 64 MiB. The DataLoader collates it, into a fresh
shared-memory file per batch that the main process maps and unmaps, and its pin-memory thread copies it once more into
pinned memory: those per-batch costs, not the sampler, set its batches/s (docs/training.md, "The batch loader"). Here
the main process allocates K slots once (images [K, B, 1, S, S] uint8 and an area for each batch's targets, in
anonymous shared memory that forked workers inherit) and, for a CUDA device, page-locks them in place, so a slot's
images and targets are copied to the device directly and asynchronously, whatever the layout (padded targets are a
megabyte a batch at seed scale: pickled through a pipe and page-locked again for every batch, they kept the step
waiting for its data).

Flow: the main process hands (batch b, free slot k) to a task queue; a worker (forked; workers never
touch CUDA) draws batch b into slot k, writes its targets into the slot's area and sends back (b, k, where they
lie) through a pipe of its own (targets that do not fit, a dataset's of a wider dtype, travel in the message). The
main process yields batches in order. For a CUDA device it copies a batch on a side stream (the next batch's copy is
issued while the consumer's step runs), makes the consumer's stream wait for the copy and gives slot k back only once
the copy has finished. On the CPU it yields a copy of
the slot (a consumer may keep batches, e.g. ``list(loader)``). With 0 workers batches are drawn in this
process. A batch is a pure function of its index (``draw``): the same whatever the number of workers.
An iteration (``Batches``) can first wait for its ring to fill (``fill``): every slot drawn and waiting, the state
a loader that keeps ahead of its consumer is in; `make profile` starts its steps from there.

Faults end the iteration at the consumer's next batch in one line naming the worker (``DataWorkerDied``): a
worker that dies, however (a signal, ``os._exit``, the kernel's out-of-memory killer), even when every batch
due was drawn already (a wait watches the workers' exits as well as their pipes); one that raises (its
exception; the traceback is the error's cause); one that delivers nothing for ``worker_timeout`` seconds while
a batch is due (stopped, or stuck: named with the batch it holds). Nothing waits on a worker without a bound:
each writes its results into its own pipe (a worker killed half-way through a message, which may well exceed
the pipe's 64 KiB, leaves the partial message in its own pipe only, and holds no lock another worker needs),
and the main process reads the pipes without blocking, gathering bytes until a whole message is there.
Before the ring is allocated, its size is checked against the memory available (``MemoryRefusal``). A worker's own
side, its loop and its messages, is detector/data/worker.py.
"""

from __future__ import annotations

import atexit
import mmap
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from detector.data.host_memory import check_memory
from detector.data.targets import Targets
from detector.data.worker import (
    ALIGN,
    IDLE,
    PHASES,
    WATCHDOG_SECONDS,
    Inbox,
    exit_description,
    host_arrays,
    process_state,
    unpack_targets,
    worker_loop,
)
from detector.errors import UserError
from detector.regions import LOADER_LABEL


class DataWorkerDied(UserError, RuntimeError):
    """A data worker ended while batches were still due: the run cannot go on without it (one line; a
    UserError so that the command ends with exit status 2 and no traceback of the main process's wait)."""


class DataWorkerStalled(DataWorkerDied):
    """A data worker delivered nothing for data.worker_timeout seconds while a batch was due: stopped (kill -STOP,
    a debugger) or stuck. Without a bound the run would wait for it for good."""


class DataWorkerFailed(DataWorkerDied):
    """A data worker raised drawing a batch: one line with its exception; its traceback is the cause, which
    ``--debug`` shows."""


class WorkerTraceback(Exception):
    """A worker's traceback, the cause of a DataWorkerFailed (a traceback cannot cross processes; its text can)."""


@dataclass(frozen=True)
class BatchLoader:
    """``batches`` batches: ``draw(b, images)`` fills ``images`` [B, 1, S, S] uint8 with batch b and returns
    its targets. Iterating yields (images, targets) in batch order, on ``device``; each iteration
    (``Batches``) starts its own ``workers`` processes and ring of ``slots`` (default: two per worker, and two
    more), and stops them when it ends, fails, is closed or dropped."""

    draw: Callable[[int, Tensor], Targets]
    batches: int
    batch_shape: tuple[int, ...]  # [B, 1, S, S]
    workers: int
    device: torch.device
    slots: int | None = None
    worker_timeout: float = 60.0  # seconds a worker may deliver nothing while a batch is due (data.worker_timeout)
    # bytes of each slot's target area: a batch's targets that fit travel in it as its images do, the others through
    # the worker's pipe (0: all of them)
    target_bytes: int = 0
    role: str = "data worker"  # what a worker is called in a line about it ("held-out worker 2 of 2 (pid ...)")

    def __len__(self) -> int:
        return self.batches

    @property
    def slot_count(self) -> int:
        return self.slots or default_slots(self.workers)

    @property
    def ring_bytes(self) -> int:
        """The host memory of the ring of slots that each iteration allocates."""
        return Slots.bytes(self.slot_count, self.batch_shape, self.target_bytes)

    def __iter__(self) -> Batches:
        return Batches(self)


class Batches:
    """One iteration of a BatchLoader: its batches in order. Its ring starts with the first batch (or ``fill``) and
    stops when the iteration ends, fails, is closed or dropped half-way; after that it yields nothing more."""

    def __init__(self, loader: BatchLoader):
        self.loader, self.ring, self.next = loader, None, 0

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[Tensor, Targets]:
        if self.next >= self.loader.batches:
            self.close()
            raise StopIteration
        try:
            batch = self.started().take(self.next)
        except BaseException:
            self.close()
            raise
        self.next += 1
        return batch

    def fill(self, seconds: float) -> tuple[int, int]:
        """Wait, at most ``seconds``, until every batch the ring can hold from here is drawn and waiting; returns
        (batches waiting, the most it can hold). With 0 workers nothing is drawn ahead: (0, 0)."""
        if self.next >= self.loader.batches:
            return 0, 0
        try:
            return self.started().fill(self.next, seconds)
        except BaseException:
            self.close()
            raise

    def started(self) -> Ring:
        if self.ring is None:
            self.ring = Ring(self.loader)
        return self.ring

    def close(self) -> None:
        """Stop the workers and free the ring; a second call does nothing."""
        self.next = self.loader.batches
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()

    def __del__(self) -> None:
        self.close()


def default_slots(workers: int) -> int:
    return 2 * workers + 2  # each worker finds a free slot while earlier batches wait


class Slots:
    """The ring's ``count`` slots in one block of anonymous shared memory, which forked workers inherit and which is
    freed with its last reference (no file in /dev/shm to leak or to outgrow): ``images`` [count, *shape] uint8, then
    ``targets`` [count, target_bytes] uint8, each batch's targets where they fit (data_worker.host_arrays). One block,
    so that one page-lock serves both."""

    def __init__(self, count: int, shape: tuple[int, ...], target_bytes: int):
        self.memory = torch.frombuffer(mmap.mmap(-1, Slots.bytes(count, shape, target_bytes)), dtype=torch.uint8)
        images = count * int(np.prod(shape))
        self.images = self.memory[:images].view(count, *shape)
        start = Slots.targets_start(images)
        self.targets = self.memory[start : start + count * target_bytes].view(count, target_bytes)

    @staticmethod
    def targets_start(image_bytes: int) -> int:
        return -(-image_bytes // ALIGN) * ALIGN  # aligned for every dtype's view

    @staticmethod
    def bytes(count: int, shape: tuple[int, ...], target_bytes: int) -> int:
        return Slots.targets_start(count * int(np.prod(shape))) + count * target_bytes


def page_lock(slots: Tensor) -> None:
    """Page-lock ``slots`` in place (what pin_memory() does with a copy), so host-to-device copies are
    asynchronous DMA; undone by ``page_unlock``."""
    portable = 1  # cudaHostRegisterPortable: page-locked for every CUDA context, as torch's own pin_memory
    err = int(torch.cuda.cudart().cudaHostRegister(slots.data_ptr(), slots.numel(), portable))
    if err:
        raise RuntimeError(f"cudaHostRegister of {slots.numel() >> 20} MiB of batch slots failed: cudaError {err}")


def page_unlock(slots: Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(slots.data_ptr()))
    if err:
        raise RuntimeError(f"cudaHostUnregister of the batch slots failed: cudaError {err}")


class Workers:
    """A ring's worker processes: the task queue they share, a result pipe each, and what each is doing (its
    batch and phase, in shared memory). ``receive`` raises a worker's error, its death, or its stall: nothing
    delivered for ``worker_timeout`` seconds while a batch is due."""

    def __init__(self, loader: BatchLoader, slots: Slots):
        context = multiprocessing.get_context("fork")  # workers inherit the slots and `draw`, nothing is pickled
        self.batches, self.timeout, self.role = loader.batches, loader.worker_timeout, loader.role
        # tasks: one queue, written by this process only (a task is far below a pipe's atomic write size), read
        # by whichever worker is free; results: a pipe per worker, so that no worker's death blocks another
        # stop: a flag in shared memory, not an Event, whose lock a worker killed inside is_set() would keep
        self.tasks, self.stop = context.Queue(), context.RawValue("b", 0)
        self.doing = context.RawArray("q", [-1, IDLE] * loader.workers)  # per worker: its batch, its phase
        self.processes, self.inboxes, self.last_message = [], [], time.monotonic()
        # before multiprocessing's own exit handler (atexit runs last registered first): it would send the workers
        # a SIGTERM, which they ignore, and then wait for them for good where no one closed the loader
        atexit.register(self.close)
        try:
            for i in range(loader.workers):
                self.start(context, loader.draw, slots, i)
        except BaseException:
            self.close()  # the workers started so far
            raise

    def start(self, context, draw, slots: Slots, i: int) -> None:
        read_fd, write_fd = os.pipe()
        self.inboxes.append(Inbox(read_fd))
        read_fds = [inbox.fd for inbox in self.inboxes]
        args = (draw, slots, self.tasks, write_fd, read_fds, self.stop, os.getpid(), self.doing, i)
        process = context.Process(target=worker_loop, args=args, daemon=True)  # daemon: killed at our exit
        try:
            process.start()
        finally:
            os.close(write_fd)  # the worker has its own copy
        self.processes.append(process)

    def submit(self, batch: int, slot: int) -> None:
        self.tasks.put((batch, slot))

    def wait(self, seconds: float) -> None:
        """Until a worker's result has bytes to read or a worker has ended, at most ``seconds``."""
        watched = [inbox.fd for inbox in self.inboxes] + [p.sentinel for p in self.processes]
        multiprocessing.connection.wait(watched, max(0.0, seconds))

    def receive(self, block: bool, wanted: int, since: float = 0.0) -> list[tuple[int, int, tuple]]:
        """The batches drawn since the last call, as (batch, slot, host_arrays message); with ``block``, waits
        for at least one, WATCHDOG_SECONDS at a time, while batch ``wanted`` is due since ``since``."""
        while True:
            watched = [inbox.fd for inbox in self.inboxes] + [p.sentinel for p in self.processes]
            ready = multiprocessing.connection.wait(watched, min(WATCHDOG_SECONDS, self.timeout) if block else 0)
            drawn = []
            for i, inbox in enumerate(self.inboxes):
                for batch, slot, targets, error in inbox.read() if inbox.fd in ready else []:
                    if error is not None:
                        raise DataWorkerFailed(
                            f"{self.name(i)} raised {error[0]} drawing batch {batch} of {self.batches} "
                            "(its traceback: --debug)"
                        ) from WorkerTraceback(error[1])
                    drawn.append((batch, slot, targets))
            if drawn:
                self.last_message = time.monotonic()
            self.check(wanted)
            if drawn or not block:
                return drawn
            waited = time.monotonic() - max(since, self.last_message)
            if waited > self.timeout:
                raise self.stalled(wanted, waited)

    def check(self, wanted: int) -> None:
        """Raise DataWorkerDied if a worker has ended: workers end only when the ring closes."""
        for i, process in enumerate(self.processes):
            if process.exitcode is not None:
                raise DataWorkerDied(
                    f"{self.name(i)} {exit_description(process.exitcode)}, before batch {wanted} of "
                    f"{self.batches} was loaded"
                )

    def name(self, i: int, state: str = "") -> str:
        return f"{self.role} {i + 1} of {len(self.processes)} (pid {self.processes[i].pid}{state})"

    def stalled(self, wanted: int, waited: float) -> DataWorkerStalled:
        """The stall, naming the worker that holds batch ``wanted``, else one the kernel says is stopped, else a
        busy one, and what it was doing."""
        workers = [(i, self.doing[2 * i], self.doing[2 * i + 1]) for i in range(len(self.processes))]
        states = {i: process_state(p.pid) for i, p in enumerate(self.processes)}
        i, batch, phase = min(workers, key=lambda w: (w[1] != wanted or w[2] == IDLE, not states[w[0]], w[2] == IDLE))
        doing = PHASES[IDLE] if phase == IDLE else f"{PHASES[phase]} batch {batch} of {self.batches}"
        return DataWorkerStalled(
            f"{self.name(i, ', ' + states[i] if states[i] else '')} delivered nothing for {waited:.0f} s, while "
            f"{doing}, with batch {wanted} due (data.worker_timeout={self.timeout:g}): stopped or stuck"
        )

    def close(self) -> None:
        """Stop the workers (at once: a batch half drawn is dropped); a second call does nothing."""
        atexit.unregister(self.close)
        if self.stop.value:
            return
        for inbox in self.inboxes:  # first: a worker blocked writing a result nobody will read fails at once
            os.close(inbox.fd)
        self.inboxes = []
        self.stop.value = 1
        for _ in self.processes:
            self.tasks.put(None)  # wakes a waiting worker at once
        for process in self.processes:
            process.join(timeout=WATCHDOG_SECONDS)
        for process in self.processes:  # still drawing, or stopped: nothing of it is needed (workers ignore SIGTERM)
            if process.is_alive():
                process.kill()
                process.join(timeout=WATCHDOG_SECONDS)
        self.tasks.cancel_join_thread()  # do not block our exit on tasks nobody will read
        self.tasks.close()
        self.processes = []


class Ring:
    """One iteration's slots and copies, fed by its ``Workers`` (see the module docstring)."""

    def __init__(self, loader: BatchLoader):
        self.loader, self.device = loader, loader.device
        count = loader.slot_count
        check_memory(
            f"the loader's ring of {count} slots for batches of {list(loader.batch_shape)} uint8 and their targets "
            "needs",
            loader.ring_bytes,
            "lower data.batch_size or data.image_size (or data.num_workers: two slots each)",
        )
        self.slots = Slots(count, loader.batch_shape, loader.target_bytes)  # [K, B, 1, S, S] and [K, T] uint8
        self.free = deque(range(count))  # slots no batch holds
        self.drawn = {}  # batch -> (slot, host_arrays message): drawn, not yet handed to the device
        self.staged = {}  # batch -> (images, targets, copy event, device tensors) ready for the consumer
        self.copying = deque()  # (event, slot): a slot goes back to `free` once its copy has finished
        self.next_task = 0  # the next batch to hand to a worker
        self.stream, self.locked, self.workers, self.locking, self.lock_error = None, False, None, None, None
        try:
            if loader.workers:  # before page-locking: a driver may keep locked pages out of a forked child
                self.workers = Workers(loader, self.slots)
                self.submit()
            if self.device.type == "cuda":
                self.stream = torch.cuda.Stream(self.device)
                # in a thread (the driver's work, which leaves the interpreter free: a fraction of a second for a
                # ring of hundreds of MiB): the run's start-up goes on meanwhile; the first copy waits for it
                self.locking = threading.Thread(target=self.lock_pages, name="ring-page-lock", daemon=True)
                self.locking.start()
        except BaseException:
            self.close()
            raise

    def lock_pages(self) -> None:
        try:
            page_lock(self.slots.memory)
            self.locked = True
        except BaseException as err:  # said by the first copy, which waits for this
            self.lock_error = err

    def pages_locked(self) -> None:
        """Wait for the slots' page-lock, begun with the ring; its error, if it failed."""
        if self.locking is not None:
            self.locking.join()
            self.locking = None
            if self.lock_error is not None:
                raise self.lock_error

    def submit(self) -> None:
        """Hand every free slot to the workers, with the next batches in order."""
        while self.workers and self.free and self.next_task < self.loader.batches:
            self.workers.submit(self.next_task, self.free.popleft())
            self.next_task += 1

    def take(self, b: int) -> tuple[Tensor, Targets]:
        """Batch b (the caller asks in order), on the device; the next batch's copy is issued meanwhile."""
        with torch.profiler.record_function(LOADER_LABEL):
            if self.workers:
                self.workers.check(b)  # also when every batch due is drawn already: a death never goes unnoticed
            self.recycle()
            if b not in self.staged:
                self.stage(b, *self.wait_for(b))
            images, targets, event, tensors = self.staged.pop(b)
            if self.stream is not None:
                if self.workers:
                    self.collect(b, block=False)
                if b + 1 in self.drawn:  # prefetch: its copy overlaps the consumer's step
                    self.stage(b + 1, *self.drawn.pop(b + 1))
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_event(event)
                for t in tensors:
                    t.record_stream(consumer)  # allocated on the copy stream, used on the consumer's
            return images, targets

    def fill(self, b: int, seconds: float) -> tuple[int, int]:
        """Wait, at most ``seconds``, until every batch the ring can hold from batch b on is drawn and waiting, as a
        loader ahead of its consumer keeps it; returns (waiting, the most it can hold)."""
        room = min(self.loader.slot_count, self.loader.batches - b) if self.workers else 0
        deadline = time.monotonic() + seconds
        while self.workers:
            self.recycle()
            self.collect(b, block=False)  # also raises a worker's death or error
            left = deadline - time.monotonic()
            if self.waiting() >= room or left <= 0:
                break
            self.workers.wait(min(left, WATCHDOG_SECONDS))
        return self.waiting(), room

    def waiting(self) -> int:
        """The batches drawn and not yet taken: in their slots, or staged on the device."""
        return len(self.drawn) + len(self.staged)

    def wait_for(self, b: int) -> tuple[int, tuple]:
        """(slot, host_arrays message) of batch b, drawn in this process (0 workers) or waited for."""
        since = time.monotonic()
        while b not in self.drawn:
            if not self.free and (not self.workers or self.next_task <= b):
                self.release(*self.copying.popleft())  # every slot waits for a copy: wait for the oldest
            if not self.workers:
                slot = self.free.popleft()
                return slot, host_arrays(self.loader.draw(b, self.slots.images[slot]), self.slots.targets[slot])
            self.submit()
            self.collect(b, block=True, since=since)
        return self.drawn.pop(b)

    def collect(self, b: int, block: bool, since: float = 0.0) -> None:
        """Gather the batches the workers have drawn (``block``: wait for one), while batch b is due."""
        for batch, slot, targets in self.workers.receive(block, b, since):
            self.drawn[batch] = (slot, targets)

    def stage(self, b: int, slot: int, message: tuple) -> None:
        """Batch b's images and targets as the consumer gets them: copied to the device, or out of the slot."""
        area = self.slots.targets[slot]
        if self.stream is None:
            self.staged[b] = (self.slots.images[slot].clone(), unpack_targets(message, self.device, area)[0], None, [])
            self.free.append(slot)
            self.submit()
            return
        self.pages_locked()
        with torch.cuda.stream(self.stream):
            images = self.slots.images[slot].to(self.device, non_blocking=True)
            targets, tensors = unpack_targets(message, self.device, area)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copying.append((event, slot))
        self.staged[b] = (images, targets, event, [images, *tensors])

    def recycle(self) -> None:
        """Give back the slots whose copies have finished, without waiting."""
        while self.copying and self.copying[0][0].query():
            self.release(*self.copying.popleft())
        self.submit()

    def release(self, event, slot: int) -> None:
        event.synchronize()
        self.free.append(slot)

    def close(self) -> None:
        """Stop the workers, then unlock the slots once no copy reads them."""
        if self.workers:
            self.workers.close()
            self.workers = None
        if self.locking is not None:
            self.locking.join()  # a page-lock under way: undone below once done
            self.locking = None
        if self.locked:
            self.stream.synchronize()
            page_unlock(self.slots.memory)
            self.locked = False
