"""The user's mistakes, as exceptions: the CLI prints them as one line (``error: ...``) and exits with 2.

A command or library function that detects a mistake the user can fix (a bad config value, a missing
file, an unknown name) raises a ``UserError`` subclass; anything else is a bug and keeps its traceback.
"""

import sys


def refuse(err: Exception) -> int:
    """Print ``err`` as the one line a command refuses with (``error: ...``, its whitespace folded); returns the
    exit status for it, 2."""
    print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
    return 2


class UserError(Exception):
    """A mistake the user can fix; its message is one line naming the bad thing."""


class ConfigError(UserError, ValueError):
    """A configuration that cannot be loaded: unknown key, wrong type, value out of range, bad override, a device this
    machine lacks."""
