"""Annotation files the tests write themselves (nothing is downloaded), and a WIDER-FACE-shaped one for GPU runs.

    python tests/annotation_helpers.py OUT.txt [IMAGES] [SEED]

writes a WIDER FACE ground-truth file shaped like the real one: most images hold 0–20 faces (about 6 on
average), a few crowds over 500, each face a line ``x y w h blur expression illumination invalid occlusion
pose`` in a 1024 x 768 image, an empty image's count of 0 followed by a line of zeros as in the official files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

CROWDS = (501, 1200)  # faces in a crowd image: past any slot count a padded layout would choose


def widerface_counts(images: int = 4096, seed: int = 0, crowds: int = 4) -> np.ndarray:
    """[images] faces an image: a geometric count of mean ~6 cut at 20, and ``crowds`` images of 501–1199."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.geometric(1 / 7, size=images) - 1, 20)
    crowds = min(crowds, images)
    counts[rng.choice(images, size=crowds, replace=False)] = rng.integers(*CROWDS, size=crowds)
    return counts


def widerface_text(counts, seed: int = 0, zeros_line: bool = True) -> str:
    """WIDER FACE's ground-truth text for images holding ``counts`` faces, in 1024 x 768 images."""
    rng = np.random.default_rng(seed)
    lines = []
    for i, n in enumerate(counts):
        lines += [f"{i % 61}--Event/{i % 61}_Event_{i}.jpg", str(int(n))]
        if n == 0 and zeros_line:
            lines.append("0 0 0 0 0 0 0 0 0 0")
        largest = 200 if n < 20 else 24  # a crowd's faces are small
        w = rng.integers(2, largest, size=n)
        h = (w * rng.uniform(1.0, 1.4, size=n)).astype(int)
        x, y = rng.integers(0, 1024 - w), rng.integers(0, 768 - h)
        lines += [f"{a} {b} {c} {d} 0 0 0 0 0 0" for a, b, c, d in zip(x, y, w, h, strict=True)]
    return "\n".join(lines) + "\n"


def write_widerface(path: Path, counts, seed: int = 0, zeros_line: bool = True) -> Path:
    path.write_text(widerface_text(counts, seed, zeros_line))
    return path


def coco_json(counts, seed: int = 0, crowds: bool = False) -> dict:
    """A COCO detection JSON of 640 x 480 images holding ``counts`` boxes; with ``crowds`` every image also holds
    an iscrowd region, which is not a box."""
    rng = np.random.default_rng(seed)
    images = [{"id": 100 + i, "file_name": f"{i:012d}.jpg", "width": 640, "height": 480} for i in range(len(counts))]
    annotations = []
    for i, n in enumerate(counts):
        for k in range(int(n) + crowds):
            w, h = (float(v) for v in rng.uniform(1, 200, size=2))
            box = [float(rng.uniform(0, 640 - w)), float(rng.uniform(0, 480 - h)), w, h]
            annotations.append({"id": len(annotations), "image_id": 100 + i, "bbox": box, "iscrowd": int(k == n)})
    rng.shuffle(annotations)  # COCO's annotations are not grouped by image
    return {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "face"}]}


def write_coco(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 4:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    out = Path(sys.argv[1])
    images = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    counts = widerface_counts(images, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_widerface(out, counts, seed)
    print(
        f"{out}: {images} images, {int(counts.sum())} faces, {int((counts <= 20).sum())} with 0-20, "
        f"{int((counts > 500).sum())} over 500 (the most: {int(counts.max())})"
    )
