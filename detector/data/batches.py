"""A dataset batched into a target layout (targets.py) by the batch loader (loader.py), and the transfer to the
device: what a command asks for when it wants batches (``build_loader``)."""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from torch import Tensor

from detector.data.annotations import SYNTHETIC, fit_boxes, read_annotations, slots_for
from detector.data.loader import BatchLoader
from detector.data.synthetic import BoxFileSampler, FaceSampler, SyntheticFaces
from detector.data.targets import LAYOUTS, Targets, make_targets
from detector.data.worker import ALIGN


def collate(samples: list[tuple[Tensor, Tensor]], layout: str, max_boxes: int) -> tuple[Tensor, Targets]:
    """Samples batched one by one, as a torch DataLoader would: the reference of the loader's batches."""
    images = torch.utils.data.default_collate([image for image, _ in samples])  # [B, 1, S, S] uint8
    return images, make_targets([boxes for _, boxes in samples], layout, max_boxes)


def collate_fn(layout: str, max_boxes: int):
    """The collate function of a layout (picklable, so DataLoader workers can use it)."""
    check_layout(layout)
    return functools.partial(collate, layout=layout, max_boxes=max_boxes)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown target layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")


def draw_dataset_batch(dataset, batch_size: int, layout: str, max_boxes: int, b: int, images: Tensor) -> Targets:
    """Batch b of ``dataset`` (items b*B .. b*B + B - 1) drawn into ``images`` [B, 1, S, S] uint8; its targets.

    A dataset with a ``sampler`` and ``sample_index`` (SyntheticFaces, RankBlocks) is drawn straight into
    ``images``, the background of the whole batch in one gather; any other dataset item by item.
    """
    items = range(b * batch_size, (b + 1) * batch_size)
    if getattr(dataset, "sampler", None) is not None:
        boxes = dataset.sampler.draw_batch([dataset.sample_index(i) for i in items], images[:, 0].numpy())
        # make_targets converts numpy arrays one by one; one split gives it tensors at once (docs/training.md)
        boxes = torch.split(torch.from_numpy(np.concatenate(boxes)), [len(x) for x in boxes])
    else:
        boxes = []
        for image, i in zip(images, items, strict=True):
            item_image, item_boxes = dataset[i]
            image.copy_(item_image)
            boxes.append(item_boxes)
    return make_targets(boxes, layout, max_boxes)


def to_device(batch: tuple[Tensor, Targets], device: torch.device) -> tuple[Tensor, Targets]:
    """Copy a batch to the device: asynchronous from pinned memory, a no-op for a batch already there
    (the loader's batches when it was built for ``device``)."""
    images, targets = batch
    return images.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def build_dataset(cfg, start: int = 0, length: int | None = None) -> SyntheticFaces:
    """``length`` (default ``cfg.length``) samples of ``build_sampler(cfg)`` from index ``start`` on."""
    return SyntheticFaces(build_sampler(cfg), cfg.length if length is None else length, start)


def build_sampler(cfg) -> FaceSampler | BoxFileSampler:
    """The sampler of a DataConfig: the synthetic faces, or the boxes of ``cfg.boxes``'s annotation file cut to
    ``cfg.max_boxes`` slots (detector/config/schema.py has set the slots already where ``cfg.over_max_boxes=fit``)."""
    if cfg.boxes == SYNTHETIC:
        return FaceSampler(
            image_size=cfg.image_size,
            max_boxes=cfg.max_boxes,
            seed=cfg.seed,
            count_std=cfg.count_std,
            tail_fraction=cfg.tail_fraction,
            tail_min=cfg.tail_min,
        )
    annotations = read_annotations(cfg.boxes)
    if cfg.over_max_boxes != "truncate":  # fit's slots were set from the data: only truncate may cut boxes
        slots_for(annotations, cfg.max_boxes, "refuse")
    return BoxFileSampler(fit_boxes(annotations, cfg.image_size, cfg.max_boxes), cfg.seed)


def build_loader(cfg, layout: str, device: torch.device, start: int = 0, length: int | None = None) -> BatchLoader:
    """The loader of the synthetic faces from sample ``start`` on, batched in ``layout``, on ``device``."""
    return loader_for(build_dataset(cfg, start, length), cfg, layout, device)


def resolve_workers(num_workers: int) -> int:
    """``num_workers``, or for -1 (auto) the cores this process may use less one (the training loop's),
    split among the training processes of this host (torchrun's LOCAL_WORLD_SIZE), at most 16."""
    if num_workers >= 0:
        return num_workers
    if num_workers != -1:
        raise ValueError(f"num_workers must be >= 0, or -1 for one per free core; got {num_workers}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1))


def loader_for(dataset, cfg, layout: str, device: torch.device) -> BatchLoader:
    """The project's loader over any dataset of (image [1, S, S] uint8, boxes) samples (detector/data/loader.py):
    whole batches only (static shapes for torch.compile and CUDA graphs), in index order (sample i is
    already random; sequential order makes runs resumable), resolve_workers(cfg.num_workers) workers."""
    check_layout(layout)
    return BatchLoader(
        draw=functools.partial(draw_dataset_batch, dataset, cfg.batch_size, layout, cfg.max_boxes),
        batches=len(dataset) // cfg.batch_size,
        batch_shape=(cfg.batch_size, 1, cfg.image_size, cfg.image_size),
        workers=resolve_workers(cfg.num_workers),
        device=torch.device(device),
        worker_timeout=cfg.worker_timeout,
        target_bytes=target_capacity(cfg.batch_size, cfg.max_boxes, cfg.image_size),
    )


def target_capacity(batch_size: int, max_boxes: int, image_size: int) -> int:
    """Bytes of a ring slot's target area: the most any layout of a batch holds (B x M boxes) in the samplers' box
    dtype (``paint``'s: uint8 up to 256 px, int16 beyond), and the int64 counts, each aligned. Targets of another
    dtype (a dataset of its own) travel through the worker's pipe instead."""
    box_bytes = 1 if image_size <= 256 else 2
    return sum(-(-n // ALIGN) * ALIGN for n in (batch_size * max_boxes * 4 * box_bytes, batch_size * 8))
