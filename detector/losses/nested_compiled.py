"""``nested_compiled``: ``torch.compile`` of the ``nested`` strategy's jagged nested tensors.

Compiled lazily on the first call. The packed boxes' length N changes with every batch's counts, so
it is marked dynamic: one graph serves every N >= 2 (0 and 1 are specialised, as dynamo does for
every size); a new pred dtype, B or M compiles again. First-order gradients only, like ``nested``, and
malformed packed targets get its ValueError (``check_rows``, outside the compiled graph).
"""

import functools

import torch
from torch import Tensor

from detector.data.targets import PackedTargets
from detector.losses.checks import first_order_only
from detector.losses.nested import check_rows, giou_loss_njt, second_order
from detector.losses.registry import Strategy, register


@functools.cache
def _compiled_njt():
    return torch.compile(giou_loss_njt)


def giou_loss_nested_compiled(pred: Tensor, targets: PackedTargets) -> Tensor:
    check_rows(pred, targets)
    torch._dynamo.maybe_mark_dynamic(targets.boxes, 0)  # N: no recompilation when the counts change
    return first_order_only(_compiled_njt()(pred, targets), second_order("nested_compiled"))


register(
    Strategy(
        "nested_compiled",
        "packed",
        giou_loss_nested_compiled,
        "torch.compile of the nested (NJT) strategy",
        compiled=True,
    )
)
