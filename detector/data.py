"""Synthetic faces, their batching into a target layout (detector/targets.py) and the transfer to the device.

A sample is a grayscale uint8 image with bright filled ellipses ("faces") drawn over noise, and the
boxes of those faces in xyxy pixel coordinates. Sample i is a pure function of (seed, i): any worker
process, in any order, draws the same image. The boxes are drawn at random (``FaceSampler``, data.boxes=
synthetic) or come from an annotation file (``BoxFileSampler``, data.boxes=coco:... or widerface:...,
read by detector/annotations.py); the images are drawn over them alike.

Canonical box order: faces are sorted by the x coordinate of their centre, then by its y coordinate
(left to right). The loss matches prediction slot j to target box j, so a detector learns to emit
faces in that order.

``make_targets`` and the layouts live in detector/targets.py and are re-exported here.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from detector.annotations import SYNTHETIC, FittedBoxes, fit_boxes, read_annotations, slots_for
from detector.data_worker import ALIGN
from detector.loader import BatchLoader
from detector.targets import LAYOUTS, ListTargets, PackedTargets, PaddedTargets, Targets, make_targets

__all__ = [
    "LAYOUTS",
    "ListTargets",
    "PackedTargets",
    "PaddedTargets",
    "Targets",
    "make_targets",
    "BoxFileSampler",
    "FaceSampler",
    "SyntheticFaces",
    "build_dataset",
    "build_loader",
    "build_sampler",
    "collate_fn",
    "data_wait_ms",
    "draw_dataset_batch",
    "images_per_second",
    "loader_for",
    "resolve_workers",
    "to_device",
]


# ----------------------------------------------------------------------------- the dataset


NOISE_BITS = 22  # a seed's noise bank offers 2**22 background rows: 4 MiB of pixels per process
NOISE_WINDOWS = 1 << NOISE_BITS


@functools.cache
def background_lut() -> np.ndarray:
    """[65536] uint8: floor(clip(x, 0, 255)) of x ~ N(40, 12) at the quantile (k + 0.5) / 65536 of entry k.

    A uniform 16-bit index into it draws the old background pixel (clipped, truncated normal noise) up to a
    quantile resolution of 2**-16 (tails beyond ~4.2 sigma are cut).
    """
    normal = statistics.NormalDist(40.0, 12.0)
    thresholds = np.array([normal.cdf(v) for v in range(1, 256)])  # pixel >= v  <=>  quantile >= thresholds[v-1]
    return np.searchsorted(thresholds, (np.arange(65536) + 0.5) / 65536, side="right").astype(np.uint8)


@functools.cache
def noise_bank(seed: int, width: int) -> Tensor:
    """[NOISE_WINDOWS, width] uint8 view: row k is pixels[k : k + width] of one i.i.d. background sequence,
    a pure function of ``seed`` (built once per process). A tensor, so that ``index_select`` gathers a whole batch's
    rows into a slot in one call, faster than numpy's fancy indexing (docs/training.md, "The sampler's choices,
    measured")."""
    # spawn_key (1,) makes a 5-word seed: a stream no sample's [seed, index] (<= 4 words) can reach
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
    length = NOISE_WINDOWS + width - 1
    quantiles = rng.bit_generator.random_raw(length // 4 + 1).view(np.uint16)[:length]
    return torch.from_numpy(np.take(background_lut(), quantiles)).unfold(0, width, 1)


@functools.cache
def noise_bank_array(seed: int, width: int) -> np.ndarray:
    """``noise_bank`` as a numpy view, for one image's rows (made once: Tensor.numpy() costs a call each time)."""
    return noise_bank(seed, width).numpy()


@functools.lru_cache(maxsize=8192)  # every w, h of a 256 px image (<= 82 x 82 of ~2 KB): <= 15 MB per process
def ellipse_mask(w: int, h: int) -> np.ndarray:
    """[h, w] bool: the pixels whose centre lies in the ellipse inscribed in a w x h box."""
    x = ((np.arange(w) - (w - 1) / 2) / (w / 2)) ** 2
    y = ((np.arange(h) - (h - 1) / 2) / (h / 2)) ** 2
    return y[:, None] + x <= 1.0


@dataclass(frozen=True)
class FaceSampler:
    """Draws sample i of a synthetic face dataset; a pure function of (seed, i).

    Image: a dark background of floor(clip(N(40, 12), 0, 255)) pixels with one bright filled ellipse per
    box, inscribed in it, of a constant level uniform in [170, 250). Boxes: n = ``count`` faces, each
    w, h uniform in [smallest, largest] and x1, y1 uniform so that the box lies inside the image, in
    canonical order; faces shrink as they get more numerous so that hundreds still fit in the image.

    Sample i's generator ``default_rng([seed, i])`` draws, in this order: the count, the sizes, the
    corners, the levels, then the background: each of the S image rows is a random window of the seed's
    ``noise_bank`` (every pixel has the old distribution; windows repeat across images, but the background
    carries no label). That is a copy of S*S bytes instead of S*S float64 normals, many times faster
    (docs/training.md, "The sampler's choices, measured"). Until
    that change the background was drawn second, from the same generator: counts are bit-identical to
    that sampler's, boxes come from the same calls and have the same distribution but other values.
    """

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

    def faces(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n boxes [n, 4] int64 xyxy in canonical order and their levels [n] uint8."""
        if n == 0:  # size-0 draws leave the generator as it is: skip their calls' overhead
            return np.zeros((0, 4), np.int64), np.zeros(0, np.uint8)
        size = self.image_size
        largest = max(4, min(size // 3, int(1.6 * size / max(1.0, math.sqrt(n)))))
        smallest = min(largest, max(4, size // 32))
        wh = rng.integers(smallest, largest + 1, size=(n, 2))
        # x2, y2 <= size - 1, so coordinates of a 256-pixel image fit in uint8
        x1y1 = (rng.random((n, 2)) * (size - wh)).astype(np.int64)
        boxes = np.concatenate([x1y1, x1y1 + wh - 1], axis=1)
        boxes = boxes[np.lexsort((boxes[:, 1] + boxes[:, 3], boxes[:, 0] + boxes[:, 2]))]  # by 2 * centre x, y
        return boxes, rng.uniform(170, 250, size=n).astype(np.uint8)  # truncated, as the old uint8 cast did

    def draw_batch(self, indices, out: np.ndarray) -> list[np.ndarray]:
        """Draw samples ``indices`` into ``out`` [len(indices), S, S] uint8 (C-contiguous, e.g. a shared-memory
        slot); returns their boxes, [n_i, 4] xyxy each (uint8 up to 256 px, int16 beyond). Image k is
        pixel for pixel the image of ``self(indices[k])``."""
        rows = np.empty((len(indices), self.image_size), np.uint64)  # each image's background rows
        faces = []
        for k, index in enumerate(indices):  # the per-sample generator stays: sample i is a function of (seed, i)
            rng = np.random.default_rng([self.seed, index])
            faces.append(self.faces(rng, self.count(rng)))
            rows[k] = background_rows(rng, self.image_size)
        return paint(out, self.seed, rows, faces)

    def draw(self, index: int, out: np.ndarray) -> np.ndarray:
        """Draw sample ``index`` into ``out`` [S, S] uint8; returns its boxes [n, 4] xyxy."""
        return self.draw_batch([index], out[None])[0]

    def __call__(self, index: int) -> tuple[Tensor, Tensor]:
        image = np.empty((self.image_size, self.image_size), np.uint8)
        boxes = self.draw(index, image)
        return torch.from_numpy(image)[None], torch.from_numpy(boxes)  # [1, S, S] uint8, [n, 4] xyxy


def background_rows(rng: np.random.Generator, size: int) -> np.ndarray:
    """[size] uint64 in [0, NOISE_WINDOWS): the noise bank's rows of one image's background."""
    return rng.bit_generator.random_raw(size) >> np.uint64(64 - NOISE_BITS)


def paint(out: np.ndarray, seed: int, rows: np.ndarray, faces: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Images into ``out`` [B, S, S] uint8: image k's background is the rows ``rows[k]`` of the seed's noise bank,
    then one filled ellipse per box of ``faces[k]`` (boxes [n, 4] xyxy, levels [n] uint8) inscribed in it.
    Returns the boxes, uint8 up to 256 px, int16 beyond."""
    size = out.shape[-1]
    if len(rows) == 1:  # torch would start its thread pool (in each fresh worker) to gather 64 KiB; numpy does not
        out[0] = noise_bank_array(seed, size)[rows[0]]
    else:  # one gather of every row of the batch, written in place: no per-image array
        index = torch.from_numpy(rows.view(np.int64)).flatten()  # [B * S]
        torch.index_select(noise_bank(seed, size), 0, index, out=torch.from_numpy(out).view(-1, size))
    for image, (boxes, levels) in zip(out, faces, strict=True):
        for (x1, y1, x2, y2), level in zip(boxes.tolist(), levels.tolist(), strict=True):
            np.copyto(image[y1 : y2 + 1, x1 : x2 + 1], level, where=ellipse_mask(x2 - x1 + 1, y2 - y1 + 1))
    box_dtype = np.uint8 if size <= 256 else np.int16  # numpy's cast: cheaper than torch's for a few boxes
    return [boxes.astype(box_dtype) for boxes, _ in faces]


@dataclass(frozen=True, eq=False)
class BoxFileSampler:
    """Draws sample i over the boxes of an annotation file (detector/annotations.py); a pure function of (seed, i).

    Sample i is image ``order[i % I]`` of the file's I images, ``order`` a permutation drawn once from the seed,
    so that a batch mixes the file's images and the file is read through once every I samples. Its boxes are
    the file's, scaled and cut to the slots by ``fit_boxes``; its image is drawn over them as the synthetic
    faces are (``paint``): the generator ``default_rng([seed, i])`` draws each face's level, then the
    background's rows.
    """

    boxes: FittedBoxes
    seed: int = 0

    @property
    def image_size(self) -> int:
        return self.boxes.image_size

    @functools.cached_property
    def order(self) -> np.ndarray:
        # spawn_key (2,): a stream that neither the samples' [seed, index] nor the noise bank's (1,) reach
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(2,))).permutation(self.boxes.images)

    def image_of(self, index: int) -> int:
        """The file's image that sample ``index`` shows."""
        return int(self.order[index % len(self.order)])

    def draw_batch(self, indices, out: np.ndarray) -> list[np.ndarray]:
        """As ``FaceSampler.draw_batch``: samples ``indices`` into ``out`` [len(indices), S, S]; their boxes."""
        rows = np.empty((len(indices), self.image_size), np.uint64)
        faces = []
        for k, index in enumerate(indices):
            rng = np.random.default_rng([self.seed, index])
            boxes = self.boxes.of(self.image_of(index))
            faces.append((boxes, rng.uniform(170, 250, size=len(boxes)).astype(np.uint8)))
            rows[k] = background_rows(rng, self.image_size)
        return paint(out, self.seed, rows, faces)

    draw = FaceSampler.draw
    __call__ = FaceSampler.__call__


