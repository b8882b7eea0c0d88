"""``cuda_conditional``: the ``cuda_fused`` kernel, but threads of padded slots skip loads and arithmetic.

Same op (``skip_invalid=True``), same result; the question it answers is whether skipping the work of
padded slots pays (it saves their reads, not their gradient writes). See detector/bench_kernels.py.
"""

from torch import Tensor

from detector import ops
from detector.data import PaddedTargets
from detector.losses.reference import check_padded
from detector.losses.registry import Strategy, register


def giou_loss_cuda_conditional(pred: Tensor, targets: PaddedTargets) -> Tensor:
    boxes, counts = targets  # [B, M, 4], [B]
    check_padded(pred, boxes, counts)  # Python errors before the op, as the other strategies give them
    if not pred.is_cuda:
        ops.note_cpu_kernel("cuda_conditional")
    return ops.giou_loss(pred, boxes, counts, skip_invalid=True)


register(
    Strategy(
        "cuda_conditional",
        "padded",
        giou_loss_cuda_conditional,
        "custom C++/CUDA op: padded slots skip loads and arithmetic",
        unavailable=ops.kernel_unavailable,
    )
)
