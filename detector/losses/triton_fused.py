"""``triton``: one Triton kernel computes the loss, its gradient and the mean, in a single launch.

Forward is one launch over padded targets; it also writes d loss / d pred, so backward is one multiply
by ``grad_output``. Nothing waits for the host. The kernel, its launcher and its ``triton_op`` are in
detector/kernels/triton_giou.py; without a GPU it runs in the Triton interpreter (TRITON_INTERPRET=1).
"""

from torch import Tensor

from detector.kernels.triton_giou import giou_loss_triton, triton_unavailable
from detector.losses.registry import Strategy, register
from detector.targets import PaddedTargets


def giou_loss_triton_fused(pred: Tensor, targets: PaddedTargets) -> Tensor:
    boxes, counts = targets  # [B, M, 4], [B]
    return giou_loss_triton(pred, boxes, counts)


register(
    Strategy(
        "triton",
        "padded",
        giou_loss_triton_fused,
        "one Triton kernel: loss, gradient and mean in one launch",
        unavailable=triton_unavailable,
    )
)
