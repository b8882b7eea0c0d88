"""Every registered strategy against its float64 reference (giou_loss_reference, the contract), loss and gradient,
over one grid.

A strategy registered in detector.losses.STRATEGIES is picked up here without edits. ``--strategy NAME`` runs the
grid on that strategy only, one from outside the package included (``--strategy my_ciou:ciou_loss``): a loss of
another kind than GIoU is checked against its own reference (``Strategy.reference``, which per_box_loss sets). The
reference is computed from copies of the inputs that the strategy never sees, and a strategy that writes to its
inputs (pred or the targets' tensors) fails, naming the tensor. tests/losses/test_grid.py checks that the grid fails
losses that are wrong in those ways and in others.
"""

import pytest
import torch

from detector.data import make_targets
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES, get_strategy, giou_loss_reference

# pred dtype, loss rtol, gradient rtol, gradient atol as a fraction of the largest reference gradient.
# Strategies compute in fp32 from the very values the fp64 reference sees, so the loss agrees to fp32
# rounding whatever the pred dtype; the gradient is stored in pred's dtype, so bf16 gradients carry
# bf16 rounding (2^-8 relative) on top.
TOLERANCES = {
    torch.float32: (1e-5, 1e-4, 1e-5),
    torch.bfloat16: (1e-5, 1e-2, 1e-2),
}
GRID = [
    (pred_dtype, target_dtype, batch, distribution)
    for pred_dtype in TOLERANCES
    for target_dtype in (torch.uint8, torch.float32)
    for batch in (1, 7, 64)
    for distribution in ("zero", "one_full", "seed")
]
# The weird rows: a prime number of slots, crowds, degenerate (zero-area) boxes, fp16 and int32 targets.
WEIRD = [
    (torch.float32, torch.uint8, 7, "seed", 13),
    (torch.float32, torch.float32, 5, "full", 13),
    (torch.float32, torch.float32, 7, "degenerate", 256),
    (torch.bfloat16, torch.int32, 64, "tail", 256),
    (torch.float16, torch.float16, 7, "seed", 256),
]
TOLERANCES[torch.float16] = (1e-5, 5e-3, 5e-3)  # fp16 gradients: 2^-11 relative rounding
# Every row with its slots and seed, as the two tests below draw them (tests/losses/test_grid.py runs them all).
ROWS = [(*row, 256, row[2]) for row in GRID] + [(*row, row[4]) for row in WEIRD]


def pytest_generate_tests(metafunc):
    """``name``: the strategies of ``--strategy`` (tests/conftest.py checks them), else every registered one."""
    if "name" in metafunc.fixturenames:
        metafunc.parametrize("name", metafunc.config.getoption("strategy", default=[]) or list(STRATEGIES))


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]


def named_inputs(pred, targets) -> dict[str, torch.Tensor]:
    """The tensors a strategy is handed, by the name a message gives them."""
    named = {"pred": pred.detach()}
    if isinstance(targets.boxes, torch.Tensor):
        named["targets.boxes"] = targets.boxes
    else:
        named |= {f"targets.boxes[{b}]": boxes for b, boxes in enumerate(targets.boxes)}
    if hasattr(targets, "counts"):
        named["targets.counts"] = targets.counts
    return named


def check_against_reference(strategy, pred, boxes_list, max_boxes, device):
    reason = strategy.unavailable(torch.device(device))
    if reason:
        pytest.skip(f"{strategy.name} on {device}: {reason}")
    # The reference first, from copies: list targets share their tensors with boxes_list, so a strategy that
    # changed them would otherwise move the reference along with its own loss.
    ref_pred = pred.detach().clone().double().requires_grad_()
    reference = strategy.reference or giou_loss_reference
    ref = reference(ref_pred, make_targets([b.clone() for b in boxes_list], "padded", max_boxes))
    ref.backward()

    targets = make_targets(boxes_list, strategy.layout, max_boxes).to(device)
    p = pred.clone().to(device).requires_grad_()
    given = {name: t.clone() for name, t in named_inputs(p, targets).items()}
    loss = strategy(p, targets)
    loss.backward()
    after = named_inputs(p, targets)
    for name, before in given.items():  # NaN padding equals NaN padding; any other change is a write
        unchanged = name in after and before.shape == after[name].shape
        unchanged = unchanged and torch.isclose(after[name], before, rtol=0, atol=0, equal_nan=True).all()
        assert unchanged, f"{strategy.name} wrote to its input {name}: a loss must leave pred and targets as given"

    loss_rtol, grad_rtol, grad_atol = TOLERANCES[pred.dtype]
    assert loss.dim() == 0 and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=loss_rtol, atol=1e-6)
    grad = p.grad.cpu()
    assert grad.dtype == pred.dtype
    valid = torch.arange(max_boxes) < torch.tensor([len(b) for b in boxes_list])[:, None]
    assert torch.all(grad[~valid] == 0), "padded slots must get exactly zero gradient"
    assert torch.isfinite(grad).all()
    scale = ref_pred.grad.abs().max().item()
    torch.testing.assert_close(grad.double(), ref_pred.grad, rtol=grad_rtol, atol=grad_atol * scale + 1e-12)
    return loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pred_dtype,target_dtype,batch,distribution", GRID, ids=lambda v: str(v).replace("torch.", ""))
def test_strategy_matches_reference(name, device, pred_dtype, target_dtype, batch, distribution):
    pred, boxes_list = random_case(batch, 256, distribution, pred_dtype, target_dtype, seed=batch)
    loss = check_against_reference(get_strategy(name), pred, boxes_list, 256, device)
    if distribution == "zero":
        assert loss.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "pred_dtype,target_dtype,batch,distribution,max_boxes", WEIRD, ids=lambda v: str(v).replace("torch.", "")
)
def test_strategy_weird_inputs(name, device, pred_dtype, target_dtype, batch, distribution, max_boxes):
    pred, boxes_list = random_case(batch, max_boxes, distribution, pred_dtype, target_dtype, seed=max_boxes)
    check_against_reference(get_strategy(name), pred, boxes_list, max_boxes, device)


def runnable_device(strategy) -> str:
    """A device the strategy runs on here (the Triton kernels take only CUDA tensors where CUDA exists)."""
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        if not strategy.unavailable(torch.device(device)):
            return device
    pytest.skip(f"{strategy.name}: {strategy.unavailable(torch.device('cpu'))}")


def test_strategy_rejects_bad_predictions(name):
    strategy = get_strategy(name)
    device = runnable_device(strategy)
    _, boxes_list = random_case(2, 8, "seed")
    targets = make_targets(boxes_list, strategy.layout, 8).to(device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match="pred"):
        strategy(torch.zeros(2, 8, 5, device=device), targets)  # last dimension is not 4
    with pytest.raises((ValueError, TypeError, RuntimeError), match="pred"):
        strategy(torch.zeros(2, 8, 4, dtype=torch.int32, device=device), targets)  # not floating
    with pytest.raises((ValueError, TypeError, RuntimeError), match="pred|batch"):
        strategy(torch.zeros(3, 8, 4, device=device), targets)  # batch mismatch


def test_strategy_rejects_wrong_layout(name):
    strategy = get_strategy(name)
    other = next(layout for layout in ("list", "padded") if layout != strategy.layout)
    targets = make_targets(random_case(2, 8, "seed")[1], other, 8)
    with pytest.raises(TypeError, match=strategy.layout):
        strategy(torch.zeros(2, 8, 4), targets)


def test_unknown_strategy_lists_the_valid_names():
    with pytest.raises(KeyError) as err:
        get_strategy("no-such-strategy")
    for name in STRATEGIES:
        assert name in str(err.value)
