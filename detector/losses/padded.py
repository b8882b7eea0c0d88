"""``padded``: [B, M, 4] targets plus counts, a validity mask, one GIoU call over every slot.

A fixed number of kernels whatever the boxes, no host synchronisation; the cost is work on padded slots.
"""

import torch
from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.losses.geometry import giou_loss_per_box
from detector.losses.registry import Strategy, register


def giou_loss_padded(pred: Tensor, targets: PaddedTargets) -> Tensor:
    boxes, counts = targets  # [B, M, 4], [B]
    valid = torch.arange(pred.shape[1], device=pred.device) < counts[:, None]  # [B, M]
    # Select (never multiply): NaN in a padded slot must not reach the loss or the gradient.
    safe_pred = torch.where(valid[..., None], pred, 0)
    safe_boxes = torch.where(valid[..., None], boxes, 0)
    per_box = torch.where(valid, giou_loss_per_box(safe_pred, safe_boxes), 0)  # [B, M]
    return per_box.sum() / valid.sum().clamp(min=1)


register(Strategy("padded", "padded", giou_loss_padded, "padded targets + validity mask, one call"))
