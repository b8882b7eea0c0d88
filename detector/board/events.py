"""TensorBoard event files of the lab's records, offline: what TensorBoard's own dashboards draw.

``write_profile_events`` puts into a profile run folder (``runs/profile/<strategy>[-forward]/<time>/``):

- Scalars ``<n> <measure>/<i> <region>`` (``2 wall ms/0 step``), one point per active step (x = N of
  ProfilerStep#N), for each (measure, region) that is not zero in some step of the run (a CPU run has no
  GPU measures). Every run uses the same tags, so one chart overlays all strategies: tick the runs to
  compare. TensorBoard sorts its groups and cards by name, numbers first: the numbers put the comparison's
  charts first (``1 compare``), then each measure in the order of detector/lab/record/measures.py, and in each the
  whole step first.
- Text ``summary/tables``: the run's card (detector/lab/present/text.py), its tables' headers set for the Text tab
  (``text_tab``).
- Images ``<n> each run/timeline of the median step`` (detector/lab/present/timeline.py, from the run's extract)
  and ``<n> each run/ms per region`` (detector/lab/present/charts.py).

``write_compare_events`` puts a comparison's tables (Text ``compare/<mode>``) and charts (Images ``1
compare/<n> <chart>, <mode>``) into its ``runs/compare/<time>/`` folder: the first cards of the landing page.

The Text tab sets its cards in ``word-break: break-word``: a table wider than its card is squeezed to columns one
letter wide, every word broken anywhere ("operat/ors"). Its renderer takes no style and no ``<wbr>`` or ``<nobr>``
(TensorBoard's plugin_util: Markdown, then bleach with a short list of tags), and no character inside a word stops
that break (a word joiner, a zero-width joiner, a zero-width no-break space: each tried in Chromium). A ``<pre>``
does: it does not wrap. So each
header cell is a ``<pre>``, its words on lines no wider than the column's longest word: no column is then narrower than
a word in it, and a table wider than its card scrolls instead.
"""

from __future__ import annotations

import html
import math
import re
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
# a <pre>'s characters (monospace, 13/16 of the text's size) against a cell's: room for the widest word of a column
PRE_CHARACTER = 1.25
WIDEST = 40  # characters: a column's header is not padded wider than this (a word longer than it may still break)
ROW = re.compile(r"\|.*\|")
RULE = re.compile(r"\|(?::?-+:?\|)+")  # a table's line under its header
ESCAPED = re.compile(r"\\(.)")


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


def write_profile_events(run_dir, record: ProfileRecord, extract: Extract | None, card: str | None = None) -> None:
    """TensorBoard event files in ``run_dir``: scalars per step and region, the run's card as Text (``card``, as the
    profile printed it; built from ``record`` where not given), its median step's timeline (where ``extract`` is
    given) and a per-region chart as Images."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(run_dir)) as writer, tempfile.TemporaryDirectory() as tmp:
        for tag, value, step in scalars(record):
            writer.add_scalar(tag, value, step)
        writer.add_text("summary/tables", text_tab(card if card is not None else run_card(record)))
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
            writer.add_text(f"compare/{mode}", text_tab(text))
        for name, png in images.items():
            writer.add_image(f"{COMPARE_GROUP}/{name}", read_png(png), dataformats="HWC")


def text_tab(markdown: str) -> str:
    """``markdown`` for TensorBoard's Text tab: each table's header cells a ``<pre>`` as wide as its column's longest
    word (see the module's docstring), the rest as it is."""
    lines = markdown.split("\n")
    for i in range(len(lines) - 1):
        if ROW.fullmatch(lines[i]) and RULE.fullmatch(lines[i + 1]):
            end = next((j for j in range(i + 2, len(lines)) if not ROW.fullmatch(lines[j])), len(lines))
            lines[i] = pre_headers(cells(lines[i]), [cells(row) for row in lines[i + 2 : end]])
    return "\n".join(lines)


def pre_headers(headers: list[str], rows: list[list[str]]) -> str:
    """A table's header row, each cell a ``<pre>`` as wide as the longest word of its column."""
    columns = [[row[k] for row in rows if k < len(row)] for k in range(len(headers))]
    return "| " + " | ".join(map(pre_header, headers, map(column_width, headers, columns))) + " |"


def cells(row: str) -> list[str]:
    """A table row's cells as written (escapes kept), split at its unescaped ``|``."""
    found, cell, escaped = [], "", False
    for char in row.strip()[1:-1]:
        if char == "|" and not escaped:
            found.append(cell.strip())
            cell = ""
            continue
        cell += char
        escaped = char == "\\" and not escaped
    return found + [cell.strip()]


def shown(cell: str) -> list[str]:
    """The words of a cell as the tab shows them, near enough: markdown's marks and escapes, and entities, undone."""
    text = ESCAPED.sub(r"\1", cell.replace("**", "").replace("`", ""))
    return html.unescape(text).split()


def column_width(header: str, column: list[str]) -> int:
    """Characters of a column's ``<pre>``: its header's longest word, or room for its cells' longest in a wider font."""
    words = [len(w) for w in shown(header)] + [math.ceil(PRE_CHARACTER * len(w)) for c in column for w in shown(c)]
    return min(WIDEST, max(words, default=1))


def pre_header(header: str, width: int) -> str:
    """A header cell as a ``<pre>`` of ``width`` characters: its words on lines no wider, each line centred."""
    lines = [""]
    for word in header.split():
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width:
            lines.append(word)
        else:
            lines[-1] = f"{lines[-1]} {word}".strip()
    return "<pre>" + "&#10;".join(line.center(max(width, len(line))) for line in lines) + "</pre>"


def read_png(path) -> np.ndarray:
    """A PNG as the [H, W, 3] uint8 array that SummaryWriter.add_image(dataformats="HWC") takes."""
    from matplotlib.image import imread

    image = imread(path)  # [H, W, 4] float in [0, 1] for a matplotlib PNG
    return (image[..., :3] * 255 + 0.5).astype(np.uint8)
