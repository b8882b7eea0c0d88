"""Boxes from annotation files in the standard formats, read and checked once, here (``data.boxes``).

- ``coco:<instances.json>``: COCO's detection JSON. ``images``: objects with ``id``, ``width`` and ``height``;
  ``annotations``: objects with ``image_id``, ``bbox`` [x, y, w, h] in pixels and ``iscrowd``. A crowd
  annotation (iscrowd=1) marks a region of many objects, not one box: it is left out, as COCO's evaluation does.
- ``widerface:<wider_face_*_bbx_gt.txt>``: WIDER FACE's ground truth. Per image: a path line, a count line,
  then a line per face ``x y w h blur expression illumination invalid occlusion pose`` (x y w h at least). An
  image without faces has a count of 0 and, in the official files, one line of zeros after it. The file gives
  no image sizes: WIDER FACE's images are 1024 px wide, so each image is taken as a square of side
  max(1024, its boxes' extent).

Boxes against their image: an image side outside [1, MAX_SIDE] px, a box side beyond MAX_SIDE and a box with no
pixel in its image are refused; a box partly outside its image is clipped to it and counted (``clipped``), which
the configuration's announcement and a profile's record report. Numbers are ASCII digits (a WIDER count of ``²``
is not a count), and a file's BOM is not part of its first name.

``read_annotations`` returns every image's boxes as the file gives them (``Annotations``), empty images
included; a file that is not one of these is one line, ``AnnotationError``, naming the line (WIDER FACE) or
the field and the image (COCO) and what was expected. ``fit_boxes`` scales them to the square images of
``data.image_size`` and applies the slots' rule (``data.over_max_boxes``); the layers below trust what it returns.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from detector.errors import UserError

SYNTHETIC = "synthetic"  # data.boxes of the synthetic faces (detector/data/synthetic.py's FaceSampler)
WIDER_SIDE = 1024  # WIDER FACE's images are 1024 px wide; their height is not in the ground-truth file
OVER_MAX_BOXES = ("truncate", "fit", "refuse")  # data.over_max_boxes
MAX_SIDE = 65_535  # px: JPEG's largest image side; an image or a box beyond it is a mistake in the file
NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")  # ASCII only: float() takes '٣' and '1_0'
COUNT = re.compile(r"[0-9]{1,9}")  # a WIDER FACE count: a file of 10^9 faces would be tens of GB


class AnnotationError(UserError, ValueError):
    """An annotation file that cannot be read as its format: one line naming the file, the line or field."""


@dataclass(frozen=True, eq=False)
class Annotations:
    """Every image's boxes as an annotation file gives them, in the file's order of images."""

    source: str  # data.boxes as given: coco:<path> or widerface:<path>
    names: list[str]  # each image's path (WIDER FACE) or file_name (COCO), for messages
    sizes: np.ndarray  # [I, 2] float64: each image's width and height in pixels
    boxes: np.ndarray  # [N, 4] float64: x, y, w, h in the image's pixels; image 0's boxes first, then image 1's
    counts: np.ndarray  # [I] int64: the boxes of each image
    clipped: int = 0  # boxes partly outside their image, cut to it

    @property
    def images(self) -> int:
        return len(self.counts)

    def over(self, max_boxes: int) -> tuple[int, int]:
        """(images with more boxes than ``max_boxes``, the boxes beyond ``max_boxes`` they hold)."""
        excess = np.maximum(self.counts - max_boxes, 0)
        return int((excess > 0).sum()), int(excess.sum())


@dataclass(frozen=True)
class Format:
    """An annotation file's format, as ``data.boxes`` names it: ``<prefix>:<path>``."""

    usage: str  # what follows the prefix, for messages
    read: Callable[[Path, str], Annotations]  # (the file, data.boxes as given) -> its boxes; AnnotationError if not


