"""Synthetic faces: a grayscale uint8 image with bright filled ellipses ("faces") drawn over noise, and the boxes of
those faces in xyxy pixel coordinates. Sample i is a pure function of (seed, i): any worker process, in any order,
draws the same image. The boxes are drawn at random (``FaceSampler``, data.boxes=synthetic) or come from an
annotation file (``BoxFileSampler``, data.boxes=coco:... or widerface:..., read by annotations.py); the images are
drawn over them alike.

Canonical box order: faces are sorted by the x coordinate of their centre, then by its y coordinate
(left to right). The loss matches prediction slot j to target box j, so a detector learns to emit
faces in that order.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from detector.data.annotations import FittedBoxes

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
    """Draws sample i over the boxes of an annotation file (detector/data/annotations.py); a pure function of (seed, i).

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
