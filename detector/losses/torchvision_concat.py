"""``torchvision``: ``torchvision.ops.generalized_box_iou_loss`` over the valid boxes, as users call it.

The valid boxes are selected with the boolean mask of the counts (``pred[valid]``): a data-dependent
shape, so the host waits for the device there (that is what this strategy shows). Then one call with
``reduction="sum"``, divided by max(n, 1). Padded slots are never selected: they cannot reach the loss
or the gradient even if they hold NaN, and no box at all gives a sum of 0 still connected to the graph.

torchvision upcasts inputs that are not fp32 or fp64 to fp32 itself (``_upcast_non_float``), so bf16
and fp16 predictions and integer targets are computed in fp32, as the contract wants. The targets are
cast to pred's compute dtype first: fp64 targets would otherwise make an fp32 prediction's loss fp64,
where the contract rounds them to fp32. torchvision is optional (see README, set-up) and imported on
first use, so ``import detector.losses`` never needs it.
"""

import functools
import importlib
import importlib.metadata
import warnings

import torch
from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.losses.geometry import compute_dtype
from detector.losses.registry import Strategy, register


@functools.cache
def torchvision_unavailable() -> str | None:
    """Why ``torchvision.ops`` cannot be imported here, in one line, or None; probed once, on first use."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. its image extension's own warning when it cannot load
            importlib.import_module("torchvision.ops")
    except ModuleNotFoundError as err:
        if err.name == "torchvision":
            return f"torchvision is not installed (set-up adds torch {torch.__version__}'s family where one loads)"
        reason = err
    except Exception as err:  # noqa: BLE001  whatever stops the import is the reason, shown in one line
        reason = err
    else:
        return None
    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        version = "(no package metadata)"
    first_line = (str(reason).strip().splitlines() or [""])[0]
    return f"torchvision {version} cannot load against torch {torch.__version__}: {type(reason).__name__}: {first_line}"


def giou_loss_torchvision_concat(pred: Tensor, targets: PaddedTargets) -> Tensor:
    from torchvision.ops import generalized_box_iou_loss  # optional dependency: imported on first use

    boxes, counts = targets  # [B, M, 4], [B]
    valid = torch.arange(pred.shape[1], device=pred.device) < counts[:, None]  # [B, M]; counts clamp to [0, M]
    loss_sum = generalized_box_iou_loss(pred[valid], boxes[valid].to(compute_dtype(pred)), reduction="sum")
    return loss_sum / valid.sum().clamp(min=1)


register(
    Strategy(
        "torchvision",
        "padded",
        giou_loss_torchvision_concat,
        "torchvision's generalized_box_iou_loss over pred[valid]: a boolean mask, a host sync",
        unavailable=lambda device: torchvision_unavailable(),
    )
)
