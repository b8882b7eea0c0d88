"""The face sampler against the one it replaced: same counts and boxes, same kind of image, determinism
across processes and worker counts; and the loader's worker count."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import detector
from detector.data import FaceSampler, SyntheticFaces, collate_fn, resolve_workers


def reference_sample(sampler: FaceSampler, index: int, background: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The sampler before the noise bank, verbatim (image [S, S] uint8, boxes [n, 4] int64).

    ``background=False`` skips its N(40, 12) background draw and leaves the background at 0: the new
    sampler makes the same draws in the same order, without that one in the middle.
    """
    rng = np.random.default_rng([sampler.seed, index])
    size = sampler.image_size
    n = sampler.count(rng)
    image = rng.normal(40.0, 12.0, size=(size, size)) if background else np.zeros((size, size))
    largest = max(4, min(size // 3, int(1.6 * size / max(1.0, np.sqrt(n)))))
    smallest = min(largest, max(4, size // 32))
    wh = rng.integers(smallest, largest + 1, size=(n, 2))
    x1y1 = (rng.random((n, 2)) * (size - wh)).astype(np.int64)
    boxes = np.concatenate([x1y1, x1y1 + wh - 1], axis=1)
    centres = (boxes[:, :2] + boxes[:, 2:]) / 2
    boxes = boxes[np.lexsort((centres[:, 1], centres[:, 0]))]
    ys, xs = np.ogrid[:size, :size]
    for (x1, y1, x2, y2), level in zip(boxes, rng.uniform(170, 250, size=n), strict=True):
        cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, (x2 - x1 + 1) / 2, (y2 - y1 + 1) / 2
        inside = ((xs[:, x1 : x2 + 1] - cx) / rx) ** 2 + ((ys[y1 : y2 + 1] - cy) / ry) ** 2 <= 1.0
        image[y1 : y2 + 1, x1 : x2 + 1][inside] = level
    return np.clip(image, 0, 255).astype(np.uint8), boxes


SAMPLERS = [
    FaceSampler(),  # the seed scale: ~1.9 faces of 8..85 px, a quarter of the images without any
    FaceSampler(image_size=64, tail_fraction=0.3, seed=5),  # crowded images: up to 256 faces of 4 px
    FaceSampler(image_size=37, max_boxes=7, count_std=6.0),  # weird: a prime size, counts capped at 7
]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_counts_are_bit_identical_to_the_old_sampler(sampler):
    for i in range(200):
        assert len(sampler(i)[1]) == len(reference_sample(sampler, i)[1]), f"sample {i}"


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_faces_are_the_old_draws_without_the_background(sampler):
    for i in range(50):
        image, boxes = sampler(i)
        faces, reference_boxes = reference_sample(sampler, i, background=False)
        assert torch.equal(boxes.long(), torch.from_numpy(reference_boxes)), f"sample {i}"
        # same ellipses, levels and overlaps; the background (0 in the reference) is noise
        drawn = faces > 0
        assert np.array_equal(image[0].numpy()[drawn], faces[drawn]), f"sample {i}"


def test_image_dtype_shape_and_box_dtype():
    image, boxes = FaceSampler()(3)
    assert image.shape == (1, 256, 256) and image.dtype == torch.uint8 and image.is_contiguous()
    assert boxes.dtype == torch.uint8 and boxes.shape[1] == 4
    assert FaceSampler(image_size=512)(3)[1].dtype == torch.int16
    empty = next(i for i in range(100) if len(FaceSampler()(i)[1]) == 0)  # ~26% of the seed-scale images
    assert FaceSampler()(empty)[1].shape == (0, 4)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_boxes_lie_inside_the_image_in_canonical_order(sampler):
    for i in range(100):
        b = sampler(i)[1].long()
        assert torch.all(b[:, :2] >= 0) and torch.all(b[:, 2:] < sampler.image_size)
        assert torch.all(b[:, 2:] > b[:, :2])
        key = (b[:, 0] + b[:, 2]) * 1024 + b[:, 1] + b[:, 3]  # centre x, then centre y
        assert torch.all(key[1:] >= key[:-1]), f"sample {i}"


def test_background_has_the_old_statistics_and_faces_stand_out():
    sampler = FaceSampler(tail_fraction=0.2)
    new, old, face_means = [], [], []

    def outside(image, boxes):
        background = np.ones(image.shape, bool)
        for x1, y1, x2, y2 in boxes.tolist():
            background[y1 : y2 + 1, x1 : x2 + 1] = False
        return image[background]

    for i in range(20):
        image, boxes = sampler(i)
        new.append(outside(image[0].numpy(), boxes.long()))
        old.append(outside(*reference_sample(sampler, i)))  # its boxes differ: drawn after its background
        face_means += [
            image[0, y1 : y2 + 1, x1 : x2 + 1].float().mean().item() for x1, y1, x2, y2 in boxes.long().tolist()
        ]
    new, old = np.concatenate(new).astype(np.float64), np.concatenate(old).astype(np.float64)
    # floor(N(40, 12)) has mean 39.5, std 12; over ~10^6 pixels the two agree to well within 0.1
    assert abs(new.mean() - old.mean()) < 0.1 and abs(new.std() - old.std()) < 0.1
    assert abs(new.mean() - 39.5) < 0.2 and abs(new.std() - 12.0) < 0.2
    # an ellipse covers pi/4 of its box at >= 170 (or a later face's level), over a background of ~40
    assert min(face_means) > 120


def test_sample_is_a_pure_function_of_seed_and_index_in_a_fresh_process():
    code = (
        "import sys; from detector.data import FaceSampler; sys.stdout.buffer.write(FaceSampler(seed=3)(77)[0].numpy())"
    )
    root = Path(detector.__file__).resolve().parent.parent  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": str(root)}
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env, cwd=root).stdout
    assert fresh == FaceSampler(seed=3)(77)[0].numpy().tobytes()
    assert not torch.equal(FaceSampler(seed=3)(77)[0], FaceSampler(seed=3)(78)[0])
    assert not torch.equal(FaceSampler(seed=3)(77)[0], FaceSampler(seed=4)(77)[0])


def test_batches_are_identical_with_0_and_2_workers():
    dataset = SyntheticFaces(FaceSampler(image_size=48, tail_fraction=0.3), length=16, start=1000)

    def batches(workers):
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=4,
            num_workers=workers,
            collate_fn=collate_fn("padded", 256),
            multiprocessing_context="spawn" if workers else None,  # fresh processes build their own noise bank
        )
        return list(loader)

    for (images, targets), (images2, targets2) in zip(batches(0), batches(2), strict=True):
        assert torch.equal(images, images2) and images2.shape == (4, 1, 48, 48)
        assert torch.equal(targets.boxes, targets2.boxes) and torch.equal(targets.counts, targets2.counts)


def test_resolve_workers(monkeypatch):
    assert resolve_workers(0) == 0 and resolve_workers(5) == 5
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert resolve_workers(-1) == 15  # one core for the training loop
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_workers(-1) == 3  # 4 processes of torchrun share 16 cores
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    assert resolve_workers(-1) == 1  # never 0: -1 asks for workers
    with pytest.raises(ValueError, match="got -2"):
        resolve_workers(-2)
