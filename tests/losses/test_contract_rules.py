"""The contract's rules for hand-built targets and extreme values, run on every registered strategy alike.

Counts of any integer dtype, clamped to [0, M]; bool boxes and anything but the three layout classes
refused with TypeError; empty batches (B = 0) and slot-less predictions (M = 0) give a loss of 0 that
backward goes through; coordinates up to |x| = 2**62 match the reference, a non-finite one in a valid
slot gives a non-finite loss. See the docstring of detector.losses.giou_loss_reference.
"""

import math

import pytest
import torch

from detector.data.targets import ListTargets, PackedTargets, PaddedTargets
from detector.losses import STRATEGIES, giou_loss_reference

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]


def runnable(name: str, device: str):
    strategy = STRATEGIES[name]
    reason = strategy.unavailable(torch.device(device))
    if reason:
        pytest.skip(f"{name} on {device}: {reason}")
    return strategy


def batch(counts: list[int], max_boxes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """pred [B, M, 4] fp32 and padded target boxes [B, M, 4] fp32: random proper boxes in every slot."""
    g = torch.Generator().manual_seed(seed)

    def boxes():
        xy = torch.rand(len(counts), max_boxes, 2, generator=g) * 50
        return torch.cat([xy, xy + 1 + torch.rand(len(counts), max_boxes, 2, generator=g) * 30], dim=-1)

    return boxes(), boxes()


def as_layout(layout: str, boxes: torch.Tensor, counts: torch.Tensor):
    """Hand-built targets of ``layout`` holding the same batch: the list and packed layouts hold the boxes
    of the clamped counts (their own invariants: n_i <= M, N = sum of the clamped counts)."""
    if layout == "padded":
        return PaddedTargets(boxes, counts)
    kept = [boxes[b, :n] for b, n in enumerate(counts.long().clamp(0, boxes.shape[1]).tolist())]
    if layout == "packed":
        return PackedTargets(torch.cat(kept) if kept else boxes.new_zeros(0, 4), counts)
    return ListTargets(kept)


def check_equals_reference(name, device, counts, count_dtype, max_boxes):
    strategy = runnable(name, device)
    pred, boxes = batch(counts, max_boxes)
    raw = torch.tensor(counts, dtype=count_dtype)
    targets = as_layout(strategy.layout, boxes, raw).to(device)
    p = pred.clone().to(device).requires_grad_()
    loss = strategy(p, targets)
    loss.backward()

    clamped = torch.tensor(counts).clamp(0, max_boxes)
    ref_pred = pred.double().requires_grad_()
    ref = giou_loss_reference(ref_pred, boxes.double(), clamped)
    ref.backward()
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p.grad.double().cpu(), ref_pred.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("counts,max_boxes", [([9, -3, 2, 5], 5), ([2, -1], 0)], ids=["M=5", "M=0"])
def test_counts_outside_the_slots_are_clamped(name, device, counts, max_boxes):
    check_equals_reference(name, device, counts, torch.int64, max_boxes)  # M = 5: 9 -> 5, -3 -> 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_uint8_counts(name, device):
    check_equals_reference(name, device, [3, 0, 5, 1], torch.uint8, 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_int64_counts(name, device):
    check_equals_reference(name, device, [3, 0, 5, 1], torch.int64, 5)


def test_reference_clamps_counts():
    pred, boxes = batch([9, -3, 2], 5)
    clamped = giou_loss_reference(pred, boxes, torch.tensor([5, 0, 2]))
    for counts in (torch.tensor([9, -3, 2]), torch.tensor([5, 0, 2], dtype=torch.uint8)):
        assert torch.equal(giou_loss_reference(pred, boxes, counts), clamped)
        packed = as_layout("packed", boxes, counts)
        assert torch.equal(giou_loss_reference(pred, packed), clamped)


def test_reference_refuses_packed_boxes_that_do_not_match_the_counts():
    pred, boxes = batch([2, 1], 3)
    with pytest.raises(ValueError, match=r"targets.boxes has 4 boxes but the counts, clamped to \[0, 3\], sum to 3"):
        giou_loss_reference(pred, PackedTargets(boxes[:, :2].reshape(4, 4), torch.tensor([2, 1])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_bool_boxes_are_refused(name, device):
    strategy = runnable(name, device)
    pred, boxes = batch([2, 1], 3)
    targets = as_layout(strategy.layout, boxes > 10, torch.tensor([2, 1])).to(device)
    with pytest.raises(TypeError, match=r"targets.boxes.* must be integer or floating, got dtype torch.bool"):
        strategy(pred.to(device), targets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_plain_tuple_is_refused(name, device):
    strategy = runnable(name, device)
    pred, boxes = batch([2, 1], 3)
    with pytest.raises(TypeError, match=r"targets must be ListTargets, .* \(detector.data.targets.make_targets\)"):
        strategy(pred.to(device), (boxes.to(device), torch.tensor([2, 1], device=device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("shape", [(0, 4), (3, 0)], ids=["B=0", "M=0"])
def test_empty_batches_give_zero_connected_to_the_graph(name, device, shape):
    strategy = runnable(name, device)
    pred, boxes = batch([1] * shape[0], shape[1])
    targets = as_layout(strategy.layout, boxes, torch.zeros(shape[0], dtype=torch.int64)).to(device)
    p = pred.to(device).requires_grad_()
    loss = strategy(p, targets)
    assert loss.item() == 0.0 and loss.dtype == torch.float32
    loss.backward()
    assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


@pytest.mark.parametrize("name", [name for name in STRATEGIES if STRATEGIES[name].layout == "list"])
def test_list_targets_on_another_device_name_it(name):
    pred, boxes = batch([2, 1], 3)
    targets = ListTargets([boxes[0, :2], boxes[1, :1].to("meta")])
    with pytest.raises(ValueError, match=r"one device, got cpu, meta"):
        STRATEGIES[name](pred, targets)


def far_boxes(limit: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pred and targets [2, 6, 4] fp32 with |x| <= limit: boxes of 1 px up to the whole range, and in
    slot 0 the worst case for fp32 areas, boxes spanning the range (enclosing area 4 limit**2)."""
    g = torch.Generator().manual_seed(seed)
    centre = (torch.rand(4, 6, 2, generator=g, dtype=torch.float64) * 2 - 1) * limit * 0.9
    size = 2 ** (torch.rand(4, 6, 2, generator=g, dtype=torch.float64) * math.log2(limit))
    boxes = torch.cat([centre - size / 2, centre + size / 2], dim=-1).clamp(-limit, limit)
    boxes[0, 0], boxes[2, 0] = torch.tensor([[-1, -1, 1, 1], [-1, -0.5, 1, 1]], dtype=torch.float64) * limit
    boxes[1, 0], boxes[3, 0] = torch.tensor([[-1, -1, 0, 1], [0, -1, 1, 1]], dtype=torch.float64) * limit  # touching
    return boxes[:2].float(), boxes[2:].float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("limit", [2.0**20, 2.0**62], ids=["2**20", "2**62"])  # at 2**64 every strategy fails
def test_coordinates_within_the_range_match_the_reference(name, device, limit):
    strategy = runnable(name, device)
    pred, boxes = far_boxes(limit, seed=int(math.log2(limit)))
    counts = torch.tensor([6, 4])
    p = pred.clone().to(device).requires_grad_()
    loss = strategy(p, as_layout(strategy.layout, boxes, counts).to(device))
    loss.backward()
    ref_pred = pred.double().requires_grad_()
    ref = giou_loss_reference(ref_pred, boxes.double(), counts)
    ref.backward()
    # the tolerances of tests/losses/test_strategies.py for fp32 predictions
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
    scale = ref_pred.grad.abs().max().item()
    torch.testing.assert_close(p.grad.double().cpu(), ref_pred.grad, rtol=1e-4, atol=1e-5 * scale)


NON_FINITE = [(where, value, k) for where in ("pred", "target") for value in ("inf", "-inf", "nan") for k in range(4)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("where,value,k", NON_FINITE)
def test_a_non_finite_coordinate_in_a_valid_slot_gives_a_non_finite_loss(name, device, where, value, k):
    strategy = runnable(name, device)
    pred, boxes = batch([3, 2], 3)
    counts = torch.tensor([3, 2])
    clean = pred.clone().to(device).requires_grad_()
    strategy(clean, as_layout(strategy.layout, boxes, counts).to(device)).backward()
    (pred if where == "pred" else boxes)[0, 1, k] = float(value)  # slot 1 of image 0 is valid
    p = pred.to(device).requires_grad_()
    loss = strategy(p, as_layout(strategy.layout, boxes, counts).to(device))
    loss.backward()
    assert not torch.isfinite(loss), "the loss must not look finite"
    others = torch.ones(2, 3, dtype=torch.bool)
    others[0, 1] = False
    torch.testing.assert_close(p.grad[others], clean.grad[others])  # every other box as without it
