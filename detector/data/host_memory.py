"""The host's memory, and the one-line refusal of what would not fit in it: the loader checks its ring of slots
with it, and detector/train/observe/memory_estimate.py a whole command's estimate."""

from __future__ import annotations

from detector.errors import UserError


class MemoryRefusal(UserError, MemoryError):
    """What a run would allocate does not fit the memory available: refused before allocating it."""


GIB = 2**30


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (/proc/meminfo's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# What a command checks is a floor: the backward's temporaries, the allocator's slack and the interpreter with its
# libraries (about 1 GiB a process) come on top, and the rest of the machine needs room too. Using all that is
# available heads for the kernel's out-of-memory killer: a command may take this share of it
HOST_SHARE = 2 / 3


def check_memory(subject: str, needed: int, hint: str, detail: str = "") -> None:
    """Refuse in one line when ``needed`` bytes exceed HOST_SHARE of the machine's available memory (unknown: no
    check): "<subject> <needed> GiB of memory<detail>, but this machine has ... available ...: <hint>"."""
    available = available_memory()
    if available is not None and needed > available * HOST_SHARE:
        raise MemoryRefusal(
            f"{subject} {needed / GIB:.1f} GiB of memory{detail}, but this machine has {available / GIB:.1f} GiB "
            f"available (MemAvailable), of which a command may take 2/3, {available * HOST_SHARE / GIB:.1f} GiB: "
            f"{hint}"
        )
