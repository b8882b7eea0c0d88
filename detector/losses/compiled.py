"""``compiled``: ``torch.compile`` of the padded strategy, which fuses its elementwise kernels.

Compiled lazily on the first call (the first step pays the compilation); static shapes, so a
batch with other counts but the same [B, M] reuses the compiled code.
"""

import functools

import torch
from torch import Tensor

from detector.losses.padded import giou_loss_padded
from detector.losses.registry import Strategy, register
from detector.targets import PaddedTargets


@functools.cache
def _compiled_padded():
    return torch.compile(giou_loss_padded, dynamic=False)


def giou_loss_compiled(pred: Tensor, targets: PaddedTargets) -> Tensor:
    return _compiled_padded()(pred, targets)


register(Strategy("compiled", "padded", giou_loss_compiled, "torch.compile of the padded strategy"))
