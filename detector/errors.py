"""The user's mistakes, as exceptions: the CLI prints them as one line (``error: ...``) and exits with 2.

A command or library function that detects a mistake the user can fix (a bad config value, a missing
file, an unknown name) raises a ``UserError`` subclass; anything else is a bug and keeps its traceback.

A thread's exception is no traceback either (``ThreadFailures``, the command's ``threading.excepthook``): whatever
waits on that thread's work says it in its own line.
"""

import errno
import os
import sys
import threading

# errors of the machine's files rather than of the code: a command ends on them in one line naming the file (a folder
# not writable, a full disk, a file where a folder was asked for: train.out_dir=notes.txt)
ENVIRONMENT = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST)


def refuse(err: Exception) -> int:
    """Print ``err`` as the one line a command refuses with (``error: ...``, its whitespace folded); returns the
    exit status for it, 2."""
    print(f"error: {said(err)}", file=sys.stderr)
    return 2


def said(err: BaseException) -> str:
    """``err``'s message on one line; an OSError's files as paths, where the library gave bytes (TensorBoard's event
    writer: ``[Errno 1] Operation not permitted: b'...'``)."""
    names = [getattr(err, "filename", None), getattr(err, "filename2", None)]
    if isinstance(err, OSError) and err.strerror and any(isinstance(name, bytes) for name in names):
        paths = [os.fsdecode(name) for name in names if name is not None]
        text = f"[Errno {err.errno}] {err.strerror}: " + " -> ".join(map(repr, paths))
    else:
        text = str(err)
    return " ".join(text.split())


class UserError(Exception):
    """A mistake the user can fix; its message is one line naming the bad thing."""


class ConfigError(UserError, ValueError):
    """A configuration that cannot be loaded: unknown key, wrong type, value out of range, bad override, a device this
    machine lacks."""


class PeerLost(UserError):
    """Another process of the run stopped (it died, or its machine did): this one cannot go on."""


class ThreadFailures:
    """A command's ``threading.excepthook`` within a block (``keep``: left in place, for the interpreter's exit). The
    exception that ends a thread, ours or one a library starts (DCP's file writers, TensorBoard's event writer), is
    kept, not printed: Python's hook prints its traceback, which interleaved with the command's line or came half
    printed after it. What waited on the thread's work says it in its own line: a save takes its writers' (``take``),
    TensorBoard's writer raises its thread's again where the loop writes. A failure that no line said by a command
    that ended well is one line (``unsaid``). ``debug`` (--debug): Python's hook prints every traceback as well."""

    kept: list[tuple[str, BaseException]] = []  # (thread name, exception), the process's: so is the hook

    def __init__(self, debug: bool = False, keep: bool = False):
        self.debug, self.keep, self.previous = debug, keep, None

    def __enter__(self):
        ThreadFailures.kept = []
        self.previous, threading.excepthook = threading.excepthook, self.hook
        return self

    def __exit__(self, *exc):
        if not self.keep:
            threading.excepthook = self.previous

    def hook(self, args) -> None:
        if args.exc_type is not SystemExit:  # a thread's sys.exit() is silent in Python's hook too
            ThreadFailures.kept.append((args.thread.name if args.thread else "a thread", args.exc_value))
        if self.debug:
            self.previous(args)

    @classmethod
    def take(cls, name: str) -> BaseException | None:
        """The first kept failure of a thread whose name holds ``name`` (Python names a thread after its target:
        ``Thread-3 (_write_files_from_queue)``), now its taker's to say; None where none failed."""
        for i, (thread, err) in enumerate(cls.kept):
            if name in thread:
                del cls.kept[i]
                return err
        return None

    @classmethod
    def unsaid(cls) -> list[str]:
        """One line for each kept failure, which no line has said, and forgets them."""
        lines = [f"warning: thread {thread} ended with {type(err).__name__}: {said(err)}" for thread, err in cls.kept]
        cls.kept = []
        return [f"{line} (its traceback: --debug)" for line in lines]
