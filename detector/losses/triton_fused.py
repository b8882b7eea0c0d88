"""``triton``: two Triton kernels, the loss and its mean forward, the gradient recomputed backward.

Forward is one launch over padded targets (the loss and 1 / n_valid); backward is one launch that
recomputes d loss / d pred and scales it by grad_output. Nothing waits for the host. The kernels, their
launchers, the eager autograd.Function and the ``triton_op``s torch.compile traces are in
detector/kernels/triton_giou.py; without a GPU they run in the Triton interpreter (TRITON_INTERPRET=1).
"""

from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.kernels.triton_giou import giou_loss_triton, triton_unavailable
from detector.losses.registry import Strategy, register


def giou_loss_triton_fused(pred: Tensor, targets: PaddedTargets) -> Tensor:
    boxes, counts = targets  # [B, M, 4], [B]
    return giou_loss_triton(pred, boxes, counts)


register(
    Strategy(
        "triton",
        "padded",
        giou_loss_triton_fused,
        "Triton kernels: loss and mean forward, gradient recomputed backward",
        unavailable=triton_unavailable,
        emulated=lambda device: None if device.type == "cuda" else "Triton's interpreter runs its kernels",
    )
)
