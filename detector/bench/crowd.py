"""A crowd source for `bench memory`: a WIDER-FACE-shaped ground-truth file in which every image holds hundreds of
faces, as WIDER FACE's crowds do (its largest holds 1,968), written where the bench works (nothing is downloaded).

Per image: a path line, a count line, then a line per face ``x y w h blur expression illumination invalid occlusion
pose`` in a 1024 x 768 image (detector/data/annotations.py reads it). The counts are drawn from a log-normal around
CROWD_MEDIAN, cut to [CROWD_FEWEST, CROWD_MOST], and one image holds CROWD_MOST exactly, so that
``data.over_max_boxes=fit`` gives ``data.max_boxes=CROWD_MOST`` slots.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CROWD_MEDIAN, CROWD_FEWEST, CROWD_MOST = 300, 100, 1024
CROWD_IMAGES = 512  # a batch of thousands repeats them: sample i shows image i mod 512, over its own noise


def crowd_counts(images: int = CROWD_IMAGES, seed: int = 0) -> np.ndarray:
    """[images] faces an image: log-normal around CROWD_MEDIAN in [CROWD_FEWEST, CROWD_MOST], the first the most."""
    rng = np.random.default_rng(seed)
    counts = np.clip(rng.lognormal(np.log(CROWD_MEDIAN), 0.5, size=images), CROWD_FEWEST, CROWD_MOST).astype(int)
    counts[0] = CROWD_MOST
    return counts


def write_crowd(path: Path, images: int = CROWD_IMAGES, seed: int = 0) -> Path:
    """The crowd file at ``path``: small faces (4–24 px wide, a little taller), anywhere in the image."""
    rng = np.random.default_rng(seed)
    lines = []
    for i, n in enumerate(crowd_counts(images, seed)):
        w = rng.integers(4, 24, size=n)
        h = (w * rng.uniform(1.0, 1.4, size=n)).astype(int)
        x, y = rng.integers(0, 1024 - w), rng.integers(0, 768 - h)
        lines += [f"{i % 61}--Crowd/{i % 61}_Crowd_{i}.jpg", str(int(n))]
        lines += [f"{a} {b} {c} {d} 0 0 0 0 0 0" for a, b, c, d in zip(x, y, w, h, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path
