"""The torchvision strategies beyond the strategy grid: torchvision is optional and imported lazily; where
it cannot load the strategies say why in one line and refuse to run; where it loads (the GPU machine's
torch 2.11 + torchvision 0.26) they match the reference, and both synchronise with the device, as users'
code does."""

import sys

import pytest
import torch

from detector.data import make_targets
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES, giou_loss_reference, torchvision_concat

TORCHVISION = ["torchvision", "torchvision_padded"]
REASON = torchvision_concat.torchvision_unavailable()
needs_torchvision = pytest.mark.skipif(REASON is not None, reason=f"{REASON}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


# That importing the losses does not import torchvision is asserted in the fresh interpreter of
# tests/kernels/test_triton_giou.py::test_importing_the_losses_sets_no_environment_variable_and_imports_no_torchvision.


@pytest.mark.parametrize("name", TORCHVISION)
def test_unavailable_is_one_line_and_the_strategy_refuses(name):
    strategy = STRATEGIES[name]
    reason = strategy.unavailable(torch.device("cpu"))
    if reason is None:
        pytest.skip("torchvision loads here: the strategies run (see the tests below)")
    assert "torchvision" in reason and "\n" not in reason and len(reason) < 200, reason
    pred, boxes_list = random_case(2, 8, "seed")
    with pytest.raises(RuntimeError, match="cannot run on cpu: torchvision"):
        strategy(pred, make_targets(boxes_list, "padded", 8))


def test_a_torchvision_that_cannot_load_is_named_in_one_line(tmp_path, monkeypatch):
    """A torchvision built for another torch fails at import (e.g. ``operator torchvision::nms does not exist``):
    the reason gives its first line and the torch it was loaded against."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist\\nmore detail')\n")
    for module in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    torchvision_concat.torchvision_unavailable.cache_clear()
    try:
        reason = torchvision_concat.torchvision_unavailable()
    finally:
        torchvision_concat.torchvision_unavailable.cache_clear()
        for module in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[module]  # the fake, so that the real one (if any) imports again
    assert reason.startswith("torchvision ") and f"cannot load against torch {torch.__version__}" in reason, reason
    assert reason.endswith("RuntimeError: operator torchvision::nms does not exist"), reason


@needs_torchvision
def test_torchvision_upcasts_half_precision_itself():
    """The docstrings' claim: torchvision computes bf16 boxes in fp32 (a bf16 loss would differ from fp32)."""
    from torchvision.ops import generalized_box_iou_loss

    pred, boxes_list = random_case(4, 16, "full", torch.bfloat16, torch.float32, seed=5, nan_padding=False)
    boxes = make_targets(boxes_list, "padded", 16).boxes
    loss = generalized_box_iou_loss(pred, boxes.to(torch.bfloat16), reduction="none")
    assert loss.dtype == torch.float32


@needs_torchvision
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("name", TORCHVISION)
@pytest.mark.parametrize("pred_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_matches_the_reference_with_fp64_targets(name, device, pred_dtype):
    """fp64 targets are rounded to pred's compute dtype: the loss is fp32 for fp32 and bf16 predictions."""
    pred, boxes_list = random_case(7, 13, "seed", pred_dtype, torch.float64, seed=2)
    targets = make_targets(boxes_list, "padded", 13)
    p = pred.clone().to(device).requires_grad_()
    loss = STRATEGIES[name](p, targets.to(device))
    loss.backward()
    ref_pred = pred.double().requires_grad_()
    ref = giou_loss_reference(ref_pred, targets)
    ref.backward()
    assert loss.dtype == (torch.float64 if pred_dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
    scale = ref_pred.grad.abs().max().item()
    tol = 1e-2 if pred_dtype == torch.bfloat16 else 1e-5  # bf16 gradients carry bf16 rounding
    torch.testing.assert_close(p.grad.double().cpu(), ref_pred.grad, rtol=tol, atol=tol * scale)


@needs_torchvision
@needs_cuda
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_synchronises_with_the_device(name):
    """``pred[valid]`` has a data-dependent shape, and so has torchvision's own ``intsctk[mask] = ...``: the host
    waits in both strategies, as in users' code (the docstrings' claim)."""
    pred, boxes_list = random_case(4, 16, "seed", seed=1)
    targets = make_targets(boxes_list, "padded", 16).to("cuda")
    STRATEGIES[name](pred.cuda(), targets)  # warm-up outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            STRATEGIES[name](pred.cuda(), targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
