"""The detector: output shape and parametrisation, and that it can learn faces through the loss."""

import pytest
import torch
from omegaconf import OmegaConf

from detector.data import FaceSampler, SyntheticFaces, collate_fn
from detector.losses import STRATEGIES
from detector.model import BlockedLinear, FaceDetector, build_model, linear


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


@pytest.mark.parametrize("blocks", [1, 3, 10])
def test_blocked_linear_is_the_linear_it_was_sliced_from(blocks):
    """Same values as nn.Linear(8, 10) under the same seed (and the same draws after it), the same output
    and input gradient, and each block's weight gradient is its rows of the whole weight's (3 blocks:
    uneven slices of 4, 3, 3 rows)."""
    torch.manual_seed(0)
    whole = torch.nn.Linear(8, 10).double()
    next_draws = torch.rand(4)
    torch.manual_seed(0)
    blocked = BlockedLinear(8, 10, blocks).double()
    assert torch.equal(torch.rand(4), next_draws), "the blocks drew random numbers of their own"
    assert len(blocked.blocks) == blocks
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = whole(x), blocked(x2)
    torch.testing.assert_close(y2, y, rtol=1e-14, atol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(torch.cat([b.weight.grad for b in blocked.blocks]), whole.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([b.bias.grad for b in blocked.blocks]), whole.bias.grad, rtol=0, atol=0)


def test_blocked_linear_refuses_more_blocks_than_outputs():
    with pytest.raises(ValueError, match="head_blocks=11: expected 1 to 10"):
        BlockedLinear(8, 10, 11)


def test_blocked_linear_rows_are_views_of_the_blocks_parameters_until_a_conversion_separates_them():
    blocked = BlockedLinear(8, 10, 4)  # rows 3, 3, 2, 2
    weight, bias = blocked.rows(1, 3)
    assert weight.shape == (5, 8) and bias.shape == (5,)
    weight.zero_()  # the blocks' own parameters change with the view: one all-gather updates them
    assert not blocked.blocks[1].weight.any() and not blocked.blocks[2].weight.any()
    assert blocked.blocks[0].weight.all() and blocked.blocks[3].weight.all()
    with pytest.raises(RuntimeError, match="no longer lie in one tensor"):
        blocked.double().rows(0, 4)


@pytest.mark.parametrize(
    "head_blocks,world_size,blocks", [(0, 1, 1), (0, 2, 2), (3, 1, 3), (3, 2, 3), (0, 8, 8), (0, 32, 16)]
)
def test_head_blocks_auto_is_one_per_process(head_blocks, world_size, blocks):
    model_cfg = OmegaConf.create({"channels": [4, 8], "hidden": 16, "head_blocks": head_blocks})
    data_cfg = OmegaConf.create({"image_size": 32, "max_boxes": 4})
    assert len(build_model(model_cfg, data_cfg, world_size).head[1].blocks) == blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-gradient linear is the CUDA autocast path")
def test_autocast_linear_matches_autocast_forward_and_has_fp32_gradients():
    """Forward: autocast's own linear, bit for bit. Gradients: the input's as autocast's (bf16), the weight's
    and bias's fp32 and at least as close to the float64 products of the same bf16 operands as autocast's."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 96, device="cuda")
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    grads = []
    for fn in (layer, lambda t: linear(t, layer)):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x)
        y.backward(dy)
        grads.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad))
    (y_ref, dx_ref, dw_ref, db_ref), (y, dx, dw, db) = grads
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    assert dw.dtype == db.dtype == torch.float32
    exact_dw = dy.double().t() @ x.detach().double()
    exact_db = dy.double().sum(0)
    assert (dw.double() - exact_dw).abs().max() <= (dw_ref.double() - exact_dw).abs().max()
    torch.testing.assert_close(dw.double(), exact_dw, rtol=1e-5, atol=1e-5)  # fp32 accumulation of bf16 products
    torch.testing.assert_close(db.double(), exact_db, rtol=1e-5, atol=1e-5)


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
