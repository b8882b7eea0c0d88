"""The fused bias + 2x2 max-pool + ReLU (detector/model/bias_pool_kernel.py) against the layers it replaces.

References: ``relu(max_pool2d(y + bias, 2))`` in float64 for fp32 inputs; for bf16, the same layers on
``round_bf16(float(y) + float(bias.to(bf16)))``, inductor's rounding of a conv2d's bias add under autocast,
which the kernel must equal bit for bit. The gradient of y is the output gradient routed to one position per
window: equal to the reference's wherever the two pick the same winner, which every test's data ensures. On
the CPU the kernels run in the Triton interpreter (tests/conftest.py): sizes stay tiny.
"""

import pytest
import torch
import torch.nn.functional as F
from compile_helpers import assert_compiled_matches_eager

from detector.errors import UserError
from detector.model import stem_kernel as stem_module
from detector.model.bias_pool_kernel import bias_pool, bias_pool_unavailable
from detector.model.stem_kernel import NO_WINNER

pytestmark = pytest.mark.skipif(stem_module.triton is None, reason="triton is not installed")
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here"))]


def skip_if_unavailable(device: str) -> None:
    reason = bias_pool_unavailable(torch.device(device))
    if reason:
        pytest.skip(f"bias_pool on {device}: {reason}")


