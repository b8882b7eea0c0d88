"""``cuda_fused``: the ``detector::giou_loss`` custom op over every slot, padded ones selected to 0.

One kernel forward (the loss and its reduction to the mean; no gradient buffer), one kernel backward, no
host synchronisation. The forward loads and computes every slot, 16 bytes at a time (that is what this
strategy measures); padded ones are discarded by selection, so NaN there never leaks. The backward, like
every backward of the op, recomputes the gradient of the valid slots and writes zeros to the padded ones
without reading them. See detector/kernels/cuda_op.py and extensions/.
"""

from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.kernels import cuda_op
from detector.losses.registry import Strategy, register


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
        "custom C++/CUDA op: one kernel over every slot forward, one backward",
        unavailable=cuda_op.kernel_unavailable,
    )
)
