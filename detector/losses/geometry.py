"""The GIoU of matched box pairs, in plain PyTorch: the one formula every pure-PyTorch strategy calls."""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-7  # added to the union and enclosing-area denominators, as in torchvision


def compute_dtype(pred: Tensor) -> torch.dtype:
    """Arithmetic happens in at least fp32 (bf16/fp16 areas overflow or lose the overlap)."""
    return torch.promote_types(pred.dtype, torch.float32)


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
