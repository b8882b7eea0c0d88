"""The three target layouts of a batch, and how to build them from per-image boxes.

Every loss strategy names the layout it consumes in ``strategy.layout``:

- ``list``:   ListTargets(boxes)            boxes: list of B tensors [n_i, 4]
- ``padded``: PaddedTargets(boxes, counts)  boxes: [B, M, 4], slots j >= counts[b] are padding; counts: [B]
- ``packed``: PackedTargets(boxes, counts)  boxes: [N, 4], the valid boxes of all images in image order;
  counts: [B], N = counts.clamp(0, M).sum()

What strategies do with hand-built targets (counts outside [0, M], dtypes) is the loss contract's, in
``detector.losses.contract.giou_loss_reference``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
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
    counts: Tensor  # [B] any integer dtype; the loss clamps counts[b] to [0, M]

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
    counts: Tensor  # [B] any integer dtype; N == sum of the counts clamped to [0, M]

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


def make_targets(boxes_list: Sequence, layout: str, max_boxes: int) -> Targets:
    """Build targets of ``layout`` from per-image [n_i, 4] boxes (tensors, numpy arrays or nested lists).

    All images' boxes share one dtype that holds every image's coordinates exactly: the promotion of
    their dtypes (``torch.promote_types``: uint8 stays uint8, uint8 + int8 gives int16, integers and
    a float give the float), widened to fp32, then fp64, where that float would round an integer
    coordinate (int16 beyond 2048 next to fp16 boxes, int64 beyond 2**24 next to fp32 boxes). So
    integer coordinates never wrap or round. Empty images do not take part unless all are empty.

    Every layout is built on the boxes' device (numpy arrays and lists are on the CPU), counts included;
    empty images, which hold no data, may be anywhere and are moved there.

    Raises ValueError naming the images when no dtype holds them all (int64 beyond 2**53 next to
    floating boxes), when two images' boxes are on different devices, when an image has more boxes than
    ``max_boxes`` slots, or when ``boxes_list[i]`` is not [n, 4]; TypeError when ``boxes_list[i]`` is not
    array-like or holds bool or complex values.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown target layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    boxes_list = [_as_boxes(boxes, i) for i, boxes in enumerate(boxes_list)]
    for i, boxes in enumerate(boxes_list):
        if boxes.shape[0] > max_boxes:
            raise ValueError(f"image {i} has {boxes.shape[0]} boxes but there are only max_boxes={max_boxes} slots")
    device = common_box_device(boxes_list)
    dtype = common_box_dtype(boxes_list)
    boxes_list = [b.to(device, dtype) for b in boxes_list]
    if layout == "list":
        return ListTargets(boxes_list)
    counts = torch.tensor([b.shape[0] for b in boxes_list], dtype=torch.int64, device=device)
    packed = torch.cat(boxes_list) if boxes_list else torch.zeros(0, 4, dtype=dtype, device=device)  # [N, 4]
    if layout == "packed":
        return PackedTargets(packed, counts)
    padded = torch.zeros(len(boxes_list), max_boxes, 4, dtype=dtype, device=device)
    # the valid slots in row-major order are the packed order: one assignment instead of one per image
    # (docs/training.md, "The sampler's choices, measured")
    padded[torch.arange(max_boxes, device=device) < counts[:, None]] = packed
    return PaddedTargets(padded, counts)


def common_box_device(boxes_list: list[Tensor]) -> torch.device:
    """The device of every non-empty image's boxes (all empty: the first image's); a ValueError naming two
    images on different devices."""
    placed = [(i, b.device) for i, b in enumerate(boxes_list) if b.numel()]
    for i, device in placed[1:]:
        if device != placed[0][1]:
            first, where = placed[0]
            raise ValueError(
                f"boxes_list[{first}] is on {where} but boxes_list[{i}] is on {device}: put every image's "
                "boxes on one device"
            )
    return placed[0][1] if placed else (boxes_list[0].device if boxes_list else torch.device("cpu"))


def _as_boxes(boxes, i: int) -> Tensor:
    """``boxes_list[i]`` as a [n, 4] integer or floating tensor, or an error naming it."""
    if not isinstance(boxes, Tensor):
        try:
            boxes = torch.as_tensor(boxes)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"boxes_list[{i}] must be a tensor, numpy array or nested list of [n, 4] boxes, "
                f"got {type(boxes).__name__} ({err})"
            ) from None
        if boxes.dim() == 1 and boxes.numel() == 0:  # [] is an image without boxes
            boxes = boxes.reshape(0, 4)
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"boxes_list[{i}] must have shape [n, 4] (xyxy boxes of image {i}), got {list(boxes.shape)}")
    if boxes.dtype == torch.bool or boxes.is_complex():
        raise TypeError(f"boxes_list[{i}] must hold integer or floating coordinates, got dtype {boxes.dtype}")
    return boxes


def common_box_dtype(boxes_list: list[Tensor]) -> torch.dtype:
    """The dtype that holds every image's boxes exactly (see make_targets); empty images only break ties."""
    dtypes = {b.dtype for b in boxes_list if b.numel()} or {b.dtype for b in boxes_list} or {torch.float32}
    dtype = functools.reduce(torch.promote_types, sorted(dtypes, key=str))
    for candidate in (dtype, torch.promote_types(dtype, torch.float32), torch.float64):
        if all(_holds_exactly(b, candidate) for b in boxes_list):
            return candidate
    inexact = [f"boxes_list[{i}] ({b.dtype})" for i, b in enumerate(boxes_list) if not _holds_exactly(b, torch.float64)]
    raise ValueError(
        f"no dtype holds every image's box coordinates exactly: {', '.join(inexact)} hold integers beyond "
        f"2**53 that float64 would round, next to floating boxes ({', '.join(sorted(map(str, dtypes)))})"
    )


def _holds_exactly(boxes: Tensor, dtype: torch.dtype) -> bool:
    """Whether converting ``boxes`` to ``dtype`` keeps every coordinate (integers into floats may round)."""
    if boxes.dtype == dtype or boxes.is_floating_point() or not dtype.is_floating_point or not boxes.numel():
        return True  # floats only widen under promotion, and integers promote to integers that hold them
    converted = boxes.to(dtype).to(torch.float64)  # a float of any width converts to float64 exactly
    if not torch.isfinite(converted).all() or converted.abs().max() >= 2**63:
        return False
    return torch.equal(converted.to(torch.int64), boxes.to(torch.int64))


def to_padded(targets: Targets, max_boxes: int) -> PaddedTargets:
    """Any layout as PaddedTargets with ``max_boxes`` slots (for references and tests, not hot paths).

    Packed rows are split by the counts clamped to [0, max_boxes] (the loss contract's rule); their sum
    must be N, else ValueError. Padded targets come back as they are.
    """
    if isinstance(targets, PaddedTargets):
        return targets
    if isinstance(targets, PackedTargets):
        counts = targets.counts.long().clamp(0, max_boxes)
        if int(counts.sum()) != targets.boxes.shape[0]:
            raise ValueError(
                f"packed targets: targets.boxes has {targets.boxes.shape[0]} boxes but the counts, clamped to "
                f"[0, {max_boxes}], sum to {int(counts.sum())}"
            )
        boxes_list = list(torch.split(targets.boxes, counts.tolist()))
    else:
        boxes_list = list(targets.boxes)
    device = boxes_list[0].device if boxes_list else torch.device("cpu")
    padded = make_targets([b.cpu() for b in boxes_list], "padded", max_boxes)
    return padded.to(device)