def conv_output(device, batch=2, channels=16, side=8, channels_last=False, dtype=torch.float32, seed=0):
    """(y [B, C, S, S] requiring grad, bias [C] fp32 requiring grad)."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.randn(batch, channels, side, side, generator=generator).to(dtype)
    bias = (torch.randn(channels, generator=generator) * 0.5).to(device).requires_grad_()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return y.to(device).contiguous(memory_format=fmt).requires_grad_(), bias


def layers(y, bias):
    return F.relu(F.max_pool2d(y + bias[:, None, None], 2))


def output_grad(shape, device, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("channels", "side", "channels_last"),
    [(16, 8, True), (16, 7, False), (64, 6, False), (64, 4, True), (256, 4, True), (24, 5, True)],
)  # the model's widths, odd sides (the pool drops the last row and column), and a C that is no power of two
def test_fp32_matches_float64_layers(device, channels, side, channels_last):
    skip_if_unavailable(device)
    y, bias = conv_output(device, channels=channels, side=side, channels_last=channels_last)
    out = bias_pool(y, bias)
    y64, b64 = (t.detach().double().requires_grad_() for t in (y, bias))
    ref = layers(y64, b64)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    # one fp32 rounding of y + bias, at magnitudes below ~4: within 4 * 2**-24 ~ 2.4e-7
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    grad = output_grad(ref.shape, device)
    d_y, d_bias = torch.autograd.grad(out, (y, bias), grad)
    ref_y, ref_bias = torch.autograd.grad(ref, (y64, b64), grad.double())
    assert d_y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.equal(d_y.double(), ref_y)  # routed, not computed: equal (zero in the dropped row and column)
    torch.testing.assert_close(d_bias.double(), ref_bias, rtol=1e-6, atol=1e-6)  # fp32 sums of <= 32 values


@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_first_maximum_and_a_zero_output_passes_no_gradient(device):
    skip_if_unavailable(device)
    windows = torch.tensor(
        [
            [[1.0, 1.0], [1.0, 1.0]],  # all equal: the top-left (0)
            [[0.0, 2.0], [2.0, 2.0]],  # top-right (1) ties the bottom row
            [[0.0, 0.0], [3.0, 3.0]],  # bottom-left (2)
            [[0.0, 0.0], [1.0, 4.0]],  # bottom-right (3)
            [[-4.0, -3.0], [-3.0, -5.0]],  # negative after the bias: the ReLU blocks it
            [[-1.5, -1.5], [-1.5, -1.5]],  # exactly 0 after the bias: relu's gradient at 0 is 0
        ]
    )  # [6 windows, 2, 2] -> one row of 6 pooled pixels: y [1, 1, 2, 12]
    y = windows.permute(1, 0, 2).reshape(1, 1, 2, 12).repeat(1, 16, 1, 1).to(device).requires_grad_()
    bias = torch.full((16,), 1.5, device=device, requires_grad=True)
    out, winner = torch.ops.detector.bias_pool_forward(y, bias)
    expected = torch.tensor([0, 1, 2, 3, NO_WINNER, NO_WINNER], dtype=torch.uint8)
    assert torch.equal(winner.cpu(), expected[None, None, :, None].expand(1, 1, 6, 16))
    grad = output_grad(out.shape, device)
    y_ref = y.detach().clone().requires_grad_()
    ref = layers(y_ref, bias.detach())
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out, y, grad)[0], torch.autograd.grad(ref, y_ref, grad)[0])


def inductor_rounding(y, bias):
    """conv2d(x, w, b) under bf16 autocast as inductor computes it: cuDNN's bf16 y, then + bias.to(bf16) in fp32,
    rounded to bf16 before the pool."""
    return (y.float() + bias.to(torch.bfloat16).float()[:, None, None]).to(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_bf16_rounds_as_inductor_bit_for_bit(device, channels_last):
    skip_if_unavailable(device)
    y, _ = conv_output(device, batch=2, channels=16, side=6, channels_last=channels_last, dtype=torch.bfloat16)
    # a bias 100x y: y + bias often rounds to one bf16 value, so the windows tie, and the bias's own rounding shows
    bias = (torch.randn(16, generator=torch.Generator().manual_seed(3)) * 100).to(device).requires_grad_()
    out = bias_pool(y, bias)
    y_ref = y.detach().clone().requires_grad_()
    z = inductor_rounding(y_ref, bias.detach())
    ref = F.relu(F.max_pool2d(z, 2))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    unrounded_bias = (y.detach().float() + bias.detach()[:, None, None]).to(torch.bfloat16)
    assert not torch.equal(z, unrounded_bias)  # the test tells the two roundings apart
    windows = z.unflatten(2, (3, 2)).unflatten(4, (3, 2))  # [B, C, 3, 2, 3, 2]
    top = F.max_pool2d(z, 2)[:, :, :, None, :, None]
    assert ((windows == top).sum((3, 5)) > 1).any()  # windows with ties
    grad = output_grad(ref.shape, device).bfloat16()
    d_y, d_bias = torch.autograd.grad(out, (y, bias), grad)
    assert d_y.dtype == torch.bfloat16 and d_bias.dtype == torch.float32
    assert torch.equal(d_y, torch.autograd.grad(ref, y_ref, grad)[0])  # the same winners, first among ties
    passed = torch.where(ref > 0, grad.double(), 0.0).sum((0, 2, 3))  # fp32 sums, not rounded to bf16
    torch.testing.assert_close(d_bias.double(), passed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_wins_its_window_and_passes_the_relu_as_the_layers(device):
    skip_if_unavailable(device)
    y, bias = conv_output(device, batch=1, channels=16, side=4)
    with torch.no_grad():
        y[0, :, 1, 0] = float("nan")  # bottom-left of the first window
        y[0, :, 0, 2] = -float("inf")
    out = bias_pool(y, bias)
    ref = layers(y.detach(), bias.detach())
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=0, atol=0)
    assert out[0, :, 0, 0].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_and_a_side_with_no_window(device):
    skip_if_unavailable(device)
    for batch, side, pooled in [(0, 8, 4), (2, 1, 0)]:
        y, bias = conv_output(device, batch=batch, side=side, channels_last=True)
        out = bias_pool(y, bias)
        assert out.shape == (batch, 16, pooled, pooled)
        d_y, d_bias = torch.autograd.grad(out.sum(), (y, bias))  # connected to the graph
        assert d_y.shape == y.shape and torch.equal(d_y, torch.zeros_like(y))
        assert torch.equal(d_bias, torch.zeros_like(bias))


def test_the_public_function_checks_its_shapes():
    with pytest.raises(ValueError, match="expected .B, C, H, W. and .C."):
        bias_pool(torch.zeros(2, 16, 8), torch.zeros(16))
    with pytest.raises(ValueError, match="bias \\(8,\\)"):
        bias_pool(torch.zeros(2, 16, 8, 8), torch.zeros(8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "channels_last"), [(torch.float32, False), (torch.bfloat16, True)])
def test_ops_and_their_fakes_agree(device, dtype, channels_last):
    """torch.compile runs the fakes: their shapes, dtypes and layouts must be the kernels'."""
    skip_if_unavailable(device)
    y, bias = conv_output(device, batch=2, side=4, channels_last=channels_last, dtype=dtype)
    torch.library.opcheck(torch.ops.detector.bias_pool_forward, (y, bias))
    out, winner = torch.ops.detector.bias_pool_forward(y.detach(), bias.detach())
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.detector.bias_pool_backward, (grad, winner, 4, 4, channels_last))
    torch.library.opcheck(torch.ops.detector.bias_pool_backward, (grad, winner, 5, 4, channels_last))  # odd


def test_unavailable_says_why(monkeypatch):
    assert bias_pool_unavailable(torch.device("cuda")) is None
    monkeypatch.setattr(stem_module, "INTERPRETED", False)
    assert "needs CUDA" in bias_pool_unavailable(torch.device("cpu"))
    monkeypatch.setattr(stem_module, "triton", None)
    assert "triton is not installed" in bias_pool_unavailable(torch.device("cuda"))


