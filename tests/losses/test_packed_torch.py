"""``packed_torch`` beyond the strategy grid: no host synchronisation, and the twin of the packed kernel
on the counts the grid does not draw (out of range, rows past or short of their sum)."""

import inspect
import warnings

import pytest
import torch

from detector.data import make_targets
from detector.data.targets import PackedTargets
from detector.kernels import cuda_op
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES
from detector.losses.packed_torch import giou_loss_packed_torch

# Ops that read a device value on the host (a synchronisation on CUDA).
SYNCING_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"}


def packed_case(pred_dtype=torch.float32, nan_padding=True):
    """6 images of 9 slots, uint8 boxes; padded slots of pred NaN unless told otherwise."""
    pred, boxes_list = random_case(6, 9, "tail", pred_dtype, torch.uint8, seed=0, nan_padding=nan_padding)
    slots = pred.shape[1]
    return pred, make_targets(boxes_list, "packed", slots)


def loss_and_grad(fn, pred, targets):
    p = pred.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the packed op says once that its CPU kernel serves CPU tensors
        loss = fn(p, targets)
    loss.backward()
    return loss.detach(), p.grad


def test_no_host_synchronisation():
    """Forward and backward run no op that reads a device value on the host (checked on the CPU)."""
    pred, targets = packed_case()
    p = pred.clone().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        STRATEGIES["packed_torch"](p, targets).backward()
    ops = {event.name for event in prof.events()}
    assert "aten::searchsorted" in ops  # the profile did record the strategy's ops
    assert not ops & SYNCING_OPS, sorted(ops & SYNCING_OPS)
    # .tolist() and .numpy() read memory without an aten op: the source must not call them either
    source = inspect.getsource(giou_loss_packed_torch)
    assert not any(call in source for call in (".tolist(", ".item(", ".numpy(", ".cpu(")), source


@pytest.mark.skipif(cuda_op.kernel_unavailable(torch.device("cpu")) is not None, reason=cuda_op.BUILD_HINT)
@pytest.mark.parametrize(
    "case",
    [
        "as_built",  # counts sum to N
        "out_of_range",  # counts below 0 and above M: clamped
        "extra_rows",  # N > sum of the counts: the extra rows are ignored
        "missing_rows",  # N < sum of the counts: the boxes past row N are absent
    ],
)
@pytest.mark.parametrize("pred_dtype", [torch.float64, torch.bfloat16], ids=str)
def test_twin_of_the_packed_kernel(case, pred_dtype):
    # Clamped counts turn padded slots into valid ones: no NaN there for that case.
    pred, (boxes, counts) = packed_case(pred_dtype, nan_padding=case != "out_of_range")
    if case == "out_of_range":
        counts = counts.clone()
        counts[0], counts[1] = -3, 40  # clamp to 0 and M = 9
        boxes = torch.cat([boxes, boxes])  # enough rows for the clamped counts' sum
    elif case == "extra_rows":
        boxes = torch.cat([boxes, boxes[:5]])
    elif case == "missing_rows":
        boxes = boxes[: boxes.shape[0] - 4]
    targets = PackedTargets(boxes, counts.to(torch.uint8 if case == "as_built" else torch.int64))
    got_loss, got_grad = loss_and_grad(STRATEGIES["packed_torch"], pred, targets)
    want_loss, want_grad = loss_and_grad(STRATEGIES["packed"], pred, targets)
    assert got_loss.dtype == want_loss.dtype and got_grad.dtype == pred_dtype
    tol = {"rtol": 1e-12, "atol": 1e-14} if pred_dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got_loss, want_loss, **tol)
    grad_tol = tol if pred_dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-2 * want_grad.abs().max().item()}
    torch.testing.assert_close(got_grad.double(), want_grad.double(), **grad_tol)


def test_no_slots_at_all():
    """B * M == 0 (host shapes): a zero loss in the compute dtype, still connected to the graph."""
    pred = torch.zeros(0, 8, 4, dtype=torch.float64, requires_grad=True)
    loss = STRATEGIES["packed_torch"](pred, PackedTargets(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)))
    assert loss.item() == 0.0 and loss.dtype == torch.float64
    loss.backward()
    assert pred.grad.shape == pred.shape