def parse_source(source: str) -> tuple[str, Path]:
    """``coco:<path>`` or ``widerface:<path>`` as (format, path); AnnotationError otherwise."""
    kind, sep, path = str(source).partition(":")
    if not sep or kind not in FORMATS or not path:
        allowed = ", ".join(f"{name}:{form.usage}" for name, form in FORMATS.items())
        raise AnnotationError(f"data.boxes={source!r} is out of range: allowed {SYNTHETIC}, {allowed}")
    return kind, Path(path)


def read_annotations(source: str) -> Annotations:
    """The boxes of ``source`` (``coco:<path>`` or ``widerface:<path>``), read once per process and file version."""
    kind, path = parse_source(source)
    try:
        stat = path.stat()
    except OSError as err:
        raise AnnotationError(f"data.boxes={source}: cannot read {path} ({err.strerror or err})") from None
    if not path.is_file():
        raise AnnotationError(f"data.boxes={source}: {path} is not a file")
    return _read(kind, str(path.resolve()), source, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read(kind: str, path: str, source: str, mtime_ns: int, size: int) -> Annotations:
    return FORMATS[kind].read(Path(path), source)


# ----------------------------------------------------------------------------- WIDER FACE


def read_widerface(path: Path, source: str) -> Annotations:
    """WIDER FACE's ``wider_face_*_bbx_gt.txt`` (see the module docstring); AnnotationError naming the line."""
    where = f"data.boxes={source}"
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM is not part of the first image's name
    except (OSError, UnicodeDecodeError) as err:
        raise AnnotationError(f"{where}: cannot read {path} as text ({err})") from None
    numbered = [(n, line.strip()) for n, line in enumerate(lines, 1) if line.strip()]
    names, counts, boxes, at = [], [], [], 0
    while at < len(numbered):
        n, name = numbered[at]
        if _numbers(name) is not None:
            after = f" after the {counts[-1]} faces of {names[-1]}" if names else ""
            raise AnnotationError(
                f"{where}: line {n}: expected an image's path (e.g. 0--Parade/0_Parade_marchingband_1_849.jpg)"
                f"{after}, got {_shown(name)}: does a count leave out a face?"
            )
        if at + 1 >= len(numbered):
            raise AnnotationError(f"{where}: line {n}: the image {name} has no count line after it (end of file)")
        n, text = numbered[at + 1]
        count = int(text) if COUNT.fullmatch(text) else None
        if count is None:
            raise AnnotationError(f"{where}: line {n}: expected the number of faces of {name}, got {_shown(text)}")
        at += 2
        faces = numbered[at : at + count]
        if len(faces) < count:
            raise AnnotationError(
                f"{where}: line {n}: {name} has {count} faces but only {len(faces)} lines follow (end of file)"
            )
        boxes += [_wider_face(n, text, where) for n, text in faces]
        at += count
        if count == 0 and at < len(numbered) and _is_zeros(numbered[at][1]):
            at += 1  # the official files' placeholder line of an image without faces
        names.append(name)
        counts.append(count)
    if not names:
        raise AnnotationError(f"{where}: {path} holds no image (a path line, a count line, a line per face)")
    boxes = np.array(boxes, dtype=np.float64).reshape(-1, 4)
    counts = np.array(counts, dtype=np.int64)
    ends = boxes[:, :2] + boxes[:, 2:]  # [N, 2] x2, y2
    extent = np.zeros(len(counts))
    if len(boxes):
        np.maximum.at(extent, np.repeat(np.arange(len(counts)), counts), ends.max(axis=1))
    side = np.maximum(extent, WIDER_SIDE)
    return Annotations(source, names, np.stack([side, side], axis=1), boxes, counts)


def _numbers(text: str) -> list[float] | None:
    """The numbers of a line of numbers (ASCII decimals), else None."""
    values = text.split()
    return [float(v) for v in values] if all(NUMBER.fullmatch(v) for v in values) else None


def _is_zeros(text: str) -> bool:
    values = _numbers(text)
    return bool(values) and not any(values)


def _wider_face(n: int, text: str, where: str) -> list[float]:
    values = _numbers(text)
    if values is None or len(values) < 4 or not all(math.isfinite(v) for v in values[:4]):
        raise AnnotationError(
            f"{where}: line {n}: expected a face, x y w h [blur expression illumination invalid occlusion pose], "
            f"got {_shown(text)}"
        )
    x, y, w, h = values[:4]
    if w < 0 or h < 0 or x < 0 or y < 0:
        raise AnnotationError(f"{where}: line {n}: a face's x, y, width and height must be >= 0, got {_shown(text)}")
    if x + w > MAX_SIDE or y + h > MAX_SIDE:  # the image is taken as large as its faces reach
        raise AnnotationError(
            f"{where}: line {n}: a face reaching {max(x + w, y + h):g} px, beyond any image ({MAX_SIDE:,} px at "
            f"most), got {_shown(text)}"
        )
    return [x, y, w, h]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + ("...'" if isinstance(value, str) else "...")


# ----------------------------------------------------------------------------- COCO


def read_coco(path: Path, source: str) -> Annotations:
    """COCO's detection JSON (see the module docstring); AnnotationError naming the field."""
    where = f"data.boxes={source}"
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except OSError as err:
        raise AnnotationError(f"{where}: cannot read {path} ({err.strerror or err})") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise AnnotationError(f"{where}: {path} is not JSON ({str(err)[:80]})") from None
    except RecursionError:
        deep = "nests lists or objects thousands deep"
        raise AnnotationError(f"{where}: {path} {deep}: not COCO detection JSON") from None
    if not isinstance(data, dict):
        raise AnnotationError(f"{where}: expected a JSON object with images and annotations, got a {_kind(data)}")
    for key in ("images", "annotations"):
        if not isinstance(data.get(key), list):
            raise AnnotationError(f"{where}: {key} is {_shown(data.get(key))}, expected a list (COCO detection JSON)")
    index, names, sizes = {}, [], []
    for i, image in enumerate(data["images"]):
        field = f"{where}: images[{i}]"
        if not isinstance(image, dict):
            raise AnnotationError(f"{field} is a {_kind(image)}, expected an object with id, width and height")
        image_id = image.get("id")
        if not isinstance(image_id, int) or isinstance(image_id, bool) or image_id in index:
            what = "a repeated id" if image_id in index else "not an integer"
            raise AnnotationError(f"{field}.id is {_shown(image_id)}: {what}")
        for key in ("width", "height"):
            if not _number(image.get(key)) or not 1 <= image[key] <= MAX_SIDE:
                raise AnnotationError(
                    f"{field}.{key} is {_shown(image.get(key))}, expected a number of pixels in [1, {MAX_SIDE:,}]"
                )
        index[image_id] = i
        names.append(str(image.get("file_name", image_id)))
        sizes.append((image["width"], image["height"]))
    if not names:
        raise AnnotationError(f"{where}: images is empty: the file holds no image")
    owners, boxes, clipped = [], [], 0
    for k, annotation in enumerate(data["annotations"]):
        owner, box = _coco_box(annotation, index, f"{where}: annotations[{k}]")
        if box is not None:
            inside = _inside(box, *sizes[owner], f"{where}: annotations[{k}].bbox", names[owner])
            owners.append(owner)
            boxes.append(inside)
            clipped += inside != box
    owners = np.array(owners, dtype=np.int64)
    order = np.argsort(owners, kind="stable")  # image by image, in the file's order within an image
    boxes = np.array(boxes, dtype=np.float64).reshape(-1, 4)[order]
    counts = np.bincount(owners, minlength=len(names)).astype(np.int64)
    return Annotations(source, names, np.array(sizes, dtype=np.float64).reshape(-1, 2), boxes, counts, clipped)


def _inside(box: list[float], width: float, height: float, field: str, image: str) -> list[float]:
    """``box`` [x, y, w, h] cut to its ``width`` x ``height`` image; AnnotationError where no pixel of it lies in
    the image (a zero-size box is its point) or a side is beyond any image."""
    x, y, w, h = box
    shown = f"[{x:g}, {y:g}, {w:g}, {h:g}]"
    if w > MAX_SIDE or h > MAX_SIDE:
        raise AnnotationError(
            f"{field} is {shown} in {image}: a box {w:g} x {h:g} px, larger than any image ({MAX_SIDE:,} px "
            "a side at most)"
        )
    for start, size, side in ((x, w, width), (y, h, height)):
        if start >= side or start + size < 0 or (start + size == 0 and size > 0):
            raise AnnotationError(
                f"{field} is {shown}: it lies wholly outside its image {image} ({width:g} x {height:g} px)"
            )
    if x >= 0 and y >= 0 and x + w <= width and y + h <= height:
        return box
    x1, y1, x2, y2 = max(x, 0.0), max(y, 0.0), min(x + w, width), min(y + h, height)
    return [x1, y1, x2 - x1, y2 - y1]


def _coco_box(annotation, index: dict, field: str) -> tuple[int, list[float] | None]:
    """(the image's position, [x, y, w, h]) of an annotation; the box is None for a crowd region."""
    if not isinstance(annotation, dict):
        raise AnnotationError(f"{field} is a {_kind(annotation)}, expected an object with image_id and bbox")
    owner = index.get(annotation.get("image_id")) if not isinstance(annotation.get("image_id"), bool) else None
    if owner is None:
        raise AnnotationError(f"{field}.image_id is {_shown(annotation.get('image_id'))}: no image has that id")
    crowd = annotation.get("iscrowd", 0)
    if crowd not in (0, 1) or isinstance(crowd, bool):
        raise AnnotationError(f"{field}.iscrowd is {_shown(crowd)}, expected 0 or 1")
    box = annotation.get("bbox")
    if not isinstance(box, list) or len(box) != 4 or not all(_number(v) for v in box):
        raise AnnotationError(f"{field}.bbox is {_shown(box)}, expected [x, y, width, height] in pixels")
    if box[2] < 0 or box[3] < 0:
        raise AnnotationError(f"{field}.bbox is {_shown(box)}: its width and height must be >= 0")
    return owner, None if crowd else [float(v) for v in box]


def _number(value) -> bool:
    """A finite JSON number: not a bool, nor an integer too large for a float (10^400)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "string"}.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- scaled to the images


@dataclass(frozen=True, eq=False)
class FittedBoxes:
    """Every image's boxes scaled to square images of ``image_size`` px and cut to ``max_boxes`` slots.

    ``boxes`` [N, 4] xyxy pixels (inclusive, x2 >= x1; uint8 up to 256 px, int16 beyond), image by image, each
    image's in canonical order (by the centre's x, then its y: detector/data/); ``offsets`` [I + 1] where
    image i's are ``boxes[offsets[i]:offsets[i + 1]]``. An image with more than ``max_boxes`` boxes keeps its
    ``max_boxes`` largest (``truncated`` images lost ``dropped`` boxes).
    """

    source: str
    image_size: int
    max_boxes: int
    boxes: np.ndarray
    offsets: np.ndarray
    truncated: int
    dropped: int

    @property
    def images(self) -> int:
        return len(self.offsets) - 1

    def of(self, image: int) -> np.ndarray:
        return self.boxes[self.offsets[image] : self.offsets[image + 1]]


def slots_for(annotations: Annotations, max_boxes: int, policy: str) -> int:
    """The slots a run over ``annotations`` uses under ``data.over_max_boxes=policy``: ``max_boxes``, or for
    ``fit`` the most boxes an image holds (at least 1); ``refuse`` raises AnnotationError where an image has more."""
    largest = int(annotations.counts.max(initial=0))
    if policy == "fit":
        return max(1, largest)
    over, dropped = annotations.over(max_boxes)
    if policy == "refuse" and over:
        first = int(np.argmax(annotations.counts))
        raise AnnotationError(
            f"data.boxes={annotations.source}: {counted(over, 'image')} over data.max_boxes={max_boxes} (the "
            f"most: {largest}, {annotations.names[first]}): set data.max_boxes={largest}, or data.over_max_boxes="
            "truncate (their largest boxes kept) or fit (max_boxes from the data)"
        )
    return max_boxes


def fit_boxes(annotations: Annotations, image_size: int, max_boxes: int) -> FittedBoxes:
    """``annotations`` scaled to ``image_size`` px (each image stretched to the square) and cut to ``max_boxes``."""
    counts, size = annotations.counts, image_size
    owner = np.repeat(np.arange(len(counts)), counts)  # [N] each box's image
    scale = size / annotations.sizes[owner]  # [N, 2] x and y scale
    x, y, w, h = annotations.boxes.T if len(owner) else np.zeros((4, 0))
    x1 = np.clip(np.floor(x * scale[:, 0]), 0, size - 1)
    y1 = np.clip(np.floor(y * scale[:, 1]), 0, size - 1)
    x2 = np.clip(np.ceil((x + w) * scale[:, 0]) - 1, x1, size - 1)  # a sub-pixel face still covers its pixel
    y2 = np.clip(np.ceil((y + h) * scale[:, 1]) - 1, y1, size - 1)
    boxes = np.stack([x1, y1, x2, y2], axis=1).astype(np.int64)  # [N, 4]
    keep = np.ones(len(boxes), dtype=bool)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for image in np.flatnonzero(counts > max_boxes):  # few images: the crowds
        start, end = starts[image], starts[image + 1]
        area = (boxes[start:end, 2] - boxes[start:end, 0] + 1) * (boxes[start:end, 3] - boxes[start:end, 1] + 1)
        keep[start + np.argsort(-area, kind="stable")[max_boxes:]] = False
    order = np.lexsort((boxes[:, 1] + boxes[:, 3], boxes[:, 0] + boxes[:, 2], owner))  # canonical within each image
    order = order[keep[order]]
    kept = np.minimum(counts, max_boxes)
    dtype = np.uint8 if size <= 256 else np.int16
    truncated, dropped = annotations.over(max_boxes)
    offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    return FittedBoxes(annotations.source, size, max_boxes, boxes[order].astype(dtype), offsets, truncated, dropped)


def describe(annotations: Annotations, max_boxes: int, policy: str) -> str:
    """One line: the file's images and boxes, and what the slots' rule does to them."""
    counts = annotations.counts
    line = (
        f"data.boxes={annotations.source}: {counted(annotations.images, 'image')}, {counted(counts.sum(), 'box')} "
        f"({int(counts.min()):,}–{int(counts.max()):,} an image, {counts.mean():.1f} on average, "
        f"{counted((counts == 0).sum(), 'image')} without any)"
    )
    if annotations.clipped:
        line += f"; {counted(annotations.clipped, 'box')} partly outside the image clipped to it"
    over, dropped = annotations.over(max_boxes)
    if policy == "fit":
        return f"{line}; data.max_boxes={max_boxes}: the most boxes an image holds (data.over_max_boxes=fit)"
    if over:
        return (
            f"{line}; {counted(over, 'image')} over data.max_boxes={max_boxes}: {counted(dropped, 'box')} dropped, "
            "the smallest of each (data.over_max_boxes=truncate; =fit sets max_boxes from the data)"
        )
    return f"{line}; none holds more than data.max_boxes={max_boxes}"


def counted(n, noun: str) -> str:
    """``1 image``, ``3 images``, ``12,880 boxes``."""
    n = int(n)
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}{'es' if noun.endswith('x') else 's'}"


# data.boxes's formats, each named once: a new format is its reader above and a line here
FORMATS = {
    "coco": Format("<instances.json>", read_coco),
    "widerface": Format("<wider_face_*_bbx_gt.txt>", read_widerface),
}
