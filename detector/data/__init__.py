"""The data path: where batches come from.

synthetic.py     the synthetic faces (FaceSampler) and the faces over an annotation file's boxes (BoxFileSampler)
annotations.py   COCO and WIDER FACE annotation files, read and checked once (data.boxes)
targets.py       the three target layouts of a batch (list, padded, packed) and ``make_targets``
batches.py       a dataset batched into a layout: ``build_loader`` and what it is made of
loader.py        the batch loader: a ring of shared slots that worker processes draw into
worker.py        a worker's own side: its loop, its messages and the pipe they travel
host_memory.py   what the loader (and a command) may take of the host's memory
"""

from detector.data.batches import (
    build_dataset,
    build_loader,
    build_sampler,
    collate_fn,
    draw_dataset_batch,
    loader_for,
    resolve_workers,
    to_device,
)
from detector.data.synthetic import BoxFileSampler, FaceSampler, SyntheticFaces
from detector.data.targets import LAYOUTS, ListTargets, PackedTargets, PaddedTargets, Targets, make_targets

__all__ = [
    "LAYOUTS", "BoxFileSampler", "FaceSampler", "ListTargets", "PackedTargets", "PaddedTargets", "SyntheticFaces",
    "Targets", "build_dataset", "build_loader", "build_sampler", "collate_fn", "draw_dataset_batch", "loader_for",
    "make_targets", "resolve_workers", "to_device",
]  # fmt: skip
