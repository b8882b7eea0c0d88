"""The dtype table every strategy accepts, and every registered strategy on its rare rows.

The table: predictions fp64/fp32/bf16/fp16 (fp64 computes in fp64 and returns an fp64 loss, the others
fp32), targets of any integer or floating dtype, counts of any integer dtype. The C++ op lists it once
in extensions/giou_dtypes.h; test_cuda_op.py runs the op on every pair. The strategy grid
(tests/losses/test_strategies.py) draws the common rows; here each strategy meets the rare ones.
"""

import warnings

import pytest
import torch

from detector.data import make_targets
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES, giou_loss_reference

PRED_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
TARGET_DTYPES = PRED_DTYPES + INT_DTYPES
COUNTS_DTYPES = INT_DTYPES

# pred, target, counts dtypes; gradient rtol (fp64: only the order of operations differs from the
# reference; fp32: fp32 rounding; bf16/fp16: the gradient is stored in pred's dtype).
RARE_ROWS = [
    (torch.float64, torch.int64, torch.uint8, 1e-10),
    (torch.float32, torch.int8, torch.int8, 1e-4),  # int8 coordinates wrap past 127: negative boxes
    (torch.bfloat16, torch.float64, torch.int16, 2e-2),
    (torch.float16, torch.uint8, torch.int64, 5e-3),
]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("pred_dtype,target_dtype,counts_dtype,grad_rtol", RARE_ROWS, ids=str)
def test_strategy_accepts_the_rare_dtypes(name, pred_dtype, target_dtype, counts_dtype, grad_rtol):
    strategy = STRATEGIES[name]
    reason = strategy.unavailable(torch.device("cpu"))
    if reason:
        pytest.skip(f"{name} on cpu: {reason}")
    pred, boxes_list = random_case(5, 13, "tail", pred_dtype, target_dtype, seed=3)
    targets = make_targets(boxes_list, strategy.layout, 13)
    if strategy.layout != "list":
        targets = type(targets)(targets.boxes, targets.counts.to(counts_dtype))
    p = pred.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cuda_* strategies say once that the CPU kernel serves them
        loss = strategy(p, targets)
    loss.backward()
    ref_pred = pred.double().requires_grad_()
    ref = giou_loss_reference(ref_pred, make_targets(boxes_list, "padded", 13))
    ref.backward()
    compute_dtype = torch.promote_types(pred_dtype, torch.float32)
    assert loss.dtype == compute_dtype and p.grad.dtype == pred_dtype
    loss_rtol = 1e-12 if compute_dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=loss_rtol, atol=loss_rtol / 10)
    scale = ref_pred.grad.abs().max().item()
    torch.testing.assert_close(p.grad.double(), ref_pred.grad, rtol=grad_rtol, atol=grad_rtol * scale + 1e-12)
