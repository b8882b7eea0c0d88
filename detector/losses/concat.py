"""``concat``: the valid boxes of all images concatenated, then one GIoU call over them.

Two concatenations of B slices each (host-side, no synchronisation) and then a single batch of kernels.
"""

import torch
from torch import Tensor

from detector.data.targets import ListTargets
from detector.losses.geometry import compute_dtype, giou_loss_per_box
from detector.losses.registry import Strategy, register


def giou_loss_concat(pred: Tensor, targets: ListTargets) -> Tensor:
    counts = [boxes.shape[0] for boxes in targets.boxes]
    if not sum(counts):  # no box at all (or no image): 0, still connected to the graph
        return pred[:, :0].sum().to(compute_dtype(pred))
    valid_pred = torch.cat([pred[b, :n] for b, n in enumerate(counts)])  # [N, 4]
    valid_target = torch.cat(targets.boxes)  # [N, 4]
    return giou_loss_per_box(valid_pred, valid_target).sum() / sum(counts)


register(Strategy("concat", "list", giou_loss_concat, "valid boxes of all images concatenated, one call"))
