"""Predictions you can see: images with their true boxes and the model's drawn on them, for TensorBoard's Images
(``eval/predictions`` at each evaluation) and ``detector predict``.

The detector predicts one box per target slot (the loss pairs slot j with the image's j-th face) and no score, so
an image's predictions are its first n slots, n being its number of faces; on an image of one's own, where n is
not known, ``detector predict --faces N`` says how many to draw.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor

from detector.train.metrics import box_iou

TRUE, PREDICTED = "#2ca02c", "#d62728"  # green and red: the true boxes and the model's
SHOWN = 8  # images in an evaluation's picture


def prediction_figure(
    images: Tensor, pred: Tensor, counts: Tensor, truth: Tensor | None, titles=None, title: str | None = None
) -> Figure:
    """A grid of ``images`` [N, 1, S, S] uint8, each with its first ``counts[i]`` predicted boxes (``pred`` [N, M, 4]
    xyxy) in red and, where ``truth`` [N, M, 4] is given, its true boxes in green, titled with their mean IoU;
    ``title`` above the grid, in a band of its own (a suptitle alone would overlap the images' titles)."""
    n = len(images)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(3 * cols, 3.4 * rows), dpi=100)
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= n:
            continue
        size = images.shape[-1]
        ax.imshow(images[i, 0].cpu().numpy(), cmap="gray", vmin=0, vmax=255, extent=(0, size, size, 0))
        k = int(counts[i])
        boxes = pred[i, :k].float().cpu()
        label = titles[i] if titles else f"image {i}"
        if truth is not None:
            true = truth[i, :k].float().cpu()
            for box in true:
                ax.add_patch(rectangle(box, TRUE, "-"))
            label += f": {k} face{'' if k == 1 else 's'}" + (
                f", mean IoU {box_iou(boxes, true).mean():.2f}" if k else ""
            )
        for box in boxes:
            ax.add_patch(rectangle(box, PREDICTED, "--"))
        ax.set_title(label, fontsize=9)
    legend = [Rectangle((0, 0), 1, 1, fill=False, edgecolor=PREDICTED, linestyle="--", label="predicted")]
    if truth is not None:
        legend.insert(0, Rectangle((0, 0), 1, 1, fill=False, edgecolor=TRUE, label="true"))
    fig.legend(handles=legend, loc="lower center", ncol=2, frameon=False)
    top = 1.0
    if title:
        top -= 0.35 / fig.get_figheight()  # a line of 10-point text, in inches of the figure's height
        fig.suptitle(title, fontsize=10, y=0.995, va="top")
    fig.tight_layout(rect=(0, 0.04, 1, top))
    return fig


def pixels(fig: Figure) -> np.ndarray:
    """The figure as an [H, W, 3] uint8 image (TensorBoard's Images)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def rectangle(box: Tensor, color: str, style: str) -> Rectangle:
    x1, y1, x2, y2 = box.tolist()  # xyxy pixels: a box covers x1 .. x2 inclusive
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
