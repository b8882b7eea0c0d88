"""The loss contract itself: analytic cases, gradcheck, empty batches, NaN padding, validation."""

import pytest
import torch

from detector.data import make_targets
from detector.data.targets import ListTargets, PackedTargets, PaddedTargets
from detector.losses import giou_loss_reference
from detector.losses.geometry import giou_loss_per_box


def loss_of(pred_box, target_box, target_dtype=torch.float64):
    pred = torch.tensor([[pred_box]], dtype=torch.float64)
    return giou_loss_reference(pred, torch.tensor([[target_box]], dtype=target_dtype), torch.tensor([1])).item()


def test_identical_boxes_have_zero_loss():
    # a 10x10 box on itself: IoU = 1, the enclosing box is the union, GIoU = 1
    assert loss_of([0, 0, 10, 10], [0, 0, 10, 10]) == pytest.approx(0.0, abs=1e-8)


def test_far_apart_boxes_lose_more_than_one():
    # unit boxes in opposite corners of a 10x10 square: IoU = 0, union 2, enclosing 100
    # GIoU = 0 - (100 - 2) / 100 = -0.98, loss = 1.98
    assert loss_of([0, 0, 1, 1], [9, 9, 10, 10]) == pytest.approx(1.98, rel=1e-6)


def test_hand_computed_overlap():
    # [0,2]^2 and [1,3]^2: intersection 1, union 4 + 4 - 1 = 7, enclosing [0,3]^2 = 9
    # GIoU = 1/7 - (9 - 7)/9 = -5/63, loss = 68/63
    assert loss_of([0, 0, 2, 2], [1, 1, 3, 3]) == pytest.approx(68 / 63, rel=1e-6)


def test_touching_boxes_do_not_overlap():
    # side by side, sharing the edge x = 1: intersection 0, enclosing = union = 2, GIoU = 0, loss 1
    assert loss_of([0, 0, 1, 1], [1, 0, 2, 1]) == pytest.approx(1.0, rel=1e-6)


def test_uint8_targets_do_not_wrap():
    # a 255x255 target: its area 65025 wraps in uint8 arithmetic (the article's bug); ours upcasts first
    assert loss_of([0, 0, 255, 255], [0, 0, 255, 255], torch.uint8) == pytest.approx(0.0, abs=1e-6)
    assert loss_of([0, 0, 255, 255], [0, 0, 255, 127], torch.uint8) == pytest.approx(1 - 127 / 255, rel=1e-5)


def test_mean_is_over_all_valid_boxes_of_the_batch():
    # image 0: one identical box (loss 0); image 1: two disjoint touching pairs (loss 1 each) -> 2/3
    pred = torch.tensor([[[0, 0, 1, 1], [5, 5, 6, 6]], [[0, 0, 1, 1], [0, 0, 1, 1]]], dtype=torch.float64)
    target = torch.tensor([[[0, 0, 1, 1], [0, 0, 0, 0]], [[1, 0, 2, 1], [0, 1, 1, 2]]], dtype=torch.float64)
    loss = giou_loss_reference(pred, target, torch.tensor([1, 2]))
    assert loss.item() == pytest.approx(2 / 3, rel=1e-6)


def random_boxes(n, generator):
    xy = torch.rand(n, 2, generator=generator, dtype=torch.float64) * 50
    return torch.cat([xy, xy + 1 + torch.rand(n, 2, generator=generator, dtype=torch.float64) * 30], dim=1)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    pred = random_boxes(3 * 5, g).view(3, 5, 4).requires_grad_()
    target = random_boxes(3 * 5, g).view(3, 5, 4)
    counts = torch.tensor([0, 5, 2])
    assert torch.autograd.gradcheck(lambda p: giou_loss_reference(p, target, counts), (pred,))


