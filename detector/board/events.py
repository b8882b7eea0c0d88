"""TensorBoard event files of the lab's records, offline: what TensorBoard's own dashboards draw.

``write_profile_events`` puts into a profile run folder (``runs/profile/<strategy>[-forward]/<time>/``):

- Scalars ``<n> <measure>/<i> <region>`` (``2 wall ms/0 step``), one point per active step (x = N of
  ProfilerStep#N), for each (measure, region) that is not zero in some step of the run (a CPU run has no
  GPU measures). Every run uses the same tags, so one chart overlays all strategies: tick the runs to
  compare. TensorBoard sorts its groups and cards by name, numbers first: the numbers put the comparison's
  charts first (``1 compare``), then each measure in the order of detector/lab/record/measures.py, and in each the
  whole step first.
- Text ``summary/tables``: the run's card (detector/lab/present/text.py).
- Images ``<n> each run/timeline of the median step`` (detector/lab/present/timeline.py, from the run's extract)
  and ``<n> each run/ms per region`` (detector/lab/present/charts.py).

``write_compare_events`` puts a comparison's tables (Text ``compare/<mode>``) and charts (Images ``1
compare/<n> <chart>, <mode>``) into its ``runs/compare/<time>/`` folder: the first cards of the landing page.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from detector.lab.present.charts import draw_regions
from detector.lab.present.text import run_card
from detector.lab.present.timeline import draw_step
from detector.lab.record.measures import MEASURES
from detector.lab.record.run import ProfileRecord
from detector.lab.record.steps import Extract, StepModel
from detector.regions import REGIONS, STEP

COMPARE_GROUP = "1 compare"  # the comparison's charts: the landing page's first cards
RUN_GROUP = "99 each run"  # a run's own pictures, after its measures (whose tags stay below 99)


def scalar_tag(measure: str, region: str) -> str:
    """``2 wall ms/0 step``, ``9 syncs/4 calc loss``: the same tag in every run, so strategies overlay, and in every
    version (each measure's number is its own, ``Measure.tag``: runs written before a measure was added overlay runs
    written after); the numbers give TensorBoard's order (it sorts by name), the step first."""
    order = [STEP, *(r for r in REGIONS if r != STEP)].index(region)
    return f"{MEASURES[measure].tag} {MEASURES[measure].header}/{order} {region}"


def scalars(record: ProfileRecord) -> list[tuple[str, float, int]]:
    """(tag, value, step) of every (measure, region) that some step of the run has at a value other than 0."""
    nonzero = {
        (m, region) for s in record.per_step for region, values in s.regions.items() for m, v in values.items() if v
    }
    return [
        (scalar_tag(m, region), values[m], s.step)
        for s in record.per_step
        for region, values in s.regions.items()
        for m in MEASURES
        if (m, region) in nonzero and values.get(m) is not None
    ]


def write_profile_events(run_dir, record: ProfileRecord, extract: Extract | None) -> None:
    """TensorBoard event files in ``run_dir``: scalars per step and region, the run's card as Text, its median
    step's timeline (where ``extract`` is given) and a per-region chart as Images."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(run_dir)) as writer, tempfile.TemporaryDirectory() as tmp:
        for tag, value, step in scalars(record):
            writer.add_scalar(tag, value, step)
        writer.add_text("summary/tables", run_card(record))
        if extract is not None:
            model = StepModel(extract)
            png = draw_step(model, Path(tmp) / "timeline.png", title=f"{record.title()}: step {model.number}")
            writer.add_image(f"{RUN_GROUP}/timeline of the median step", read_png(png), dataformats="HWC")
        png = draw_regions(record, Path(tmp) / "regions.png")
        writer.add_image(f"{RUN_GROUP}/ms per region", read_png(png), dataformats="HWC")


def write_compare_events(out: Path, texts: dict[str, str], images: dict[str, Path]) -> None:
    """Text ``compare/<mode>`` (the tables) and Images ``1 compare/<chart>, <mode>`` in the ``compare/<time>``
    run."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(out)) as writer:
        for mode, text in texts.items():
            writer.add_text(f"compare/{mode}", text)
        for name, png in images.items():
            writer.add_image(f"{COMPARE_GROUP}/{name}", read_png(png), dataformats="HWC")


def read_png(path) -> np.ndarray:
    """A PNG as the [H, W, 3] uint8 array that SummaryWriter.add_image(dataformats="HWC") takes."""
    from matplotlib.image import imread

    image = imread(path)  # [H, W, 4] float in [0, 1] for a matplotlib PNG
    return (image[..., :3] * 255 + 0.5).astype(np.uint8)