def test_train_step_refuses_it_in_one_line_and_the_cpu_preset_leaves_it_off(monkeypatch):
    from detector.config.schema import load_config
    from detector.train.run.step import TrainStep

    assert load_config(["preset=cpu"], announce=None).train.fused_pool is False  # the interpreter would be slow
    assert load_config(["preset=seed_scale"], announce=None).train.fused_pool is True
    monkeypatch.setattr(stem_module, "INTERPRETED", False)
    cfg = load_config(["preset=cpu", "train.fused_pool=true", "data.image_size=16", "model.hidden=8"], announce=None)
    with pytest.raises(UserError, match="train.fused_pool=true cannot run here: .*needs CUDA.*train.fused_pool=false"):
        TrainStep(cfg, torch.device("cpu"))


def test_train_step_keeps_the_losses_in_the_interpreter():
    from train_helpers import TINY

    from detector.bench.step import device_batch
    from detector.config.schema import load_config
    from detector.train.run.step import TrainStep

    skip_if_unavailable("cpu")
    losses = {}
    for fused_pool in (False, True):
        cfg = load_config([*TINY, f"train.fused_pool={fused_pool}"], announce=None)
        step = TrainStep(cfg, torch.device("cpu"))
        assert step.model.fused_pool is fused_pool
        batch = device_batch(cfg, "padded", torch.device("cpu"))
        losses[fused_pool] = [step(batch).item() for _ in range(3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)  # fp32: conv + bias in one sum or two


def test_cuda_graphs_refuse_the_fused_pool_in_one_line():
    from detector.config.schema import load_config
    from detector.losses import get_strategy
    from detector.train.run.step import speed_option_refusal

    overrides = ["preset=cpu", "train.cuda_graphs=true", "train.fused_pool=true"]
    tcfg = load_config(overrides, announce=None).train
    reason = speed_option_refusal(get_strategy("padded"), tcfg, 1, torch.device("cuda"))
    assert "cannot capture the fused pool" in reason and "train.fused_pool=false" in reason
    defaults = load_config(["preset=seed_scale", "train.cuda_graphs=true"], announce=None).train  # both: one line
    reason = speed_option_refusal(get_strategy("padded"), defaults, 1, torch.device("cuda"))
    assert reason.endswith("set train.fused_blocks=0 and train.fused_pool=false")


@pytest.mark.skipif(not HAS_CUDA, reason="inductor's rounding on a GPU: CUDA only")
def test_within_one_bf16_step_of_inductors_conv_bias_pool_relu_under_autocast():
    """The compiled layers' forward within one bf16 step: inductor may add the bias inside cuDNN's convolution
    (one rounding), where bias_pool adds it to the rounded convolution (two); on an H100 some values differed
    by one step, so equality bit for bit is not the contract."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(16, 64, 3, padding=1).cuda().to(memory_format=torch.channels_last)

    def compiled_layers():
        return F.relu(F.max_pool2d(conv(x), 2))

    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        ref = torch.compile(compiled_layers, fullgraph=True)()
        out = bias_pool(F.conv2d(x, conv.weight, None, padding=1), conv.bias)
    assert out.dtype == ref.dtype == torch.bfloat16
    # one bf16 step is at most 2**-7 of the value (8 significant bits); where the bias nearly cancels the
    # convolution, the first rounding's error (half a step of the convolution's value) is all that is left
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-8 * ref.float().abs().max().item())


@pytest.mark.skipif(not HAS_CUDA, reason="torch.compile of the kernels: CUDA only")
def test_compiles_with_fullgraph():
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(16, 64, 3, padding=1).cuda().to(memory_format=torch.channels_last)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return bias_pool(F.conv2d(x, conv.weight, None, padding=1), conv.bias)

    assert_compiled_matches_eager(forward, (conv.weight, conv.bias))


def test_bench_blocks_times_the_blocks_after_the_fused_ones():
    from detector.bench.blocks import pool_calls
    from detector.config.schema import load_config

    skip_if_unavailable("cpu")
    tiny = ["preset=cpu", "data.image_size=16", "data.batch_size=2", "model.channels=[4,8,16]", "train.fused_pool=true"]
    cfg = load_config([*tiny, "train.fused_blocks=1"], announce=None)
    calls = pool_calls(cfg, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert [kernel for _, kernel in calls] == ["forward", "backward"]
    outs = calls[next(iter(calls))]()
    assert [out.shape for out, _ in outs] == [(2, 8, 4, 4), (2, 16, 2, 2)]  # blocks 2 and 3
    assert [d_y.shape for d_y, _ in list(calls.values())[1]()] == [(2, 8, 8, 8), (2, 16, 4, 4)]
    every_block_fused = load_config([*tiny, "train.fused_blocks=2", "model.channels=[4,8]"], announce=None)
    assert pool_calls(every_block_fused, torch.device("cpu"), None) == {}
