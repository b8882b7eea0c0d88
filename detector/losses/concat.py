"""``concat``: the valid boxes of all images concatenated, then one GIoU call over them.

Two concatenations of B slices each (host-side, no synchronisation) and then a single batch of kernels.
"""

import torch
from torch import Tensor

from detector.data import ListTargets
from detector.losses.reference import check_pred, giou_loss_per_box
from detector.losses.registry import Strategy, register


def giou_loss_concat(pred: Tensor, targets: ListTargets) -> Tensor:
    check_pred(pred, targets.batch_size)
    counts = [boxes.shape[0] for boxes in targets.boxes]
    if max(counts, default=0) > pred.shape[1]:
        raise ValueError(f"an image has {max(counts)} target boxes but pred has only {pred.shape[1]} slots")
    valid_pred = torch.cat([pred[b, :n] for b, n in enumerate(counts)])  # [N, 4]
    valid_target = torch.cat(targets.boxes) if targets.boxes else pred.new_zeros(0, 4)  # [N, 4]
    return giou_loss_per_box(valid_pred, valid_target).sum() / max(sum(counts), 1)


register(Strategy("concat", "list", giou_loss_concat, "valid boxes of all images concatenated, one call"))
