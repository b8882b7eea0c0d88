"""Second derivatives: every strategy either gives padded's (autograd all the way) or refuses clearly.

The fused strategies compute their gradient in a kernel with no graph behind it (triton inside its
forward kernel; cuda_fused, cuda_conditional and packed in one backward kernel), and neither
torch.compile's backward nor that of chunk and amax on jagged nested tensors (nested) can be
differentiated again: a backward with create_graph=True must raise at once, never return a wrong (zero
or missing) second derivative.
"""

import warnings

import pytest
import torch

from detector.data import make_targets
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES

# Strategies whose gradient has no graph: a backward with create_graph=True must raise.
FIRST_ORDER_ONLY = {"compiled", "triton", "cuda_fused", "cuda_conditional", "packed", "nested", "nested_compiled"}


def case():
    """fp64 predictions (second derivatives compared tightly), a few boxes of every kind, no NaN."""
    return random_case(3, 8, "seed", torch.float64, torch.uint8, seed=1, nan_padding=False)


def first_grad(strategy, pred, boxes_list):
    """d loss / d pred with create_graph=True."""
    targets = make_targets(boxes_list, strategy.layout, pred.shape[1])
    p = pred.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cuda_* strategies say once that the CPU kernel serves them
        loss = strategy(p, targets)
    (grad,) = torch.autograd.grad(loss, p, create_graph=True)
    return p, grad


def second_derivative(strategy, pred, boxes_list):
    """d/d pred of sum(w * d loss / d pred) for a fixed w: a Hessian-vector product."""
    p, grad = first_grad(strategy, pred, boxes_list)
    w = torch.linspace(-1, 1, grad.numel(), dtype=grad.dtype).view_as(grad)
    (hvp,) = torch.autograd.grad((grad * w).sum(), p)
    return hvp


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_double_backward_is_right_or_refused(name):
    strategy = STRATEGIES[name]
    reason = strategy.unavailable(torch.device("cpu"))
    if reason:
        pytest.skip(f"{name} on cpu: {reason}")
    pred, boxes_list = case()
    if name in FIRST_ORDER_ONLY:
        with pytest.raises(RuntimeError, match="double backward") as err:
            first_grad(strategy, pred, boxes_list)
        assert name in str(err.value)
        return
    want = second_derivative(STRATEGIES["padded"], pred, boxes_list)
    assert want.abs().max() > 0  # a second derivative that is not trivially zero
    torch.testing.assert_close(second_derivative(strategy, pred, boxes_list), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(FIRST_ORDER_ONLY))
def test_first_order_backward_still_works(name):
    """The refusal is for create_graph=True only: a plain backward right after is unaffected."""
    strategy = STRATEGIES[name]
    reason = strategy.unavailable(torch.device("cpu"))
    if reason:
        pytest.skip(f"{name} on cpu: {reason}")
    pred, boxes_list = case()
    targets = make_targets(boxes_list, strategy.layout, pred.shape[1])
    p = pred.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy(p, targets).backward()
    assert p.grad is not None and p.grad.abs().sum() > 0
