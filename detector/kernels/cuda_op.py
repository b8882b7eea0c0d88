"""The ``detector::giou_loss`` custom ops (C++/CUDA in ``extensions/``): typed wrappers and fake kernels.

The schema is defined once, in C++ (``extensions/giou_op.cpp``); each op has a CPU kernel and, in a
CUDA build, a CUDA kernel, and its autograd is C++ too (``extensions/giou_autograd.cpp``: no Python
runs in forward or backward). Importing this module loads ``detector._C`` and registers the fake
kernels (for ``torch.compile``). The loss is the contract of
``detector.losses.giou_loss_reference``. The wrappers trust their caller (``detector.losses.Strategy``
checks the inputs once); a direct call of ``torch.ops.detector.*`` gets the op's own C++ checks.

Dtypes (one list, ``extensions/giou_dtypes.h``): pred fp64/fp32/bf16/fp16; target any of those or
uint8/int8/int16/int32/int64; counts uint8/int8/int16/int32/int64; any strides. Arithmetic in the
compute dtype: fp64 for fp64 predictions (exact to the fp64 reference but for rounding order), else fp32.

Forward (one kernel on CUDA) returns ``(loss, grad_sum, inv_count)``:
    loss       0-dim, compute dtype: sum over valid (b, j) of (1 - GIoU) / max(n_valid, 1)
    grad_sum   [B, M, 4] contiguous, pred's dtype: d(sum of the per-box losses) / d pred; exactly 0 on
               padded slots, whatever they hold (NaN included)
    inv_count  0-dim, compute dtype: 1 / max(n_valid, 1)
Backward (one elementwise kernel) is ``grad_sum * (grad_output * inv_count)``: the gradient is computed
in the forward and only scaled afterwards; nothing reads a device value on the host. A backward with
``create_graph=True`` raises (grad_sum has no graph: a second derivative would silently be 0).

Counts outside [0, M] are clamped to [0, M], by the CPU and the CUDA kernels alike (the GPU cannot check
them without a host synchronisation): the loss is the loss of the clamped counts. Packed layout: row i of
the N target rows belongs to the image b with C[b] <= i < C[b + 1], C the prefix sums of the clamped
counts. Rows at or past C[B] (N > sum) are ignored; when N < C[B] the boxes that would lie past row N are
absent, and the loss averages over the min(N, C[B]) boxes present. Nothing reads past row N or slot M.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

BUILD_HINT = "the detector._C extension is not built: run `make setup` (or `pip install --no-build-isolation -e .`)"

try:
    from detector import _C  # registers torch.ops.detector.*
except ImportError:
    _C = None


def kernel_unavailable(device: torch.device) -> str | None:
    """Why the custom ops cannot run on ``device`` (a Strategy's ``unavailable``), or None if they can."""
    if _C is None:
        return BUILD_HINT
    if device.type == "cuda" and not _C.WITH_CUDA:
        return (
            "detector._C was built without CUDA (torch without CUDA or no nvcc at build time): "
            "rebuild it where both are present with `make setup`"
        )
    if device.type not in ("cpu", "cuda"):
        return f"detector._C has no {device.type} kernel"
    return None


def _require_extension() -> None:
    if _C is None:
        raise RuntimeError(BUILD_HINT)


_cpu_note_shown = False


def note_cpu_kernel(strategy: str) -> None:
    """Say once per process that a cuda_* strategy is being served by the op's CPU kernel."""
    global _cpu_note_shown
    if not _cpu_note_shown:
        _cpu_note_shown = True
        build = "a CUDA build" if _C is not None and _C.WITH_CUDA else "a CPU-only build"
        warnings.warn(
            f"strategy {strategy!r} (and the other custom-op strategies) run on the CPU kernel of "
            f"detector::giou_loss for CPU tensors ({build} of detector._C)",
            stacklevel=4,  # the caller of the strategy
        )


def giou_loss(pred: Tensor, target: Tensor, counts: Tensor, skip_invalid: bool = False) -> Tensor:
    """Mean GIoU loss, padded layout: pred, target [B, M, 4], counts [B]; slot j of image b valid iff j < counts[b].

    Dtypes as the module docstring lists. ``skip_invalid``: on CUDA, threads of padded slots skip their
    loads and arithmetic (``cuda_conditional``) instead of computing and selecting 0 (``cuda_fused``); same
    result. Returns the 0-dim loss (fp64 for fp64 pred, else fp32).
    """
    _require_extension()
    return torch.ops.detector.giou_loss.default(pred, target, counts, skip_invalid)[0]


def giou_loss_packed(pred: Tensor, target: Tensor, counts: Tensor) -> Tensor:
    """Mean GIoU loss, packed layout: pred [B, M, 4], target [N, 4] (image 0's boxes first), counts [B].

    Box i of image b (in target order) is compared with pred[b, i]; N = sum(counts), or see the module
    docstring for other N. Returns the 0-dim loss (fp64 for fp64 pred, else fp32).
    """
    _require_extension()
    return torch.ops.detector.giou_loss_packed.default(pred, target, counts)[0]


if _C is not None:

    @torch.library.register_fake("detector::giou_loss")
    def _giou_loss_fake(pred, target, counts, skip_invalid=False):
        return _forward_outputs(pred)

    @torch.library.register_fake("detector::giou_loss_packed")
    def _giou_loss_packed_fake(pred, target, counts):
        return _forward_outputs(pred)

    @torch.library.register_fake("detector::giou_loss_backward")
    def _giou_loss_backward_fake(grad_output, grad_sum, inv_count):
        return grad_sum.new_empty(grad_sum.shape)

    def _forward_outputs(pred):
        scalar = pred.new_empty((), dtype=torch.promote_types(pred.dtype, torch.float32))  # the compute dtype
        return scalar, pred.new_empty(pred.shape), scalar.new_empty(())
