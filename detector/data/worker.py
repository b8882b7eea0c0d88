"""A data worker of the batch loader (loader.py): the process that draws batches into the ring's slots, the message
it sends back through a pipe of its own, how the main process reads that pipe without ever blocking, and how it tells
what became of a worker that died or stopped.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import traceback

import numpy as np
import torch
from torch import Tensor

from detector.data.targets import ListTargets, Targets

WATCHDOG_SECONDS = 1.0  # how often a waiting worker checks its parent, and the main process its workers
HEADER = struct.Struct("<Q")  # a result message's length, in front of its pickle


def host_arrays(targets: Targets, area: Tensor | None = None) -> tuple[type, list]:
    """Targets as (their type, arrays) for the result pipe. Each array is written into ``area`` (uint8, the batch's
    slot of the ring: shared, page-locked on a GPU) where they all fit, and travels as (dtype, shape, offset) alone;
    else it is pickled by value (a torch tensor would go through a shared-memory file of its own). List targets
    travel packed (B arrays pickle slowly)."""
    if isinstance(targets, ListTargets):
        arrays = [torch.cat(targets.boxes).numpy(), np.array([len(b) for b in targets.boxes])]
    else:
        arrays = [t.numpy() for t in targets]
    return type(targets), in_area(arrays, area) if area is not None else arrays


ALIGN = 64  # each array's offset in a slot's target area: any dtype's view of it is aligned


def in_area(arrays: list[np.ndarray], area: Tensor) -> list:
    """``arrays`` copied into ``area``, as their (dtype, shape, offset); as they are where they do not all fit."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // ALIGN) * ALIGN
    if end > area.numel():
        return arrays
    host = area.numpy()
    for a, offset in zip(arrays, offsets, strict=True):
        host[offset : offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return [(a.dtype.str, a.shape, offset) for a, offset in zip(arrays, offsets, strict=True)]


def unpack_targets(
    message: tuple[type, list], device: torch.device, area: Tensor | None = None
) -> tuple[Targets, list[Tensor]]:
    """The targets of ``host_arrays``'s message on ``device``, and the tensors that hold them. Arrays in ``area``
    are copied from there: to the device asynchronously (the caller keeps the slot until the copy is done), or on
    the CPU into tensors of their own (the slot is reused)."""
    kind, arrays = message
    host = [torch.from_numpy(a) if isinstance(a, np.ndarray) else slot_view(area, *a) for a in arrays]
    if device.type == "cuda":
        # a pickled array is page-locked first: a copy from pageable memory waits for the stream
        tensors = [
            (h if isinstance(a, tuple) else h.pin_memory()).to(device, non_blocking=True)
            for h, a in zip(host, arrays, strict=True)
        ]
    else:
        tensors = [h.clone() if isinstance(a, tuple) else h for h, a in zip(host, arrays, strict=True)]
    if kind is ListTargets:  # views of one copy, split by the host's counts
        return ListTargets(list(torch.split(tensors[0], host[1].tolist()))), tensors
    return kind(*tensors), tensors


def slot_view(area: Tensor, dtype: str, shape: tuple, offset: int) -> Tensor:
    """The array ``in_area`` wrote at ``offset`` of ``area``, as a tensor over the slot's memory."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return area[offset : offset + nbytes].view(torch.from_numpy(np.empty(0, dtype)).dtype).view(shape)


def send(fd: int, message) -> None:
    """Write ``message`` to our own result pipe: its length, then its pickle (blocking while the pipe is full)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


class Inbox:
    """The main process's end of one worker's result pipe, read without ever blocking: bytes are gathered
    until a whole message is there, so a message cut short by its writer's death never blocks a read."""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, bytearray()
        os.set_blocking(fd, False)

    def read(self) -> list:
        """The whole messages that have arrived (possibly none)."""
        try:
            while chunk := os.read(self.fd, 1 << 20):
                self.buffer += chunk
        except BlockingIOError:
            pass
        messages = []
        while len(self.buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(self.buffer)
            end = HEADER.size + length
            if len(self.buffer) < end:
                break
            messages.append(pickle.loads(self.buffer[HEADER.size : end]))
            del self.buffer[:end]
        return messages


IDLE, DRAWING, SENDING = 0, 1, 2  # a worker's phase, which it writes into the ring's shared ``doing`` array
PHASES = {IDLE: "waiting for a task", DRAWING: "drawing", SENDING: "sending"}


def worker_loop(draw, slots, tasks, result_fd: int, read_fds: list[int], stop, parent: int, doing, i) -> None:
    """Worker i: draws the batches of ``tasks`` into their slots (``slots``: the ring's ``Slots``, images and
    targets) until told to stop or orphaned; writes its batch and phase into doing[2i : 2i + 2] (shared memory),
    which names it if it stalls."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # both reach the process group: the main process stops us
        signal.signal(signum, signal.SIG_IGN)
    for fd in read_fds:  # the read ends forked with us: once the main process closes its own, our write fails at once
        os.close(fd)
    torch.set_num_threads(1)  # one core per worker, as DataLoader's workers
    while not stop.value and os.getppid() == parent:  # else the main process died without closing us
        try:
            task = tasks.get(timeout=WATCHDOG_SECONDS)
        except queue.Empty:
            continue
        if task is None or stop.value:  # queued tasks are dropped once we are stopped
            return
        batch, slot = task
        doing[2 * i], doing[2 * i + 1] = batch, DRAWING
        try:
            message = (batch, slot, host_arrays(draw(batch, slots.images[slot]), slots.targets[slot]), None)
        except Exception as err:  # reported to the main process, which raises it
            message = (batch, slot, None, (f"{type(err).__name__}: {err}", traceback.format_exc()))
        doing[2 * i + 1] = SENDING
        try:
            send(result_fd, message)
        except BrokenPipeError:  # the main process has gone: nobody to report to
            return
        doing[2 * i + 1] = IDLE


def exit_description(code: int | None) -> str:
    """How a worker ended, from its exit code (negative: the signal that killed it)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (kill -9, or the kernel's out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}, exit code {code}{hint}"
    return f"exited unexpectedly with code {code}"


STATES = {"T": "stopped by a signal, as kill -STOP does", "t": "stopped by a debugger", "D": "waiting on a device"}


def process_state(pid: int) -> str:
    """What the kernel says a process is doing (Linux's /proc), in a few words; "" where unknown or running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return STATES.get(f.read().rpartition(")")[2].split()[0], "")
    except (OSError, IndexError):
        return ""
