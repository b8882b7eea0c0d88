"""``packed_torch``: packed [N, 4] targets in plain PyTorch, the twin of the ``packed`` kernel.

As fla keeps ``naive.py`` beside its fused kernels: the same layout and the same search, obviously right.
Each target row finds its image and slot on the device, from the counts: the prefix sums of the clamped
counts and a binary search per row (``searchsorted``; the kernel walks the other way, each warp taking
image b and its rows C[b] + j) — no host synchronisation, no Python loop. Then one GIoU call over the N
rows, summed and divided by max(n, 1).

Counts follow the op's rule (detector/kernels/cuda_op.py): clamped to [0, M]; rows past their sum are
ignored; with fewer rows than their sum, the boxes past row N are absent. ``repeat_interleave`` would
need N == sum(counts) exactly (or a host sync to find out); the search needs neither.
"""

import torch
from torch import Tensor

from detector.data.targets import PackedTargets
from detector.losses.geometry import compute_dtype, giou_loss_per_box
from detector.losses.registry import Strategy, register


def giou_loss_packed_torch(pred: Tensor, targets: PackedTargets) -> Tensor:
    boxes, counts = targets  # [N, 4], [B]
    batch, slots = pred.shape[:2]
    if batch * slots == 0:  # no slot at all (host shapes, no sync): nothing to gather from
        return (pred.sum() * 0).to(compute_dtype(pred))
    counts = counts.long().clamp(0, slots)  # [B]
    ends = counts.cumsum(0)  # [B] inclusive prefix sums: image b holds rows [ends[b] - counts[b], ends[b])
    row = torch.arange(boxes.shape[0], device=pred.device)  # [N]
    image = torch.searchsorted(ends, row, right=True)  # [N] first b with ends[b] > row; B past the sum
    valid = image < batch  # [N]
    image = image.clamp(max=batch - 1)
    slot = row - (ends[image] - counts[image])  # [N]
    flat = torch.where(valid, image * slots + slot, 0)  # [N] index into the B * M slots
    # Select (never multiply): rows past the counts' sum gather slot 0, which may hold NaN.
    safe_pred = torch.where(valid[:, None], pred.reshape(-1, 4)[flat], 0)  # [N, 4]
    safe_boxes = torch.where(valid[:, None], boxes, 0)
    per_box = torch.where(valid, giou_loss_per_box(safe_pred, safe_boxes), 0)  # [N]
    return per_box.sum() / valid.sum().clamp(min=1)


register(
    Strategy(
        "packed_torch",
        "packed",
        giou_loss_packed_torch,
        "packed [N, 4] targets in plain PyTorch: image and slot per row found on the device",
    )
)