def test_no_valid_box_gives_zero_connected_to_the_graph():
    pred = torch.full((2, 3, 4), float("nan"), requires_grad=True)  # padding only, even NaN
    loss = giou_loss_reference(pred, torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.int64))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(pred.grad, torch.zeros_like(pred))


def test_nan_in_padded_slots_reaches_neither_loss_nor_gradient():
    g = torch.Generator().manual_seed(1)
    pred = random_boxes(8, g).view(2, 4, 4)
    target = random_boxes(8, g).view(2, 4, 4)
    counts = torch.tensor([2, 3])
    clean = pred.clone().requires_grad_()
    poisoned = pred.clone()
    poisoned[0, 2:], poisoned[1, 3:] = float("nan"), float("inf")
    poisoned.requires_grad_()
    target_poisoned = target.clone()
    target_poisoned[0, 2:] = float("nan")
    a = giou_loss_reference(clean, target, counts)
    b = giou_loss_reference(poisoned, target_poisoned, counts)
    a.backward(), b.backward()
    assert torch.equal(a, b) and torch.equal(clean.grad, poisoned.grad)
    assert torch.all(poisoned.grad[0, 2:] == 0) and torch.all(poisoned.grad[1, 3:] == 0)


def test_low_precision_predictions_compute_in_fp32():
    pred = torch.tensor([[[0.0, 0.0, 200.0, 200.0]]])
    target = torch.tensor([[[10, 10, 250, 250]]], dtype=torch.uint8)
    ref = giou_loss_per_box(pred.double(), target)
    for dtype in (torch.bfloat16, torch.float16):  # fp16 areas (40000 * ...) would overflow 65504
        loss = giou_loss_reference(pred.to(dtype), target, torch.tensor([1]))
        assert loss.dtype == torch.float32
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_reference_validates_its_inputs():
    pred, target = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"targets.boxes \(target boxes\) must have shape"):
        giou_loss_reference(pred, torch.zeros(2, 4, 4), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="counts must be an integer"):
        giou_loss_reference(pred, target, torch.tensor([1.0, 1.0]))
    with pytest.raises(TypeError, match="pred must be a floating"):
        giou_loss_reference(pred.long(), target, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="counts is required"):
        giou_loss_reference(pred, target)


def test_reference_accepts_every_layout():
    g = torch.Generator().manual_seed(2)
    boxes = [random_boxes(n, g) for n in (0, 3, 1)]
    pred = random_boxes(3 * 4, g).view(3, 4, 4)
    losses = {
        layout: giou_loss_reference(pred, make_targets(boxes, layout, 4)) for layout in ("list", "padded", "packed")
    }
    assert losses["list"] == losses["padded"] == losses["packed"]


@pytest.mark.parametrize(
    "targets,message",
    [
        (PaddedTargets(torch.zeros(2, 3, 5), torch.tensor([1, 1])), r"targets.boxes \(target boxes\) must have shape"),
        (PaddedTargets(torch.zeros(2, 3, 4), torch.tensor([[1, 1]])), r"targets.counts must have shape \[B\]"),
        (PaddedTargets([[0, 0, 1, 1]], torch.tensor([1, 1])), r"targets.boxes must be a torch.Tensor"),
        (PackedTargets(torch.zeros(2, 4, 1), torch.tensor([1, 1])), r"targets.boxes \(target boxes\) must have shape"),
        (ListTargets([torch.zeros(1, 4), torch.zeros(1, 3)]), r"targets.boxes\[1\] \(target boxes of image 1\) must"),
        (ListTargets([torch.zeros(1, 4), [[0, 0, 1, 1]]]), r"targets.boxes\[1\] \(target boxes of image 1\) must be"),
    ],
    ids=["padded last dim", "counts rank", "padded list", "packed rank", "list image shape", "list image type"],
)
def test_hand_built_targets_with_wrong_shapes_name_the_argument(targets, message):
    with pytest.raises((TypeError, ValueError), match=message):
        giou_loss_reference(torch.zeros(2, 3, 4), targets)
