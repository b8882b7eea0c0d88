"""``cuda_fused``: the ``detector::giou_loss`` custom op, one thread per slot, padded slots selected to 0.

One kernel forward (loss, saved gradient and the reduction to the mean), one elementwise kernel
backward, no host synchronisation. Every slot is loaded and computed; padded ones are discarded by
selection, so NaN there never leaks. See detector/cuda_op.py and extensions/.
"""

from torch import Tensor

from detector.kernels import cuda_op
from detector.losses.registry import Strategy, register
from detector.targets import PaddedTargets


def giou_loss_cuda_fused(pred: Tensor, targets: PaddedTargets) -> Tensor:
    boxes, counts = targets  # [B, M, 4], [B]
    if not pred.is_cuda:
        cuda_op.note_cpu_kernel("cuda_fused")
    return cuda_op.giou_loss(pred, boxes, counts, skip_invalid=False)


register(
    Strategy(
        "cuda_fused",
        "padded",
        giou_loss_cuda_fused,
        "custom C++/CUDA op: one fused kernel per slot + one backward scale",
        unavailable=cuda_op.kernel_unavailable,
    )
)
