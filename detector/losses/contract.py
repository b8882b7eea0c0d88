"""The GIoU loss contract, written once, and its pure-PyTorch reference implementation."""

from __future__ import annotations

import torch
from torch import Tensor

from detector.data.targets import Targets, to_padded
from detector.losses.checks import check_padded, check_targets
from detector.losses.geometry import giou_loss_per_box


def giou_loss_reference(pred: Tensor, targets: Targets | Tensor, counts: Tensor | None = None) -> Tensor:
    """Mean GIoU loss over the valid boxes of a batch: the contract every strategy implements.

    Args:
        pred: [B, M, 4] predicted boxes, xyxy (x1, y1, x2, y2) in pixels; fp32, bf16, fp16 or fp64.
        targets: target boxes in any layout (ListTargets, PaddedTargets, PackedTargets), or a padded
            [B, M, 4] tensor with ``counts`` given; uint8, other integer or floating dtypes.
        counts: [B] integer, only with a padded tensor: image b has valid boxes in slots j < counts[b]
            (clamped to [0, M], see below).

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
        - No valid box at all, B = 0 or M = 0 included: the loss is 0, still connected to the graph
          (backward gives zeros).
        - Gradients at ties of min/max are PyTorch autograd's (half to each side).

    Values in valid slots (padded slots may hold anything, see above):
        - Coordinates must be finite with |x| <= 2**62 (about 4.6e18 px): widths stay <= 2**63, so
          areas and their sums stay below fp32's largest value (2**128). There every strategy's loss
          and gradient match this reference on the same values to fp32 rounding (integer targets
          beyond 2**24 and fp64 targets are rounded to fp32 first).
        - Beyond 2**62 fp32 areas may overflow: the loss and gradient are not specified (NaN or inf
          where this fp64 reference is finite).
        - A NaN or +-inf coordinate in a valid slot of pred or of the targets makes the loss NaN or
          +-inf in every strategy. That box's gradient is not specified (autograd and the kernels
          differ); every other box's gradient is as without it.

    Targets, hand-built or from ``detector.data.targets.make_targets``, get one behaviour in every strategy
    (a strategy's ``__call__`` checks shapes, dtypes and devices once, never device values):
        - ``targets`` is a ListTargets, PaddedTargets or PackedTargets; anything else, a plain tuple
          included, is a TypeError naming ``targets``. A strategy takes only its ``layout`` (TypeError).
        - Boxes: any integer or floating dtype, read in their own dtype; bool and complex: TypeError.
        - Counts: [B], any integer dtype (uint8 included); bool and floating: TypeError.
        - Counts outside [0, M] are CLAMPED to [0, M] by every strategy and by this reference: a GPU
          cannot check them without a host synchronisation. A count of -3 means no box, M + 5 means M.
        - Packed layout: image b's boxes are rows offset[b] <= i < offset[b + 1] of the [N, 4] boxes,
          offset the prefix sums of the clamped counts, and N must equal their sum. Otherwise the loss
          is undefined: the host-side checks (this reference, ``to_padded``) raise ValueError; device
          kernels never read or write out of bounds.
        - List layout: the per-image sizes n_i are host integers, so an image with more than M boxes
          is refused (ValueError), not clamped.
        - pred and every target tensor on one device, else ValueError naming the devices.
    """
    if isinstance(targets, Tensor):
        if counts is None:
            raise ValueError("counts is required when targets is a padded [B, M, 4] tensor")
        check_padded(pred, targets, counts)
        boxes = targets
    else:
        check_targets(pred, targets)
        boxes, counts = to_padded(targets, pred.shape[1])
    max_boxes = pred.shape[1]
    counts = counts.long().clamp(0, max_boxes)  # the contract's clamp (a GPU cannot check counts)
    valid = torch.arange(max_boxes, device=pred.device) < counts[:, None]  # [B, M]
    # Select (never multiply) so that NaN in padded slots cannot reach the loss or the gradient.
    safe_pred = torch.where(valid[..., None], pred, 0)
    safe_boxes = torch.where(valid[..., None], boxes, 0)
    per_box = torch.where(valid, giou_loss_per_box(safe_pred, safe_boxes), 0)  # [B, M]
    return per_box.sum() / valid.sum().clamp(min=1)
