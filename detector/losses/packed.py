"""``packed``: the ``detector::giou_loss_packed`` custom op over [N, 4] targets, a grid over the N boxes.

Each thread finds its box's image and slot from prefix sums of the counts computed on the device, so
the work grows with the number of boxes, not with B * M (bar a memset of the [B, M, 4] gradient).
Predictions stay [B, M, 4]. See detector/ops.py and extensions/.
"""

from torch import Tensor

from detector import ops
from detector.data import PackedTargets
from detector.losses.reference import check_pred
from detector.losses.registry import Strategy, register


def giou_loss_packed(pred: Tensor, targets: PackedTargets) -> Tensor:
    boxes, counts = targets  # [N, 4], [B]
    check_pred(pred, counts.shape[0])  # Python errors before the op, as the other strategies give them
    if not pred.is_cuda:
        ops.note_cpu_kernel("packed")
    return ops.giou_loss_packed(pred, boxes, counts)


register(
    Strategy(
        "packed",
        "packed",
        giou_loss_packed,
        "custom C++/CUDA op over packed [N, 4] targets: a grid over the valid boxes",
        unavailable=ops.kernel_unavailable,
    )
)
