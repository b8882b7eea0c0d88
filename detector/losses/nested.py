"""``nested``: predictions and packed targets as jagged nested tensors (NJT), one GIoU over [B, j, 4].

Packed, because an NJT *is* the packed layout: ``targets.boxes`` [N, 4] become its values as they are,
the counts its offsets; N is a host shape, so nothing is read from the device. Both NJTs share one
offsets tensor (so one ragged size ``j``) and are given ``max_seqlen=M`` (else an NJT finds it with a
host sync). The loss is the NJT's sum over N boxes divided by max(N, 1).

What NJT cannot express here, and what stands in for it (torch 2.11 to 2.13):
- padded to jagged: ``torch.nested.narrow(pred, 1, 0, counts)`` is a view with holes whose
  ``.contiguous()`` breaks backward (a ragged-size mismatch), so pred's valid rows come from
  ``nested_from_padded`` of ``torch.nested._internal``, told the total N: no sync on CUDA (tests/losses/test_nested.py);
  its CPU fallback reads the offsets on the host.
- ``unbind(-1)`` works on dim 0 only and ``x[..., 0]`` has no backward: ``chunk(4, dim=-1)`` instead.
- ``torch.maximum``/``minimum`` have no backward (in-place ``masked_fill_``): ``stack(...).amax(-1)``,
  whose backward splits ties evenly as theirs does.
- ``torch.where`` on NJTs: torch 2.11's inductor cannot lower the jagged zeros of its backward (2.13
  can), so the intersection is multiplied by the overlap mask: for the finite coordinates of valid
  boxes the value and the gradient of ``where``.
- no component at all (B = 0, M = 0, no box): handled before any NJT is built, from host shapes.
- packed boxes whose number N is not the sum of the clamped counts: the contract leaves the loss undefined,
  and NJT's CPU conversion would fail inside torch (``_padded_dense_to_jagged_forward``). On the CPU, where the
  offsets are read on the host anyway, ``check_rows`` refuses them with ``to_padded``'s ValueError naming the
  targets; on a GPU the check would cost a host synchronisation, and nothing is read out of bounds.
- second derivatives: the backward of ``chunk`` and ``amax`` on an NJT cannot be differentiated
  again, so a backward with ``create_graph=True`` raises (``first_order_only``) instead.
"""

import torch
from torch import Tensor
from torch.nested._internal.nested_tensor import nested_from_padded

from detector.data.targets import PackedTargets
from detector.losses.checks import first_order_only
from detector.losses.geometry import EPS, compute_dtype
from detector.losses.registry import Strategy, register


def _maximum(a: Tensor, b: Tensor) -> Tensor:
    return torch.stack([a, b], dim=-1).amax(-1)


def _minimum(a: Tensor, b: Tensor) -> Tensor:
    return torch.stack([a, b], dim=-1).amin(-1)


def second_order(name: str) -> str:
    """Why a backward with create_graph=True through strategy ``name`` raises."""
    return (
        f"double backward through {name!r} is not supported: the backward of chunk and amax on "
        "jagged nested tensors cannot be differentiated again; use 'padded' for higher-order gradients"
    )


def giou_loss_njt(pred: Tensor, targets: PackedTargets) -> Tensor:
    """The loss over jagged nested tensors; its backward cannot be differentiated again (second_order)."""
    boxes, counts = targets  # [N, 4], [B]
    dtype, slots, total = compute_dtype(pred), pred.shape[1], boxes.shape[0]
    if pred.shape[0] * slots == 0 or total == 0:  # no box (host shapes): 0, still connected to the graph
        return pred[:, :0].sum().to(dtype)
    ends = counts.long().clamp(0, slots).cumsum(0).clamp(max=total)  # [B]; N bounds every row read or written
    offsets = torch.nn.functional.pad(ends, (1, 0))  # [B + 1], shared: pred and targets get one ragged size j
    p = nested_from_padded(pred.to(dtype), offsets, max_seqlen=slots, sum_S=total)  # [B, j, 4]
    t = torch.nested.nested_tensor_from_jagged(boxes.to(dtype), offsets, max_seqlen=slots)  # [B, j, 4]
    x1, y1, x2, y2 = p.chunk(4, dim=-1)  # each [B, j, 1]
    x1g, y1g, x2g, y2g = t.chunk(4, dim=-1)
    xi1, yi1, xi2, yi2 = _maximum(x1, x1g), _maximum(y1, y1g), _minimum(x2, x2g), _minimum(y2, y2g)
    inter = (xi2 - xi1) * (yi2 - yi1) * ((xi2 > xi1) & (yi2 > yi1))  # a mask, finite factors: where's value
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    enclosing = (_maximum(x2, x2g) - _minimum(x1, x1g)) * (_maximum(y2, y2g) - _minimum(y1, y1g))
    giou = inter / (union + EPS) - (enclosing - union) / (enclosing + EPS)
    return (1 - giou).sum() / total


def check_rows(pred: Tensor, targets: PackedTargets) -> None:
    """On the CPU: N packed boxes must be the sum of the counts clamped to [0, M], else the ValueError of the
    contract's host-side checks (``detector.data.targets.to_padded``)."""
    if pred.device.type != "cpu":
        return
    boxes, counts = targets
    slots, total = pred.shape[1], int(counts.long().clamp(0, pred.shape[1]).sum())
    if boxes.shape[0] != total:
        raise ValueError(
            f"packed targets: targets.boxes has {boxes.shape[0]} boxes but the counts, clamped to [0, {slots}], "
            f"sum to {total}"
        )


def giou_loss_nested(pred: Tensor, targets: PackedTargets) -> Tensor:
    check_rows(pred, targets)
    return first_order_only(giou_loss_njt(pred, targets), second_order("nested"))


register(Strategy("nested", "packed", giou_loss_nested, "packed targets as jagged nested tensors (NJT), one call"))
