"""``cuda_fused``: the ``detector::giou_loss`` custom op, one thread per slot, padded slots selected to 0.

One kernel forward (loss, saved gradient and the reduction to the mean), one elementwise kernel
backward, no host synchronisation. Every slot is loaded and computed; padded ones are discarded by
selection, so NaN there never leaks. See detector/ops.py and extensions/.
"""

from torch import Tensor

from detector import ops
from detector.data import PaddedTargets
from detector.losses.reference import check_padded
from detector.losses.registry import Strategy, register


def giou_loss_cuda_fused(pred: Tensor, targets: PaddedTargets) -> Tensor:
    boxes, counts = targets  # [B, M, 4], [B]
    check_padded(pred, boxes, counts)  # Python errors before the op, as the other strategies give them
    if not pred.is_cuda:
        ops.note_cpu_kernel("cuda_fused")
    return ops.giou_loss(pred, boxes, counts, skip_invalid=False)


register(
    Strategy(
        "cuda_fused",
        "padded",
        giou_loss_cuda_fused,
        "custom C++/CUDA op: one fused kernel per slot + one backward scale",
        unavailable=ops.kernel_unavailable,
    )
)
