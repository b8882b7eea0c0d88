"""`detector predict`: the picture of a trained detector's boxes on images of the run's data, by index (with their
true boxes), or on image files of one's own (pictures.py draws it; matplotlib is imported only then, once the
arguments are checked and the model read)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from detector.config.schema import DataConfig
from detector.data import build_dataset
from detector.data.targets import make_targets
from detector.errors import UserError
from detector.train.evaluate.export import load_model

MOST_FACES = 16  # boxes drawn on an image file: each is a slot the model fills whether or not a face is there


def run_predict(run: Path, indices: list[int], files: list[str], faces: int, out: str | None) -> tuple[Path, str]:
    """Draw the predictions; returns the picture's path and what was read of the model (in words)."""
    if not indices and not files:
        raise UserError("name samples by index (e.g. 0 1 2) or image files (--images a.png b.jpg) to predict on")
    if any(i < 0 for i in indices):
        raise UserError(f"sample indices are >= 0, got {min(indices)}")
    if not 1 <= faces <= MOST_FACES:
        raise UserError(f"--faces {faces}: expected 1 to {MOST_FACES}, the boxes to draw on each image file")
    model, saved = load_model(run)
    size, slots = saved["arguments"]["image_size"], saved["arguments"]["max_boxes"]
    images, counts, truth, titles = [], [], [], []
    if indices:
        data = OmegaConf.merge(OmegaConf.structured(DataConfig), saved["config"]["data"])
        dataset = build_dataset(data, length=max(indices) + 1)
        samples = [dataset[i] for i in indices]
        targets = make_targets([boxes for _, boxes in samples], "padded", slots)
        images += [image for image, _ in samples]
        counts += targets.counts.tolist()
        truth += list(targets.boxes.float())
        titles += [f"sample {i}" for i in indices]
    for name in files:
        images.append(read_image(Path(name), size))
        counts.append(min(faces, slots))
        truth.append(torch.full((slots, 4), float("nan")))
        titles.append(Path(name).name)
    from detector.train.evaluate.pictures import predict, prediction_figure

    batch = torch.stack(images)  # [N, 1, S, S] uint8
    pred = predict(model, batch, torch.device("cpu"))
    shown = torch.stack(truth) if indices else None
    fig = prediction_figure(batch, pred, torch.tensor(counts), shown, titles)
    path = Path(out) if out else (run if run.is_dir() else run.parent) / "predictions.png"
    path = path / "predictions.png" if path.is_dir() else path  # a folder: the picture in it
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path, saved["read"]


def read_image(path: Path, size: int) -> torch.Tensor:
    """An image file as the model reads images: [1, size, size] uint8 grayscale (resized, colours averaged)."""
    from matplotlib.image import imread

    try:
        pixels = np.asarray(imread(path), dtype=np.float32)
    except (OSError, ValueError, SyntaxError) as err:
        raise UserError(f"{path}: cannot read it as an image ({' '.join(str(err).split())[:120]})") from None
    if pixels.ndim == 3:
        pixels = pixels[..., :3].mean(-1)  # colour: the mean of the channels (an alpha channel left out)
    if pixels.max() <= 1.0:
        pixels = pixels * 255  # PNG: floats in [0, 1]
    image = torch.from_numpy(pixels)[None, None]
    image = F.interpolate(image, size=(size, size), mode="bilinear", align_corners=False)
    return image[0].round().clamp(0, 255).to(torch.uint8)
