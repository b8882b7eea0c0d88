"""``nested`` and ``nested_compiled`` beyond the strategy grid: no host synchronisation on CUDA, no
recompilation when the counts change, the twin of ``packed_torch`` on hand-built counts, and the reference's
ValueError for packed boxes that do not match the counts."""

import inspect

import pytest
import torch

from detector.data import make_targets
from detector.data.targets import PackedTargets
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES, nested
from detector.losses.contract import giou_loss_reference

NESTED = ["nested", "nested_compiled"]


def packed_case(seed: int, batch: int = 6, slots: int = 9, device: str = "cpu"):
    """``batch`` images of ``slots`` slots, uint8 boxes, NaN in pred's padded slots."""
    pred, boxes_list = random_case(batch, slots, "tail", torch.float32, torch.uint8, seed=seed, nan_padding=True)
    return pred.to(device), make_targets(boxes_list, "packed", slots).to(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the sync check needs one")
@pytest.mark.parametrize("name", NESTED)
def test_no_host_synchronisation_on_cuda(name):
    """Forward and backward never wait for the device: the NJTs are built from host shapes and the offsets
    tensor, with max_seqlen and the total N given."""
    strategy = STRATEGIES[name]
    pred, targets = packed_case(seed=0, device="cuda")
    strategy(pred.clone().requires_grad_(), targets).backward()  # compiles (nested_compiled) outside the check
    torch.cuda.synchronize()
    p = pred.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        strategy(p, targets).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert p.grad is not None and p.grad.abs().sum() > 0


def test_no_host_read_in_the_source():
    """On the CPU the padded-to-jagged fallback reads the offsets itself, so the check there is the
    strategy's own code: nothing that reads device memory on the host, no boolean indexing."""
    source = inspect.getsource(nested.giou_loss_njt)
    assert not any(call in source for call in (".tolist(", ".item(", ".numpy(", ".cpu(", "nonzero", "[valid")), source


def test_nested_compiled_does_not_recompile_when_the_counts_change():
    strategy = STRATEGIES["nested_compiled"]
    pred, targets = packed_case(seed=0)
    strategy(pred.clone().requires_grad_(), targets).backward()  # the first call of this shape compiles
    totals = {targets.boxes.shape[0]}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 6):
            pred, targets = packed_case(seed)
            p = pred.clone().requires_grad_()
            loss = strategy(p, targets)
            loss.backward()
            want = STRATEGIES["nested"](pred, targets)
            torch.testing.assert_close(loss.detach(), want)
            totals.add(targets.boxes.shape[0])
    assert len(totals) >= 3, f"the cases must change N (the packed boxes' length), got {sorted(totals)}"


@pytest.mark.parametrize("name", NESTED)
@pytest.mark.parametrize("counts", [[9, -3, 2, 5, 0, 1], [0, 0, 4, 0, 0, 0]], ids=["out_of_range", "sparse"])
def test_twin_of_packed_torch_on_hand_built_counts(name, counts):
    """Counts outside [0, M] clamp; images without boxes in between; fp64, compared tightly."""
    pred, boxes_list = random_case(6, 5, "full", torch.float64, torch.float64, seed=3, nan_padding=False)
    raw = torch.tensor(counts)
    boxes = torch.cat([b[:n] for b, n in zip(boxes_list, raw.clamp(0, 5).tolist(), strict=True)])
    targets = PackedTargets(boxes, raw)
    got, want = pred.clone().requires_grad_(), pred.clone().requires_grad_()
    got_loss, want_loss = STRATEGIES[name](got, targets), STRATEGIES["packed_torch"](want, targets)
    (got_loss + want_loss).backward()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", NESTED)
@pytest.mark.parametrize("rows", [7, 3], ids=["more_rows", "fewer_rows"])
def test_packed_boxes_that_do_not_match_the_counts_get_the_references_value_error(name, rows):
    """N must be the sum of the clamped counts (here 5): the reference's ValueError naming the targets, word for
    word, instead of torch's internal `_padded_dense_to_jagged_forward(): final offset should match total_L`."""
    pred, boxes_list = random_case(3, 4, "full", torch.float32, torch.float32, seed=5, nan_padding=False)
    boxes = torch.cat([b[:4] for b in boxes_list])[:rows]  # 12 rows available
    targets = PackedTargets(boxes, torch.tensor([2, 0, 3]))
    with pytest.raises(ValueError) as want:
        giou_loss_reference(pred, targets)
    with pytest.raises(ValueError) as got:
        STRATEGIES[name](pred.clone().requires_grad_(), targets)
    expected = f"packed targets: targets.boxes has {rows} boxes but the counts, clamped to [0, 4], sum to 5"
    assert str(got.value) == str(want.value) == expected
