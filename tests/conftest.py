"""Shared test set-up: the Triton interpreter where there is no GPU, dynamo's recompile limit, a bound on tests
that could hang, and ``--strategy NAME`` (the contract grid on one strategy, a user's own included)."""

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Before detector.kernels.triton_giou is imported (it reads the variable once): the triton strategy's
    # kernel then runs as numpy on the CPU, so its tests run here too.
    os.environ["TRITON_INTERPRET"] = "1"
    print("no CUDA device: Triton kernels run in the interpreter (TRITON_INTERPRET=1)")

# The grid compiles the `compiled` strategy once per (dtype, shape) variant; keep them all compiled
# instead of letting dynamo fall back to eager after its default 8 recompilations.
torch._dynamo.config.recompile_limit = 64


ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption(
        "--strategy",
        action="append",
        default=[],
        metavar="NAME",
        help="run tests/losses/test_strategies.py's contract grid on this strategy only: a registered name or "
        "my_module:my_loss, a loss in my_module.py (the folder pytest runs from, or PYTHONPATH); repeatable",
    )


def pytest_configure(config):
    """``--strategy`` names that no strategy answers to are a usage error, before any test is collected."""
    if not config.getoption("strategy", default=None):
        return
    from detector.errors import UserError
    from detector.losses import get_strategy

    for name in config.getoption("strategy"):
        try:
            get_strategy(name)
        except (KeyError, UserError) as err:
            raise pytest.UsageError(f"--strategy {name}: {err.args[0]}") from None


def child_env(**overrides: str) -> dict[str, str]:
    """The environment of a child Python process that imports this tree's detector: the repository first on
    PYTHONPATH, then whatever was there (packages a machine provides that way, e.g. wheels unpacked to a
    folder), and ``overrides``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **overrides}


@contextlib.contextmanager
def fails_after(seconds: int):
    """A hang inside the block fails the test after ``seconds`` (SIGALRM) instead of blocking the suite."""

    def hung(signum, frame):
        raise TimeoutError(f"the test hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
