"""Random loss inputs (predictions and per-image targets) for tests and the benchmark.

Box-count distributions, by name:
- ``zero``: no box in any image
- ``seed``: floor(|N(0, 3)|) per image, clipped to [0, M] (about 1.9 boxes per image; the article's)
- ``tail``: ``seed`` plus 2% of images with M/8 .. M boxes (a crowd now and then)
- ``one_full``: ``seed``, but image 0 holds all M boxes
- ``full``: every image holds M boxes
- ``degenerate``: ``seed`` counts where every target and prediction has zero width or height
- an integer k: k boxes in every image
"""

from __future__ import annotations

import torch
from torch import Tensor

DISTRIBUTIONS = ("zero", "seed", "tail", "one_full", "full", "degenerate")


def sample_counts(distribution: str | int, batch: int, max_boxes: int, generator: torch.Generator) -> Tensor:
    """[batch] int64 box counts drawn from a named distribution (see the module docstring)."""
    if isinstance(distribution, int) or str(distribution).isdigit():
        k = int(distribution)
        if not 0 <= k <= max_boxes:
            raise ValueError(f"box count {k} must lie in [0, max_boxes={max_boxes}]")
        return torch.full((batch,), k, dtype=torch.int64)
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown box distribution {distribution!r}; valid: {', '.join(DISTRIBUTIONS)} or an integer")
    if distribution == "zero":
        return torch.zeros(batch, dtype=torch.int64)
    if distribution == "full":
        return torch.full((batch,), max_boxes, dtype=torch.int64)
    counts = (torch.randn(batch, generator=generator) * 3).abs().floor().clamp(max=max_boxes).long()
    if distribution == "tail":
        crowded = torch.rand(batch, generator=generator) < 0.02
        crowd = torch.randint(max(1, max_boxes // 8), max_boxes + 1, (batch,), generator=generator)
        counts = torch.where(crowded, crowd, counts)
    if distribution == "one_full":
        counts[0] = max_boxes
    return counts


def random_boxes(shape: tuple[int, ...], generator: torch.Generator, integer: bool, image_size: int = 256) -> Tensor:
    """Boxes [..., 4] xyxy inside an image, x2 >= x1 + 1, fp64 (integer-valued if ``integer``)."""
    xy = torch.rand(*shape, 2, generator=generator, dtype=torch.float64) * (image_size * 0.8)
    wh = 1 + torch.rand(*shape, 2, generator=generator, dtype=torch.float64) * (image_size * 0.2 - 1)
    boxes = torch.cat([xy, xy + wh], dim=-1)
    return boxes.floor().clamp(max=image_size - 1) if integer else boxes


def random_case(
    batch: int,
    max_boxes: int,
    distribution: str | int,
    pred_dtype: torch.dtype = torch.float32,
    target_dtype: torch.dtype = torch.uint8,
    device: str | torch.device = "cpu",
    seed: int = 0,
    nan_padding: bool = True,
) -> tuple[Tensor, list[Tensor]]:
    """Predictions [B, M, 4] (padded slots NaN if ``nan_padding``) and a list of B target tensors [n_i, 4].

    Predictions are the targets jittered, so that overlapping, touching and disjoint pairs all occur.
    """
    g = torch.Generator().manual_seed(seed)
    counts = sample_counts(distribution, batch, max_boxes, g)
    integer = not target_dtype.is_floating_point
    targets = random_boxes((batch, max_boxes), g, integer)  # [B, M, 4] fp64
    jitter = torch.randn(batch, max_boxes, 4, generator=g, dtype=torch.float64) * 8
    pred = targets + jitter
    pred[..., 2:] = torch.maximum(pred[..., 2:], pred[..., :2] + 0.5)
    far = torch.rand(batch, max_boxes, generator=g) < 0.1  # some predictions far from their target
    pred[far] = random_boxes((int(far.sum()),), g, integer=False)
    if distribution == "degenerate":
        targets[..., 2] = targets[..., 0]  # zero width
        pred[..., 3] = pred[..., 1]  # zero height
    valid = torch.arange(max_boxes) < counts[:, None]
    if nan_padding:
        pred[~valid] = float("nan")
    pred = pred.to(device=device, dtype=pred_dtype)
    boxes_list = [targets[b, : counts[b]].to(device=device, dtype=target_dtype) for b in range(batch)]
    return pred, boxes_list