class SyntheticFaces(torch.utils.data.Dataset):
    """``length`` samples starting at index ``start`` (a held-out range is just another ``start``)."""

    def __init__(self, sampler: FaceSampler, length: int, start: int = 0):
        self.sampler, self.length, self.start = sampler, length, start

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.sampler(self.sample_index(i))

    def sample_index(self, i: int) -> int:
        """The sampler's index of item i (loaders draw whole batches of items through the sampler)."""
        if not 0 <= i < self.length:
            raise IndexError(f"sample {i} out of range for a dataset of {self.length}")
        return self.start + i


# ----------------------------------------------------------------------------- batching and transfer


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
    ``cfg.max_boxes`` slots (detector/config.py has set the slots already where ``cfg.over_max_boxes=fit``)."""
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
    """The project's loader over any dataset of (image [1, S, S] uint8, boxes) samples (detector/loader.py):
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


class RankBlocks(torch.utils.data.Dataset):
    """Rank r's view of a dataset: of each global batch of ``world_size * batch`` samples, block r. The
    union over the ranks is the single process's batch, so DDP sees the same images as one process."""

    def __init__(self, dataset, batch: int, rank: int, world_size: int):
        if len(dataset) % (batch * world_size):
            raise ValueError(
                f"dataset length {len(dataset)} is not a multiple of the global batch {batch * world_size}"
            )
        self.dataset, self.batch, self.rank, self.world_size = dataset, batch, rank, world_size

    def __len__(self) -> int:
        return len(self.dataset) // self.world_size

    def __getitem__(self, i: int):
        return self.dataset[self.dataset_index(i)]

    def dataset_index(self, i: int) -> int:
        step, j = divmod(i, self.batch)
        return (step * self.world_size + self.rank) * self.batch + j

    @property
    def sampler(self):
        return self.dataset.sampler

    def sample_index(self, i: int) -> int:
        """The sampler's index of item i, so that the loader draws whole batches through the sampler."""
        return self.dataset.sample_index(self.dataset_index(i))


