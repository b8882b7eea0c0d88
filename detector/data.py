"""Synthetic faces, their batching into a target layout (detector/targets.py) and the transfer to the device.

A sample is a grayscale uint8 image with bright filled ellipses ("faces") drawn over noise, and the
boxes of those faces in xyxy pixel coordinates. Sample i is a pure function of (seed, i): any worker
process, in any order, draws the same image.

Canonical box order: faces are sorted by the x coordinate of their centre, then by its y coordinate
(left to right). The loss matches prediction slot j to target box j, so a detector learns to emit
faces in that order.

``make_targets`` and the layouts live in detector/targets.py and are re-exported here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from detector.targets import LAYOUTS, ListTargets, PackedTargets, PaddedTargets, Targets, make_targets

__all__ = [
    "LAYOUTS",
    "ListTargets",
    "PackedTargets",
    "PaddedTargets",
    "Targets",
    "make_targets",
    "FaceSampler",
    "SyntheticFaces",
    "build_dataset",
    "build_loader",
    "collate_fn",
    "loader_for",
    "to_device",
]


# ----------------------------------------------------------------------------- the dataset


@dataclass(frozen=True)
class FaceSampler:
    """Draws sample i of a synthetic face dataset; a pure function of (seed, i)."""

    image_size: int = 256
    max_boxes: int = 256
    seed: int = 0
    count_std: float = 3.0
    tail_fraction: float = 0.0
    tail_min: int = 32

    def count(self, rng: np.random.Generator) -> int:
        if rng.random() < self.tail_fraction:
            return int(rng.integers(min(self.tail_min, self.max_boxes), self.max_boxes + 1))
        return int(min(abs(rng.normal(0.0, self.count_std)), self.max_boxes))

    def __call__(self, index: int) -> tuple[Tensor, Tensor]:
        rng = np.random.default_rng([self.seed, index])
        size = self.image_size
        n = self.count(rng)
        image = rng.normal(40.0, 12.0, size=(size, size))  # dark noisy background
        # Faces shrink as they get more numerous so that hundreds still fit in the image.
        largest = max(4, min(size // 3, int(1.6 * size / max(1.0, np.sqrt(n)))))
        smallest = min(largest, max(4, size // 32))
        wh = rng.integers(smallest, largest + 1, size=(n, 2))
        # x2, y2 <= size - 1, so coordinates of a 256-pixel image fit in uint8
        x1y1 = (rng.random((n, 2)) * (size - wh)).astype(np.int64)
        boxes = np.concatenate([x1y1, x1y1 + wh - 1], axis=1)
        centres = (boxes[:, :2] + boxes[:, 2:]) / 2
        boxes = boxes[np.lexsort((centres[:, 1], centres[:, 0]))]
        ys, xs = np.ogrid[:size, :size]
        for (x1, y1, x2, y2), level in zip(boxes, rng.uniform(170, 250, size=n), strict=True):
            cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, (x2 - x1 + 1) / 2, (y2 - y1 + 1) / 2
            inside = ((xs[:, x1 : x2 + 1] - cx) / rx) ** 2 + ((ys[y1 : y2 + 1] - cy) / ry) ** 2 <= 1.0
            image[y1 : y2 + 1, x1 : x2 + 1][inside] = level
        image = torch.from_numpy(np.clip(image, 0, 255).astype(np.uint8))[None]  # [1, S, S]
        box_dtype = torch.uint8 if size <= 256 else torch.int16
        return image, torch.from_numpy(boxes).to(box_dtype)  # [1, S, S] uint8, [n, 4] xyxy


class SyntheticFaces(torch.utils.data.Dataset):
    """``length`` samples starting at index ``start`` (a held-out range is just another ``start``)."""

    def __init__(self, sampler: FaceSampler, length: int, start: int = 0):
        self.sampler, self.length, self.start = sampler, length, start

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(f"sample {i} out of range for a dataset of {self.length}")
        return self.sampler(self.start + i)


# ----------------------------------------------------------------------------- batching and transfer


def collate(samples: list[tuple[Tensor, Tensor]], layout: str, max_boxes: int) -> tuple[Tensor, Targets]:
    images = torch.stack([image for image, _ in samples])  # [B, 1, S, S] uint8
    return images, make_targets([boxes for _, boxes in samples], layout, max_boxes)


def collate_fn(layout: str, max_boxes: int):
    """The collate function of a layout (picklable, so DataLoader workers can use it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown target layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    return functools.partial(collate, layout=layout, max_boxes=max_boxes)


def to_device(batch: tuple[Tensor, Targets], device: torch.device) -> tuple[Tensor, Targets]:
    """Copy a (pinned) batch to the device; asynchronous when the host memory is pinned."""
    images, targets = batch
    return images.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def build_dataset(cfg, start: int = 0, length: int | None = None) -> SyntheticFaces:
    sampler = FaceSampler(
        image_size=cfg.image_size,
        max_boxes=cfg.max_boxes,
        seed=cfg.seed,
        count_std=cfg.count_std,
        tail_fraction=cfg.tail_fraction,
        tail_min=cfg.tail_min,
    )
    return SyntheticFaces(sampler, cfg.length if length is None else length, start)


def build_loader(cfg, layout: str, device: torch.device, start: int = 0, length: int | None = None):
    """A DataLoader over the synthetic faces, batched in ``layout`` and pinned for a CUDA device."""
    return loader_for(build_dataset(cfg, start, length), cfg, layout, device)


def loader_for(dataset, cfg, layout: str, device: torch.device):
    """The project's DataLoader settings over any dataset of (image, boxes) samples."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=False,  # sample i is already random; sequential order makes runs resumable
        drop_last=True,  # static shapes for torch.compile and CUDA graphs
        num_workers=cfg.num_workers,
        collate_fn=collate_fn(layout, cfg.max_boxes),
        pin_memory=device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
        prefetch_factor=4 if cfg.num_workers > 0 else None,
    )
