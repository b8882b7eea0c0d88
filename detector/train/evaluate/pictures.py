"""Predictions you can see: images with their true boxes and the model's drawn on them, for TensorBoard's Images
(``eval/predictions`` at each evaluation) and ``detector predict``.

The detector predicts one box per target slot (the loss pairs slot j with the image's j-th face) and no score, so
an image's predictions are its first n slots, n being its number of faces; on an image of one's own, where n is
not known, ``detector predict --faces N`` says how many to draw.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from detector.train.evaluate.metrics import box_iou

if TYPE_CHECKING:  # matplotlib is imported where a picture is drawn: a run's in its drawing thread, which keeps its
    # import (most of a second) off the loop's thread, where the first evaluation would wait for it
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

TRUE, PREDICTED = "#2ca02c", "#d62728"  # green and red: the true boxes and the model's
SHOWN = 4  # images in an evaluation's picture: two rows of two
COLUMNS = 2
# The grid's geometry, in inches at 100 dpi: each image in a square of its own under a title band of two lines, so
# that no title reaches into the row above. Two columns are 350 px wide, the width of TensorBoard's image cards
# (Images and Time Series), which show the picture at its own size, its 9-point titles readable without a zoom
IMAGE, GAP, TITLE = 1.57, 0.12, 0.38
HEAD, FOOT = 0.34, 0.3  # the picture's title band, and the legend's
TITLE_CHARS = 24  # a title's first line at 9 points within the image's width; a longer name is cut with "…"


def prediction_figure(
    images: Tensor, pred: Tensor, counts: Tensor, truth: Tensor | None, titles=None, title: str | None = None
) -> Figure:
    """A grid of ``images`` [N, 1, S, S] uint8, two a row, each with its first ``counts[i]`` predicted boxes
    (``pred`` [N, M, 4] xyxy) in red and, where ``truth`` [N, M, 4] is given, its true boxes in green, titled with
    their number and mean IoU; ``title`` above the grid, in a band of its own. Every part has its own place (no
    layout engine): the titles sit in bands between the rows, never over an image."""
    n = len(images)
    cols = max(1, min(COLUMNS, n))
    rows = math.ceil(n / cols)
    head = HEAD if title else GAP
    width = cols * IMAGE + (cols + 1) * GAP
    height = head + rows * (TITLE + IMAGE) + (rows - 1) * GAP + FOOT
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    fig = Figure(figsize=(width, height), dpi=100)
    for i in range(n):
        row, col = divmod(i, cols)
        top = height - head - row * (TITLE + IMAGE + GAP) - TITLE  # inches from the figure's foot
        box = (GAP + col * (IMAGE + GAP)) / width, (top - IMAGE) / height, IMAGE / width, IMAGE / height
        ax = fig.add_axes(box)
        ax.axis("off")
        size = images.shape[-1]
        ax.imshow(images[i, 0].cpu().numpy(), cmap="gray", vmin=0, vmax=255, extent=(0, size, size, 0))
        k = int(counts[i])
        boxes = pred[i, :k].float().cpu()
        name = titles[i] if titles else f"image {i}"
        name = name if len(name) <= TITLE_CHARS else name[: TITLE_CHARS - 1] + "…"
        details = f"{k} box{'' if k == 1 else 'es'} drawn"
        if truth is not None:
            true = truth[i, :k].float().cpu()
            for box in true:
                ax.add_patch(rectangle(box, TRUE, "-"))
            details = f"{k} face{'' if k == 1 else 's'}"
            details += f", mean IoU {box_iou(boxes, true).mean():.2f}" if k else ""
        for box in boxes:
            ax.add_patch(rectangle(box, PREDICTED, "--"))
        ax.set_xlim(0, size)  # the boxes' patches do not widen the image's square
        ax.set_ylim(size, 0)
        ax.set_title(f"{name}\n{details}", fontsize=9, linespacing=1.2, pad=3)
    legend = [Rectangle((0, 0), 1, 1, fill=False, edgecolor=PREDICTED, linestyle="--", label="predicted")]
    if truth is not None:
        legend.insert(0, Rectangle((0, 0), 1, 1, fill=False, edgecolor=TRUE, label="true"))
    fig.legend(handles=legend, loc="lower center", ncol=2, frameon=False, fontsize=9, borderaxespad=0.2)
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.08 / height, va="top")
    return fig


def pixels(fig: Figure) -> np.ndarray:
    """The figure as an [H, W, 3] uint8 image (TensorBoard's Images)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def rectangle(box: Tensor, color: str, style: str) -> Rectangle:
    x1, y1, x2, y2 = box.tolist()  # xyxy pixels: a box covers x1 .. x2 inclusive
    from matplotlib.patches import Rectangle

    return Rectangle((x1, y1), x2 - x1 + 1, y2 - y1 + 1, fill=False, edgecolor=color, linestyle=style, linewidth=1.2)


@torch.no_grad()
def predict(model, images: Tensor, device: torch.device, autocast=None) -> Tensor:
    """The model's boxes [N, M, 4] of ``images`` [N, 1, S, S] uint8, in eval mode (restored after)."""
    was_training = model.training
    model.eval()
    try:
        with autocast or torch.autocast(device.type, enabled=False):
            return model(images.to(device)).float()
    finally:
        model.train(was_training)