def rank_loader(cfg, layout: str, device: torch.device, rank: int, world_size: int, start: int, steps: int):
    """Process ``rank``'s batches of ``steps`` global batches from sample index ``start`` on, in ``layout``."""
    dataset = build_dataset(cfg, start, steps * cfg.batch_size * world_size)
    return loader_for(RankBlocks(dataset, cfg.batch_size, rank, world_size), cfg, layout, device)


# ----------------------------------------------------------------------------- measurement


WARMUP_SECONDS = 1.0  # the loader's start (fork the workers, page-lock the ring) and the ring's first fill


def images_per_second(cfg, seconds: float = 5.0, layout: str = "padded", device: str = "cpu") -> dict[str, float]:
    """Images/s of the data pipeline of ``cfg`` (a DataConfig), each rate timed for ~``seconds``.

    ``sampler``: samples drawn one after another in this process. ``loader``: images of the batches of
    ``build_loader(cfg, layout, device)`` (resolve_workers(cfg.num_workers) workers; on a CUDA device
    copied there, so the host-to-device copy counts), counted after WARMUP_SECONDS so that worker
    start-up and the batches drawn meanwhile into the ring's free slots are left out.
    """
    sampler = build_sampler(cfg)
    sampler(0)  # builds this process's noise bank
    drawn, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sampler(drawn)
        drawn += 1
    rates = {"sampler": drawn / (time.perf_counter() - start)}
    batches = iter(build_loader(cfg, layout, torch.device(device)))
    start = time.perf_counter()
    for _ in batches:
        if time.perf_counter() - start >= WARMUP_SECONDS:
            break
    loaded, start = 0, time.perf_counter()
    for _ in batches:
        loaded += cfg.batch_size
        if time.perf_counter() - start >= seconds:
            break
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # the last batch's copy
    rates["loader"] = loaded / (time.perf_counter() - start)
    return rates


def data_wait_ms(cfg, step_seconds: float, steps: int, layout: str = "padded", device: str = "cpu") -> dict:
    """The wait for each batch (ms: median, mean, max over ``steps`` batches) of a consumer whose step
    takes ``step_seconds`` on the host (the training loop's ``data wait``), after WARMUP_SECONDS of steps."""
    batches = iter(build_loader(cfg, layout, torch.device(device)))
    waits, warmup = [], int(WARMUP_SECONDS / step_seconds) + 1
    for step in range(warmup + steps):
        start = time.perf_counter()
        next(batches)
        if step >= warmup:
            waits.append((time.perf_counter() - start) * 1e3)
        time.sleep(step_seconds)
    return {"median": statistics.median(waits), "mean": statistics.fmean(waits), "max": max(waits)}
