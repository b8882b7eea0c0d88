"""``loop``: one GIoU call per image, on that image's [n_i, 4] targets.

The simplest correct code and the slowest: about 20 small kernels per image, so B x 20 launches.
"""

from torch import Tensor

from detector.data.targets import ListTargets
from detector.losses.geometry import compute_dtype, giou_loss_per_box
from detector.losses.registry import Strategy, register


def giou_loss_loop(pred: Tensor, targets: ListTargets) -> Tensor:
    # An empty slice keeps the loss connected to the graph with no box at all (NaN-safe, unlike 0 * pred.sum()).
    total = pred[:, :0].sum().to(compute_dtype(pred))
    n_valid = 0
    for b, boxes in enumerate(targets.boxes):  # boxes: [n_b, 4]
        n = boxes.shape[0]
        if n:
            total = total + giou_loss_per_box(pred[b, :n], boxes).sum()
            n_valid += n
    return total / max(n_valid, 1)


register(Strategy("loop", "list", giou_loss_loop, "per-image Python loop over [n_i, 4] targets"))
