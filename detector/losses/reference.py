"""The GIoU loss contract, written once, and its pure-PyTorch reference implementation."""

from __future__ import annotations

import torch
from torch import Tensor

from detector.data import Targets, to_padded

EPS = 1e-7  # added to the union and enclosing-area denominators, as in torchvision


def compute_dtype(pred: Tensor) -> torch.dtype:
    """Arithmetic happens in at least fp32 (bf16/fp16 areas overflow or lose the overlap)."""
    return torch.promote_types(pred.dtype, torch.float32)


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


def check_padded(pred: Tensor, boxes: Tensor, counts: Tensor) -> None:
    """Shape, dtype and device checks of padded targets against pred; no host synchronisation."""
    check_pred(pred, counts.shape[0] if counts.dim() == 1 else None)
    if boxes.dim() != 3 or boxes.shape[-1] != 4 or boxes.shape[:2] != pred.shape[:2]:
        raise ValueError(f"target boxes must have shape {list(pred.shape)} like pred, got {list(boxes.shape)}")
    if counts.dim() != 1:
        raise ValueError(f"counts must have shape [B], got {list(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"counts must be an integer tensor, got dtype {counts.dtype}")
    if boxes.dtype == torch.bool or boxes.is_complex():
        raise TypeError(f"target boxes must be integer or floating, got dtype {boxes.dtype}")
    if not (pred.device == boxes.device == counts.device):
        raise ValueError(
            f"pred, target boxes and counts must be on one device, got {pred.device}, {boxes.device}, {counts.device}"
        )


def giou_loss_per_box(pred: Tensor, target: Tensor) -> Tensor:
    """1 - GIoU for boxes [..., 4] xyxy, torchvision's formula, in the compute dtype; shape [...]."""
    dtype = compute_dtype(pred)
    x1, y1, x2, y2 = pred.to(dtype).unbind(-1)
    x1g, y1g, x2g, y2g = target.to(dtype).unbind(-1)
    xi1, yi1 = torch.maximum(x1, x1g), torch.maximum(y1, y1g)
    xi2, yi2 = torch.minimum(x2, x2g), torch.minimum(y2, y2g)
    overlaps = (xi2 > xi1) & (yi2 > yi1)
    inter = torch.where(overlaps, (xi2 - xi1) * (yi2 - yi1), 0)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + EPS)
    xc1, yc1 = torch.minimum(x1, x1g), torch.minimum(y1, y1g)
    xc2, yc2 = torch.maximum(x2, x2g), torch.maximum(y2, y2g)
    enclosing = (xc2 - xc1) * (yc2 - yc1)
    return 1 - (iou - (enclosing - union) / (enclosing + EPS))


def giou_loss_reference(pred: Tensor, targets: Targets | Tensor, counts: Tensor | None = None) -> Tensor:
    """Mean GIoU loss over the valid boxes of a batch: the contract every strategy implements.

    Args:
        pred: [B, M, 4] predicted boxes, xyxy (x1, y1, x2, y2) in pixels; fp32, bf16, fp16 or fp64.
        targets: target boxes in any layout (ListTargets, PaddedTargets, PackedTargets), or a padded
            [B, M, 4] tensor with ``counts`` given; uint8, other integer or floating dtypes.
        counts: [B] integer, only with a padded tensor: image b has valid boxes in slots j < counts[b].

    Returns:
        A 0-dim tensor in the compute dtype (fp32, or fp64 for fp64 predictions):

            loss = sum over valid (b, j) of (1 - GIoU(pred[b, j], target[b, j])) / max(n_valid, 1)

        with slot j of image b valid iff j < counts[b] (validity comes from the counts, never from
        a coordinate sentinel), and GIoU by torchvision's formula (``generalized_box_iou_loss``):

            inter    = (min(x2, x2g) - max(x1, x1g)) * (min(y2, y2g) - max(y1, y1g)) if both > 0 else 0
            union    = area(pred) + area(target) - inter
            iou      = inter / (union + eps)
            enclose  = (max(x2, x2g) - min(x1, x1g)) * (max(y2, y2g) - min(y1, y1g))
            GIoU     = iou - (enclose - union) / (enclose + eps),   eps = 1e-7

    Contract details every strategy honours:
        - Arithmetic in at least fp32 whatever the input dtypes (uint8 areas wrap past 255; fp16
          areas overflow). The gradient reaches ``pred`` in its own dtype.
        - Padded slots never reach the loss or the gradient, even if they hold NaN or inf: their
          gradient is exactly 0.
        - No valid box at all: the loss is 0, still connected to the graph (backward gives zeros).
        - Gradients at ties of min/max are PyTorch autograd's (half to each side).

    The reference validates counts on the host (0 <= counts[b] <= M), which synchronises with the
    device; strategies skip that check in their hot path, and targets built by
    ``detector.data.make_targets`` satisfy it by construction.
    """
    if isinstance(targets, Tensor):
        if counts is None:
            raise ValueError("counts is required when targets is a padded [B, M, 4] tensor")
        boxes = targets
    else:
        check_pred(pred, targets.batch_size)
        boxes, counts = to_padded(targets, pred.shape[1])
    check_padded(pred, boxes, counts)
    max_boxes = pred.shape[1]
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > max_boxes):
        low, high = int(counts.min()), int(counts.max())
        raise ValueError(f"counts must lie in [0, {max_boxes}] (the number of slots M), got [{low}, {high}]")
    valid = torch.arange(max_boxes, device=pred.device) < counts[:, None]  # [B, M]
    # Select (never multiply) so that NaN in padded slots cannot reach the loss or the gradient.
    safe_pred = torch.where(valid[..., None], pred, 0)
    safe_boxes = torch.where(valid[..., None], boxes, 0)
    per_box = torch.where(valid, giou_loss_per_box(safe_pred, safe_boxes), 0)  # [B, M]
    return per_box.sum() / valid.sum().clamp(min=1)
