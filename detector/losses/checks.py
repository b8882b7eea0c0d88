"""Input checks of the loss API, made once, at the public entry (``Strategy.__call__``), and the refusal of a
second derivative that a strategy cannot give (``first_order_only``).

Shapes, dtypes and devices only: nothing here reads a device value, so checking never synchronises
with the GPU. The layers below (strategy functions, kernel wrappers) trust their caller; a direct call
of a custom op still gets the op's own C++ checks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detector.data.targets import ListTargets, PackedTargets, PaddedTargets, Targets


def check_pred(pred: Tensor, batch_size: int | None = None) -> None:
    """Predictions must be floating [B, M, 4]; a clear error instead of garbage or a kernel crash."""
    if not isinstance(pred, Tensor):
        raise TypeError(f"pred must be a torch.Tensor, got {type(pred).__name__}")
    if not pred.is_floating_point():
        raise TypeError(f"pred must be a floating tensor (fp32/bf16/fp16/fp64), got dtype {pred.dtype}")
    if pred.dim() != 3 or pred.shape[-1] != 4:
        raise ValueError(f"pred must have shape [B, M, 4], got {list(pred.shape)}")
    if batch_size is not None and pred.shape[0] != batch_size:
        raise ValueError(f"pred has batch size {pred.shape[0]} but the targets (counts) have {batch_size} images")


def _check_tensor(value, what: str) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{what} must be a torch.Tensor, got {type(value).__name__} "
            "(detector.data.targets.make_targets builds targets from tensors, numpy arrays or lists)"
        )


def _check_counts(counts: Tensor) -> None:
    _check_tensor(counts, "targets.counts")
    if counts.dim() != 1:
        raise ValueError(f"targets.counts must have shape [B], got {list(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"targets.counts must be an integer tensor (any integer dtype), got dtype {counts.dtype}")


def _check_box_dtype(boxes: Tensor, what: str = "targets.boxes (target boxes)") -> None:
    if boxes.dtype == torch.bool or boxes.is_complex():
        raise TypeError(f"{what} must be integer or floating, got dtype {boxes.dtype}")


def _check_device(pred: Tensor, *others: Tensor) -> None:
    if any(t.device != pred.device for t in others):
        devices = ", ".join(str(t.device) for t in (pred, *others))
        raise ValueError(f"pred and the targets must be on one device, got {devices}")


def check_padded(pred: Tensor, boxes: Tensor, counts: Tensor) -> None:
    """Shape, dtype and device checks of padded targets against pred; no host synchronisation."""
    _check_counts(counts)
    check_pred(pred, counts.shape[0])
    _check_tensor(boxes, "targets.boxes")
    if boxes.dim() != 3 or boxes.shape[-1] != 4 or boxes.shape[:2] != pred.shape[:2]:
        raise ValueError(
            f"targets.boxes (target boxes) must have shape [B, M, 4] = {list(pred.shape)} like pred, "
            f"got {list(boxes.shape)}"
        )
    _check_box_dtype(boxes)
    _check_device(pred, boxes, counts)


def check_packed(pred: Tensor, boxes: Tensor, counts: Tensor) -> None:
    """Shape, dtype and device checks of packed targets against pred; no host synchronisation."""
    _check_counts(counts)
    check_pred(pred, counts.shape[0])
    _check_tensor(boxes, "targets.boxes")
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"targets.boxes (target boxes) must have shape [N, 4] (packed), got {list(boxes.shape)}")
    _check_box_dtype(boxes)
    _check_device(pred, boxes, counts)


def check_list(pred: Tensor, boxes: list[Tensor]) -> None:
    """Checks of list targets against pred: the per-image sizes are host integers, so M is checked too."""
    if isinstance(boxes, Tensor) or not isinstance(boxes, (list, tuple)):
        raise TypeError(f"targets.boxes must be a list of B tensors [n_i, 4], got {type(boxes).__name__}")
    check_pred(pred, len(boxes))
    for b, image_boxes in enumerate(boxes):
        what = f"targets.boxes[{b}] (target boxes of image {b})"
        _check_tensor(image_boxes, what)
        if image_boxes.dim() != 2 or image_boxes.shape[1] != 4:
            raise ValueError(f"{what} must have shape [n, 4], got {list(image_boxes.shape)}")
        if image_boxes.shape[0] > pred.shape[1]:
            raise ValueError(f"{what} has {image_boxes.shape[0]} boxes but pred has only {pred.shape[1]} slots")
        _check_box_dtype(image_boxes, what)
        _check_device(pred, image_boxes)


def check_targets(pred: Tensor, targets: Targets) -> None:
    """The public entry's check of pred against targets of any layout."""
    if isinstance(targets, ListTargets):
        check_list(pred, targets.boxes)
    elif isinstance(targets, PaddedTargets):
        check_padded(pred, *targets)
    elif isinstance(targets, PackedTargets):
        check_packed(pred, *targets)
    else:
        raise TypeError(
            f"targets must be ListTargets, PaddedTargets or PackedTargets (detector.data.targets.make_targets), "
            f"got {type(targets).__name__}"
        )


class _FirstOrderOnly(torch.autograd.Function):
    """The identity on the loss; its backward raises ``why`` under ``create_graph=True``."""

    @staticmethod
    def forward(ctx, loss: Tensor, why: str) -> Tensor:
        ctx.why = why
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        if torch.is_grad_enabled():
            raise RuntimeError(ctx.why)
        return grad, None


def first_order_only(loss: Tensor, why: str) -> Tensor:
    """``loss``, whose backward refuses ``create_graph=True`` with ``why``: for a strategy whose backward cannot
    be differentiated again, and would otherwise give no second derivative without a word."""
    return _FirstOrderOnly.apply(loss, why)
