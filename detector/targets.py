"""The three target layouts of a batch, and how to build them from per-image boxes.

Every loss strategy names the layout it consumes in ``strategy.layout``:

- ``list``:   ListTargets(boxes)            boxes: list of B tensors [n_i, 4]
- ``padded``: PaddedTargets(boxes, counts)  boxes: [B, M, 4], slots j >= counts[b] are padding; counts: [B]
- ``packed``: PackedTargets(boxes, counts)  boxes: [N, 4], the valid boxes of all images in image order;
  counts: [B], N = counts.sum()
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

LAYOUTS = ("list", "padded", "packed")


class ListTargets(NamedTuple):
    boxes: list[Tensor]  # B tensors [n_i, 4] xyxy

    layout = "list"

    def to(self, device, non_blocking: bool = False) -> ListTargets:
        # one copy per image: this is the cost the padded and packed layouts avoid
        return ListTargets([b.to(device, non_blocking=non_blocking) for b in self.boxes])

    @property
    def batch_size(self) -> int:
        return len(self.boxes)


class PaddedTargets(NamedTuple):
    boxes: Tensor  # [B, M, 4] xyxy; slots j >= counts[b] hold padding (any value, even NaN)
    counts: Tensor  # [B] integer, 0 <= counts[b] <= M

    layout = "padded"

    def to(self, device, non_blocking: bool = False) -> PaddedTargets:
        return PaddedTargets(
            self.boxes.to(device, non_blocking=non_blocking),
            self.counts.to(device, non_blocking=non_blocking),
        )

    @property
    def batch_size(self) -> int:
        return self.counts.shape[0]


class PackedTargets(NamedTuple):
    boxes: Tensor  # [N, 4] xyxy, image 0's boxes first, then image 1's, ...
    counts: Tensor  # [B] integer, sum(counts) == N

    layout = "packed"

    def to(self, device, non_blocking: bool = False) -> PackedTargets:
        return PackedTargets(
            self.boxes.to(device, non_blocking=non_blocking),
            self.counts.to(device, non_blocking=non_blocking),
        )

    @property
    def batch_size(self) -> int:
        return self.counts.shape[0]


Targets = ListTargets | PaddedTargets | PackedTargets


def make_targets(boxes_list: list[Tensor], layout: str, max_boxes: int) -> Targets:
    """Build targets of ``layout`` from a list of per-image [n_i, 4] box tensors.

    All images' boxes share one dtype (the first non-empty one's; uint8 stays uint8). Raises
    ValueError if an image has more boxes than ``max_boxes`` slots, naming both numbers.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown target layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    dtype = next((b.dtype for b in boxes_list if b.numel()), torch.float32)
    for i, boxes in enumerate(boxes_list):
        if boxes.dim() != 2 or boxes.shape[1] != 4:
            raise ValueError(f"boxes of image {i} must have shape [n, 4], got {list(boxes.shape)}")
        if boxes.shape[0] > max_boxes:
            raise ValueError(f"image {i} has {boxes.shape[0]} boxes but there are only max_boxes={max_boxes} slots")
    boxes_list = [b.to(dtype) for b in boxes_list]
    if layout == "list":
        return ListTargets(boxes_list)
    counts = torch.tensor([b.shape[0] for b in boxes_list], dtype=torch.int64)
    if layout == "packed":
        return PackedTargets(torch.cat(boxes_list) if boxes_list else torch.zeros(0, 4, dtype=dtype), counts)
    padded = torch.zeros(len(boxes_list), max_boxes, 4, dtype=dtype)
    for i, boxes in enumerate(boxes_list):
        padded[i, : boxes.shape[0]] = boxes
    return PaddedTargets(padded, counts)


def to_padded(targets: Targets, max_boxes: int) -> PaddedTargets:
    """Any layout as PaddedTargets with ``max_boxes`` slots (for references and tests, not hot paths)."""
    if isinstance(targets, PaddedTargets):
        return targets
    if isinstance(targets, PackedTargets):
        boxes_list = list(torch.split(targets.boxes, targets.counts.tolist()))
    else:
        boxes_list = list(targets.boxes)
    device = boxes_list[0].device if boxes_list else torch.device("cpu")
    padded = make_targets([b.cpu() for b in boxes_list], "padded", max_boxes)
    return padded.to(device)
