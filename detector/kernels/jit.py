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

# The combiners the kernels hand tl.reduce for sums and maxima (a + b, maximum(a, b)); never called by the kernels. In
# the interpreter they are triton's own (those tl.sum and tl.max hand it), which it knows and reduces in numpy at once,
# where it calls a combiner of ours once an element in Python. Compiled, they are ours: torch.compile (triton_op)
# writes out the source of every @triton.jit function a kernel calls under the function's own name, and triton's are
# named _sum_combine and _elementwise_max, not what the kernels call them (tests/kernels/test_compiled_sources.py).
if triton is None:
    _add = _maximum = None
elif INTERPRETED:
    _add, _maximum = tl.standard._sum_combine, tl.standard._elementwise_max
else:

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _maximum(a, b):
        return tl.maximum(a, b)
