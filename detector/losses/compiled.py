"""``compiled``: ``torch.compile`` of the padded strategy, which fuses its elementwise kernels.

Compiled lazily on the first call (the first step pays the compilation); static shapes, so a
batch with other counts but the same [B, M] reuses the compiled code. First-order gradients only:
AOTAutograd's compiled backward cannot be differentiated again, and would give no second derivative
without a word, so a backward with ``create_graph=True`` raises instead.
"""

import functools

import torch
from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.losses.checks import first_order_only
from detector.losses.padded import giou_loss_padded
from detector.losses.registry import Strategy, register


@functools.cache
def _compiled_padded():
    return torch.compile(giou_loss_padded, dynamic=False)


# why a backward with create_graph=True raises
SECOND_ORDER = (
    "double backward through 'compiled' is not supported: torch.compile's (AOTAutograd's) backward "
    "cannot be differentiated again; use the 'padded' strategy for higher-order gradients"
)


def giou_loss_compiled(pred: Tensor, targets: PaddedTargets) -> Tensor:
    return first_order_only(_compiled_padded()(pred, targets), SECOND_ORDER)


register(Strategy("compiled", "padded", giou_loss_compiled, "torch.compile of the padded strategy", compiled=True))
