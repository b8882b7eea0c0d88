"""``cuda_conditional``: the ``cuda_fused`` kernel, but threads of padded slots skip loads and arithmetic.

Same op (``skip_invalid=True``), same result, same backward; the question it answers is whether skipping
the work of padded slots pays: its forward reads only the valid boxes (and the counts), so it may run
below the byte floor of detector/bench/kernels.py, which counts every slot.
"""

from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.kernels import cuda_op
from detector.losses.registry import Strategy, register


def giou_loss_cuda_conditional(pred: Tensor, targets: PaddedTargets) -> Tensor:
    boxes, counts = targets  # [B, M, 4], [B]
    if not pred.is_cuda:
        cuda_op.note_cpu_kernel("cuda_conditional")
    return cuda_op.giou_loss(pred, boxes, counts, skip_invalid=True)


register(
    Strategy(
        "cuda_conditional",
        "padded",
        giou_loss_cuda_conditional,
        "custom C++/CUDA op: padded slots skip loads and arithmetic",
        unavailable=cuda_op.kernel_unavailable,
    )
)
