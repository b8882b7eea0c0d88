"""The detector: output shape and parametrisation, and that it can learn faces through the loss."""

import pytest
import torch

from detector.data import FaceSampler, SyntheticFaces, collate_fn
from detector.losses import STRATEGIES
from detector.model import FaceDetector


def test_output_is_m_proper_boxes_per_image():
    model = FaceDetector(image_size=64, max_boxes=256, channels=[4, 16, 64, 256], hidden=32)
    boxes = model(torch.randint(0, 256, (3, 1, 64, 64), dtype=torch.uint8))
    assert boxes.shape == (3, 256, 4)
    assert torch.all(boxes[..., 2] > boxes[..., 0]) and torch.all(boxes[..., 3] > boxes[..., 1])
    centre = (boxes[..., :2] + boxes[..., 2:]) / 2
    assert torch.all((centre >= 0) & (centre <= 64))


def test_image_size_must_survive_the_pooling():
    with pytest.raises(ValueError, match="divisible by 2\\*\\*4"):
        FaceDetector(image_size=40, max_boxes=8, channels=[4, 16, 64, 256], hidden=8)


def test_loss_falls_by_a_large_factor_on_one_fixed_batch():
    torch.manual_seed(0)
    dataset = SyntheticFaces(FaceSampler(image_size=32, max_boxes=8), length=8)
    images, targets = collate_fn("padded", 8)([dataset[i] for i in range(8)])
    model = FaceDetector(image_size=32, max_boxes=8, channels=[4, 8, 8, 8], hidden=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(300):
        loss = STRATEGIES["padded"](model(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 5, f"loss went from {losses[0]:.3f} to only {losses[-1]:.3f}"
