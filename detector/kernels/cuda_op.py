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

Forward (one kernel on CUDA) returns ``(loss, inv_count)`` (packed: ``(loss, inv_count, offsets)``) and
writes no gradient buffer:
    loss       0-dim, compute dtype: sum over valid (b, j) of (1 - GIoU) / max(n_valid, 1)
    inv_count  0-dim, compute dtype: 1 / max(n_valid, 1)
    offsets    packed only, int64 [B]: C[b + 1], the inclusive prefix sums of the clamped counts
Backward (``giou_loss_backward`` / ``giou_loss_packed_backward``, one kernel on CUDA) recomputes the
gradient from pred, target and counts (packed: the forward's offsets, so the counts are scanned once per
step, not twice), which the autograd saves by reference (no copies), and writes every
slot of grad_pred ([B, M, 4] contiguous, pred's dtype): exactly 0 on padded slots, which it never reads
(NaN there never leaks), ``d(1 - GIoU)/d pred * grad_output * inv_count`` on valid ones. Nothing reads a
device value on the host. A backward with ``create_graph=True`` raises (the backward kernel's gradient has
no graph: a second derivative would silently be 0).

Counts outside [0, M] are clamped to [0, M], by the CPU and the CUDA kernels alike (the GPU cannot check
them without a host synchronisation): the loss is the loss of the clamped counts. Packed layout: row i of
the N target rows belongs to the image b with C[b] <= i < C[b + 1], C the prefix sums of the clamped
counts. Rows at or past C[B] (N > sum) are ignored; when N < C[B] the boxes that would lie past row N are
absent, and the loss averages over the min(N, C[B]) boxes present. Nothing reads past row N or slot M.
On CUDA the forward's prefix sums come from every block's own scan of the counts for batches of up to
``block_scan_max_batch`` images (default 2048, at most 4096: the arithmetic is in extensions/giou_op.cpp),
from block sums for larger ones (each block adds up its own images' counts and the sums of the blocks
before it, in the same kernel); the CPU kernel ignores it. The backward clamps
the offsets it is given as the counts are clamped (each image's rows within [0, N), at most M of them), so
no offsets make it read out of bounds.
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

    Dtypes as the module docstring lists. ``skip_invalid``: on CUDA, the forward loads and computes the
    valid slots only (``cuda_conditional``) instead of every slot, padded ones then selected to 0
    (``cuda_fused``); same result, same backward. Returns the 0-dim loss (fp64 for fp64 pred, else fp32).
    """
    _require_extension()
    return torch.ops.detector.giou_loss.default(pred, target, counts, skip_invalid)[0]


def giou_loss_packed(pred: Tensor, target: Tensor, counts: Tensor, block_scan_max_batch: int | None = None) -> Tensor:
    """Mean GIoU loss, packed layout: pred [B, M, 4], target [N, 4] (image 0's boxes first), counts [B].

    Box i of image b (in target order) is compared with pred[b, i]; N = sum(counts), or see the module
    docstring for other N. ``block_scan_max_batch``: the op's default unless given (tests pick each path of
    the prefix sums with it). Returns the 0-dim loss (fp64 for fp64 pred, else fp32).
    """
    _require_extension()
    op = torch.ops.detector.giou_loss_packed.default
    if block_scan_max_batch is None:
        return op(pred, target, counts)[0]
    return op(pred, target, counts, block_scan_max_batch)[0]


if _C is not None:
    # Trailing arguments left at the schema's default may be dropped before a fake kernel is called: *_.

    @torch.library.register_fake("detector::giou_loss")
    def _giou_loss_fake(pred, target, counts, *_):
        return _loss_outputs(pred)

    @torch.library.register_fake("detector::giou_loss_packed")
    def _giou_loss_packed_fake(pred, target, counts, *_):
        return *_loss_outputs(pred), counts.new_empty(counts.shape, dtype=torch.int64)

    @torch.library.register_fake("detector::giou_loss_backward")
    def _giou_loss_backward_fake(grad_output, pred, target, counts, inv_count):
        return pred.new_empty(pred.shape)  # contiguous, pred's dtype

    @torch.library.register_fake("detector::giou_loss_packed_backward")
    def _giou_loss_packed_backward_fake(grad_output, pred, target, offsets, inv_count):
        return pred.new_empty(pred.shape)

    def _loss_outputs(pred):
        loss = pred.new_empty((), dtype=torch.promote_types(pred.dtype, torch.float32))  # the compute dtype
        return loss, loss.new_empty(())
