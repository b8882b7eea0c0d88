"""``torchvision_padded``: ``torchvision.ops.generalized_box_iou_loss`` over every slot, then a mask.

The other way users call it: ``reduction="none"`` over [B, M, 4], then the per-box losses of valid slots
summed and divided by max(n, 1). The mask selects, it never multiplies (NaN * 0 is NaN), and padded
slots are zeroed before the call, so NaN there reaches neither the loss nor the gradient. No boolean
indexing of ours, yet the host still waits: torchvision assigns the intersection through a boolean mask
(``intsctk[mask] = ...`` in ``_loss_inter_union``), forward and backward. Dtypes as in ``torchvision``:
torchvision upcasts bf16/fp16 and integers to fp32 itself; the targets are cast to pred's compute dtype.
"""

import torch
from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.losses.geometry import compute_dtype
from detector.losses.registry import Strategy, register
from detector.losses.torchvision_concat import torchvision_unavailable


def giou_loss_torchvision_padded(pred: Tensor, targets: PaddedTargets) -> Tensor:
    from torchvision.ops import generalized_box_iou_loss  # optional dependency: imported on first use

    boxes, counts = targets  # [B, M, 4], [B]
    valid = torch.arange(pred.shape[1], device=pred.device) < counts[:, None]  # [B, M]
    safe_pred = torch.where(valid[..., None], pred, 0)
    safe_boxes = torch.where(valid[..., None], boxes.to(compute_dtype(pred)), 0)
    per_box = generalized_box_iou_loss(safe_pred, safe_boxes, reduction="none")  # [B, M]
    return torch.where(valid, per_box, 0).sum() / valid.sum().clamp(min=1)


register(
    Strategy(
        "torchvision_padded",
        "padded",
        giou_loss_torchvision_padded,
        "torchvision's generalized_box_iou_loss over every slot, reduction='none', then the validity mask",
        unavailable=lambda device: torchvision_unavailable(),
    )
)
