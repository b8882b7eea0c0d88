"""A loss of your own from its per-box term: the contract's validity, masking and mean around it.

``per_box_loss(term)`` turns ``term(pred, target) -> [...]``, a loss per box over boxes [..., 4] xyxy (CIoU,
DIoU, a variant of GIoU), into a strategy's function over padded targets, with the loss contract's rules
(detector/losses/contract.py): slot j of image b is valid iff j < counts[b]; the mean over the valid boxes;
arithmetic in at least fp32; a padded slot, even NaN, reaches neither the loss nor the gradient; no valid box
gives 0, connected to the graph. Its ``reference`` is the same in float64, which the test grid checks its loss
and gradient against (README: a strategy of your own).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from detector.data.targets import PaddedTargets

PerBox = Callable[[Tensor, Tensor], Tensor]  # (pred [..., 4], target [..., 4]) -> [...]


def masked_mean(term: PerBox, pred: Tensor, targets: PaddedTargets, dtype: torch.dtype) -> Tensor:
    """The mean of ``term`` over the valid slots of ``pred`` [B, M, 4] and padded ``targets``, computed in ``dtype``."""
    boxes, counts = targets  # [B, M, 4], [B]
    valid = torch.arange(pred.shape[1], device=pred.device) < counts[:, None]  # [B, M]
    # a padded slot holds a unit box in both: any per-box term is finite there, so its zero gradient stays zero
    unit = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=dtype, device=pred.device)
    safe_pred = torch.where(valid[..., None], pred.to(dtype), unit)  # select, never multiply: NaN stays out
    safe_boxes = torch.where(valid[..., None], boxes.to(dtype), unit)
    per_box = torch.where(valid, term(safe_pred, safe_boxes), 0)  # [B, M]
    return per_box.sum() / valid.sum().clamp(min=1)


def per_box_loss(term: PerBox, description: str | None = None) -> Callable[[Tensor, PaddedTargets], Tensor]:
    """A padded-layout loss (``.layout``, ``.description``, ``.reference``): the mean of ``term`` over valid boxes.

    ``term(pred, target)`` gets boxes [B, M, 4] xyxy in fp32 (fp64 for the reference) and returns the loss of
    each box [B, M]; the description defaults to the first line of its docstring.
    """

    def loss(pred: Tensor, targets: PaddedTargets) -> Tensor:
        return masked_mean(term, pred, targets, torch.promote_types(pred.dtype, torch.float32))

    def reference(pred: Tensor, targets: PaddedTargets) -> Tensor:
        return masked_mean(term, pred.double(), targets, torch.float64)

    doc = (term.__doc__ or "").strip().splitlines()
    loss.layout = "padded"
    loss.description = description or (doc[0] if doc else f"the mean of {term.__name__} over valid boxes")
    loss.reference = reference
    loss.__name__ = loss.__qualname__ = getattr(term, "__name__", "loss")
    return loss
