"""``packed``: the ``detector::giou_loss_packed`` custom op over [N, 4] targets, a grid over the N boxes.

Each thread finds its box's image and slot from prefix sums of the counts computed on the device (by
every block itself for small batches, from per-block sums for large ones), so the forward's work grows
with the number of boxes, not with B * M. Predictions stay [B, M, 4]; the backward is one kernel over
all B * M slots, writing 0 or the gradient of the packed row of each slot. See
detector/kernels/cuda_op.py and extensions/.
"""

from torch import Tensor

from detector.data.targets import PackedTargets
from detector.kernels import cuda_op
from detector.losses.registry import Strategy, register


def giou_loss_packed(pred: Tensor, targets: PackedTargets) -> Tensor:
    boxes, counts = targets  # [N, 4], [B]
    if not pred.is_cuda:
        cuda_op.note_cpu_kernel("packed")
    return cuda_op.giou_loss_packed(pred, boxes, counts)


register(
    Strategy(
        "packed",
        "packed",
        giou_loss_packed,
        "custom C++/CUDA op over packed [N, 4] targets: a grid over the valid boxes",
        unavailable=cuda_op.kernel_unavailable,
    )
)
