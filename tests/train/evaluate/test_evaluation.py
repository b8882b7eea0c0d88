"""The evaluation's picture is drawn by a process of its own (detector/train/evaluate/evaluation.py ``Painter``): the
run's process never holds the interpreter's lock for matplotlib's import and drawing, which slowed the steps beside
it."""

import os

import numpy as np
import pytest
import torch

from detector.train.evaluate.evaluation import PICTURE_SECONDS, Painter
from detector.train.evaluate.pictures import pixels, prediction_figure


def test_the_painter_draws_in_its_own_process_the_picture_the_run_would_have_drawn():
    torch.manual_seed(0)
    images = torch.randint(0, 256, (4, 1, 32, 32), dtype=torch.uint8)
    truth = torch.rand(4, 3, 2).mul(16).repeat(1, 1, 2) + torch.tensor([0.0, 0.0, 8.0, 8.0])  # xyxy, inside 32 px
    pred, counts = truth + torch.randn(4, 3, 4), torch.tensor([0, 1, 2, 3])
    painter = Painter()
    try:
        drawn, pid = painter.draw(images, pred, counts, truth, 7).get(PICTURE_SECONDS)
    finally:
        painter.close()
    assert pid != os.getpid()
    titles = [f"held-out {i}" for i in range(4)]
    here = pixels(prediction_figure(images, pred, counts, truth, titles, "step 7: true boxes green, predicted red"))
    assert drawn.dtype == np.uint8 and drawn.shape == here.shape and drawn.shape[2] == 3
    assert np.array_equal(drawn, here)  # the same picture, pixel for pixel


def test_a_painter_that_died_is_an_error_of_the_picture_alone_not_a_wait():
    """The thread that waits for the picture learns of the painter's death at once, in its error's words; asking it
    for a picture does not fail the evaluation (the run goes on; the thread's failure is said as the run ends)."""
    painter = Painter()
    try:
        painter.process.kill()
        painter.process.join()
        empty = torch.zeros(1, 1, 8, 8, dtype=torch.uint8), torch.zeros(1, 1, 4), torch.zeros(1), torch.zeros(1, 1, 4)
        asked = painter.draw(*empty, 3)
        with pytest.raises(
            RuntimeError, match=r"^the process drawing the evaluation's pictures ended \(exit code -9\)"
        ):
            asked.get(PICTURE_SECONDS)
    finally:
        painter.close()
