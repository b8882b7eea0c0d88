"""A training run's evaluations: the held-out set, drawn once, and each evaluation's line and scalars
(the measures themselves are detector/train/metrics.py's)."""

from __future__ import annotations

import threading
import time

import torch
from omegaconf import DictConfig

from detector.train.batches import HeldOut
from detector.train.metrics import evaluate


class Evaluation:
    """The held-out batches (``active``: on the processes that evaluate) and the evaluations so far, as
    (step, metrics), restored on resume; ``step``: the last evaluation's, or the step the run resumed at."""

    def __init__(self, cfg: DictConfig, device: torch.device, global_batch: int, evals: list, active: bool, step: int):
        self.device, self.evals, self.active, self.step = device, evals, active, step
        self.held_out = HeldOut(cfg, device, global_batch) if active else None
        self.drawing: threading.Thread | None = None

    def __call__(self, step: int, model, autocast, say=print, writer=None) -> dict:
        """Evaluate ``model`` at ``step``: one line, the eval/ scalars and the picture of its predictions."""
        start = time.perf_counter()
        metrics = evaluate(model, self.held_out.batches, self.device, autocast)
        self.evals.append((step, metrics))
        self.step = step
        if writer:
            for name, value in metrics.items():
                if name != "boxes":
                    writer.add_scalar(f"eval/{name}", value, step)
            self.draw(model, autocast, step, writer)
        say(
            f"eval   {step:6d}  mean IoU {metrics['mean_iou']:.3f}  recall@0.5 {metrics['recall50']:.3f}  "
            f"recall@[.5:.95] {metrics['recall50_95']:.3f}  (mean box: {metrics['trivial_mean_iou']:.3f}, "
            f"{metrics['trivial_recall50']:.3f})  loss {metrics['loss']:.4f}  on {metrics['boxes']} boxes  "
            f"({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        return metrics

    def watch(self, say) -> None:
        """Between steps: the held-out workers' deaths noticed while they draw (``HeldOut.watch``)."""
        if self.held_out is not None:
            self.held_out.watch(say)

    def draw(self, model, autocast, step: int, writer) -> None:
        """The first held-out images with their true boxes and the model's (pictures.py) into TensorBoard's Images:
        the model's boxes now, the drawing in a thread (matplotlib takes a second of the CPU; the steps go on)."""
        # imported at the first evaluation, not with the loop; matplotlib itself in the drawing thread (pictures.py)
        from detector.train.pictures import SHOWN, pixels, predict, prediction_figure

        self.close()  # the previous picture, drawn by now
        images, targets = self.held_out.batches[0]
        images, targets = images[:SHOWN], targets.to(self.device)
        pred = predict(model, images, self.device, autocast).cpu()
        images, counts, truth = images.cpu(), targets.counts[:SHOWN].cpu(), targets.boxes[:SHOWN].cpu()

        def picture() -> None:
            titles = [f"held-out {i}" for i in range(len(images))]
            title = f"step {step}: true boxes green, predicted red"
            fig = prediction_figure(images, pred, counts, truth, titles, title)
            writer.add_image("eval/predictions", pixels(fig), step, dataformats="HWC")

        self.drawing = threading.Thread(target=picture, name="eval-picture", daemon=True)
        self.drawing.start()

    def close(self) -> None:
        """Wait for the picture being drawn, before the writer closes."""
        if self.drawing is not None:
            self.drawing.join()
            self.drawing = None

    def end(self) -> None:
        """The run's end: the last picture drawn, and the held-out workers stopped where they still draw."""
        self.close()
        if self.held_out is not None:
            self.held_out.close()
