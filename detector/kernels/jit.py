"""Triton, imported once for every Triton kernel of the package: the loss's (triton_giou.py) and the model's conv
blocks (detector/model/*_kernel.py).

``triton`` is the module and ``tl`` its language, or both None where it does not import (e.g. macOS or Windows: the
strategy and the fused blocks stay listed, with the reason they cannot run). ``INTERPRETED``: the kernels run through
Triton's interpreter (numpy on the host), because TRITON_INTERPRET=1 was set before this module was imported: the CLI
and the tests' conftest.py set it (and say so) where there is no GPU; importing this module sets nothing.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:
    triton = tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # kernels run as numpy on the host
