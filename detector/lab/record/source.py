"""A run's data source in its record (detector/lab/record/run.py): where its boxes came from, and what its slots cut."""

from __future__ import annotations

from dataclasses import dataclass

from detector.checked import measured, need, optional
from detector.data.annotations import SYNTHETIC, counted, read_annotations


@dataclass
class DataSource:
    """Where a run's boxes came from (``data.boxes``) and what the slots did to them (``data.over_max_boxes``):
    ``truncated`` images held more boxes than the run's slots and lost their ``dropped`` smallest; ``clipped`` boxes
    lay partly outside their image and were cut to it. The file's counts are None for the synthetic faces, which are
    drawn on demand."""

    boxes: str = SYNTHETIC
    over_max_boxes: str = "truncate"
    images: int | None = None  # the file's images
    total_boxes: int | None = None  # the file's boxes
    largest: int | None = None  # the most boxes an image of the file holds
    truncated: int = 0
    dropped: int = 0
    clipped: int = 0

    @classmethod
    def of(cls, data) -> DataSource:
        """The source of a run's DataConfig (its file was read and checked when the configuration loaded)."""
        if data.boxes == SYNTHETIC:
            return cls(SYNTHETIC, data.over_max_boxes)
        annotations = read_annotations(data.boxes)
        truncated, dropped = annotations.over(data.max_boxes)
        total, largest = int(annotations.counts.sum()), int(annotations.counts.max())
        clipped = annotations.clipped
        return cls(data.boxes, data.over_max_boxes, annotations.images, total, largest, truncated, dropped, clipped)

    def describe(self) -> str:
        """``widerface:gt.txt (12,880 images, 1,968 boxes at most; 21 images over the slots lost 3,512 boxes)``."""
        if self.boxes == SYNTHETIC or self.images is None:
            return self.boxes
        cut = (
            f"{counted(self.truncated, 'image')} over the slots lost {counted(self.dropped, 'box')}"
            if self.truncated
            else "none over the slots"
        )
        if self.clipped:
            cut += f"; {counted(self.clipped, 'box')} clipped to the image"
        return f"{self.boxes} ({counted(self.images, 'image')}, {counted(self.largest, 'box')} at most; {cut})"

    @classmethod
    def parse(cls, data, where: str) -> DataSource:
        """RecordError for no object, Damaged for a count that is none."""
        need(data, dict, where)
        counts = {k: measured(data, k, where, kind=int) for k in ("images", "total_boxes", "largest")}
        # clipped: 0 in summaries written before boxes were clipped
        counts |= {k: measured(data, k, where, kind=int, default=0) for k in ("truncated", "dropped", "clipped")}
        return cls(
            boxes=need(data.get("boxes", SYNTHETIC), str, f"{where}.boxes"),
            over_max_boxes=optional(data, "over_max_boxes", str, where, "truncate"),
            **counts,
        )
