"""Ctrl-C (SIGINT) and SIGTERM, which schedulers send before they kill: one way to stop, and one line.

Both stop a command as Python stops it on Ctrl-C, by an exception (KeyboardInterrupt, and ``Terminated``
for SIGTERM) that the command line prints as one line with exit status 130 or 143 (128 + the signal).
Within a training run's loop the first signal only asks for a stop, which the loop makes between two
steps, after a checkpoint (``DeferredInterrupt``); a second stops it at once. Once a stop is under way
every later signal is ignored, so that nothing interrupts the wind-down (closing the data workers and
TensorBoard's writer, the interpreter's exit) and nothing is printed after the one line.

A rank of detector.cli.launch learns of its launcher's death by ``LAUNCHER_LOST``, its parent-death signal
(detector/cli/main.py ``tie_to_launcher``): a stop as SIGTERM's, however often it comes. Linux sends it each time the
rank's parent thread exits, and a launcher killed with kill -9 passes the rank from thread to thread of its own as
they end: two or three signals, milliseconds apart, which as SIGTERMs would read as a second signal and abandon
the stop's checkpoint.

Handlers are installed on the main thread only: Python delivers signals there.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAUNCHER_LOST = signal.SIGUSR1  # a rank's parent-death signal: its launcher is gone


class Terminated(KeyboardInterrupt):
    """SIGTERM: a stop as Ctrl-C's (a KeyboardInterrupt, so that whatever stops on Ctrl-C stops on it)."""


def stop_exception(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class Handlers:
    """The SIGINT and SIGTERM handlers within a block, restored after it (``keep``: left in place)."""

    stopping = False  # shared by every block: once a stop is under way, later signals are ignored
    launcher_lost = False  # LAUNCHER_LOST came: the stop it asks for is SIGTERM's, asked once

    def __init__(self, keep: bool = False):
        self.keep, self.previous = keep, {}

    def __enter__(self):
        Handlers.stopping = False
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in STOP_SIGNALS}
            self.previous[LAUNCHER_LOST] = signal.signal(LAUNCHER_LOST, self.lost)
        return self

    def __exit__(self, *exc):
        if not self.keep:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)

    def handle(self, signum, frame):
        if Handlers.stopping:
            return
        Handlers.stopping = True
        raise stop_exception(signum)

    def lost(self, signum, frame):
        """LAUNCHER_LOST: SIGTERM's stop, the first time only, and not where a stop is already asked for (the launcher's
        death is no second signal of a user's)."""
        if Handlers.launcher_lost or getattr(self, "requested", None) is not None:
            return
        Handlers.launcher_lost = True
        self.handle(signal.SIGTERM, frame)


class CommandSignals(Handlers):
    """A command's handlers: the first SIGINT or SIGTERM raises where it lands (as Python's own SIGINT
    handler does), later ones are ignored. ``keep`` for the command line: the interpreter's exit runs after
    the block, where a signal would print a traceback after the command's last line; once a stop is under
    way the signals are then left ignored by the kernel (SIG_IGN), which the interpreter's finalization keeps,
    whereas it puts back the default action, death by the signal, in place of a Python handler (for
    LAUNCHER_LOST, whose default is death too, always: a command that ended has nothing to stop)."""

    def __enter__(self):
        Handlers.launcher_lost = False
        return super().__enter__()

    def __exit__(self, *exc):
        if self.keep:
            for signum in self.previous:
                if Handlers.stopping or signum == LAUNCHER_LOST:
                    signal.signal(signum, signal.SIG_IGN)
        super().__exit__(*exc)


class DeferredInterrupt(Handlers):
    """The training loop's handlers: the first signal only sets ``requested``, which the loop reads between
    two steps (``stop`` then gives the exception to raise); a second raises at once. A KeyboardInterrupt
    raised anywhere could land inside a library's bookkeeping, as TensorBoard's writer handing a scalar to
    its thread (``Queue.put``): that thread then never woke, and closing the writer waited for it for good."""

    def __enter__(self):
        self.requested = None  # the signal number of a stop asked for
        return super().__enter__()

    def handle(self, signum, frame):
        if self.requested is None and not Handlers.stopping:
            self.requested = signum
            return
        # the stop is the first signal's: its word and exit status (torchrun forwards SIGINT as SIGINT and SIGTERM as
        # SIGTERM, so a rank's second signal may be another kind than the launcher's own)
        super().handle(self.requested or signum, frame)

    def stop(self) -> KeyboardInterrupt:
        """The exception of the stop asked for; from now on signals are ignored."""
        Handlers.stopping = True
        return stop_exception(self.requested)
