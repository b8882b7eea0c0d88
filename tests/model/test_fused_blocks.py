"""The fused blocks (detector/model/stem_kernel.py, conv_pool_kernel.py) against the layers they replace.

References: conv2d -> max_pool2d -> relu in float64 (fp32 kernel: loss-free tolerance 1e-5 on outputs of
magnitude ~1, gradients 1e-5 relative); the same layers under bf16 autocast (the kernel rounds as they do:
equal outputs on the CPU, within one bf16 step where cuDNN sums in another order; gradients within 1 %,
since the layers round their weight gradient to bf16 and the kernel does not). On the CPU the kernel runs
in the Triton interpreter (tests/conftest.py).
"""

import pytest
import torch
import torch.nn.functional as F
from compile_helpers import assert_compiled_matches_eager

from detector.errors import UserError
from detector.model import FaceDetector, fused_blocks_unavailable
from detector.model import conv_pool_kernel as conv_pool_module
from detector.model import stem_kernel as stem_module
from detector.model.conv_pool_kernel import conv_pool
from detector.model.stem_kernel import NO_WINNER, stem, stem_unavailable

pytestmark = pytest.mark.skipif(stem_module.triton is None, reason="triton is not installed")
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here"))]


def skip_if_unavailable(device: str) -> None:
    reason = stem_unavailable(torch.device(device), 4)
    if reason:
        pytest.skip(f"stem on {device}: {reason}")


def images_and_layer(device, batch=3, side=16, channels=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 1, side, side), dtype=torch.uint8, generator=generator)
    if batch:
        images[0] = 7  # a constant image: the 4 values of every window tie (away from the border)
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(1, channels, 3, padding="same")
    return images.to(device), conv.to(device)


def layers(images, weight, bias):
    x = images.to(weight.dtype) / 127.5 - 1
    return F.relu(F.max_pool2d(F.conv2d(x, weight, bias, padding=1), 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("side", [16, 15, 2])  # even, odd (the pool floors), one window
@pytest.mark.parametrize("channels_last", [False, True])
def test_fp32_matches_float64_layers_forward_and_gradient(device, side, channels_last):
    skip_if_unavailable(device)
    images, conv = images_and_layer(device, side=side)
    out = stem(images, conv.weight, conv.bias, channels_last)
    w64, b64 = conv.weight.detach().double().requires_grad_(), conv.bias.detach().double().requires_grad_()
    ref = layers(images, w64, b64)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    d_weight, d_bias = torch.autograd.grad(out, (conv.weight, conv.bias), grad.float())
    ref_weight, ref_bias = torch.autograd.grad(ref, (w64, b64), grad)
    torch.testing.assert_close(d_weight.double(), ref_weight, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_bias.double(), ref_bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_rounds_as_the_layers_do(device):
    """Against the layers under the CPU's bf16 autocast (a deterministic reference on every machine)."""
    skip_if_unavailable(device)
    images, conv = images_and_layer("cpu", batch=4, side=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = layers(images, conv.weight, conv.bias)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    theirs = torch.autograd.grad(ref, (conv.weight, conv.bias), grad)
    conv.to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = stem(images.to(device), conv.weight, conv.bias)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_same_bf16(out, ref)
    mine = torch.autograd.grad(out, (conv.weight, conv.bias), grad.to(device))
    for a, b in zip(mine, theirs, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=1e-2 * b.abs().max().item())


def assert_same_bf16(out, ref):
    """Equal on the CPU; on a GPU, whose compiler fuses multiply-adds (one rounding less), one bf16 step apart."""
    if out.device.type == "cpu":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    skip_if_unavailable(device)
    images, conv = images_and_layer(device, batch=0)
    out = stem(images, conv.weight, conv.bias)
    assert out.shape == (0, 4, 8, 8)
    d_weight, d_bias = torch.autograd.grad(out.sum(), (conv.weight, conv.bias))
    assert torch.equal(d_weight, torch.zeros_like(d_weight)) and torch.equal(d_bias, torch.zeros_like(d_bias))


def loop_over_blocks_of_16(monkeypatch, programs):
    """The stem's backward in blocks of 16 pooled pixels over at most ``programs`` programs, each looping over its
    blocks (where the GPU runs it too)."""
    monkeypatch.setitem(stem_module.CONFIGS, "interpreted", (16, 1))
    monkeypatch.setitem(stem_module.CONFIGS, "backward", (16, 1))
    monkeypatch.setitem(stem_module.PROGRAMS, "backward", programs)


@pytest.mark.parametrize("device", DEVICES)
# 1 and 2 channels: a routed gradient of 4 and 8 rows repeated up to the dot's 16; 16 and 64: 64 and 256 rows
@pytest.mark.parametrize(("channels", "programs"), [(4, 1), (4, 2), (4, 3), (1, 2), (2, 3), (16, 2), (64, 1)])
def test_backward_programs_looping_over_several_blocks(device, channels, programs, monkeypatch):
    """Fewer programs than blocks: 2 images of side 15 (the pool drops the last row and column) make 2 x 7 x 7 = 98
    pooled pixels, 7 blocks of 16 with a partial last one, and each program sums 2 to 7 of them; against float64
    layers, as test_fp32_matches_float64_layers_forward_and_gradient."""
    skip_if_unavailable(device)
    loop_over_blocks_of_16(monkeypatch, programs)
    images, conv = images_and_layer(device, batch=2, side=15, channels=channels)
    out = stem(images, conv.weight, conv.bias)
    w64, b64 = conv.weight.detach().double().requires_grad_(), conv.bias.detach().double().requires_grad_()
    ref = layers(images, w64, b64)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    mine = torch.autograd.grad(out, (conv.weight, conv.bias), grad.float())
    theirs = torch.autograd.grad(ref, (w64, b64), grad)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_backward_programs_looping_over_several_blocks(device, monkeypatch):
    """bf16 products (on a GPU: bf16 tensor-core operands) summed over 3 programs of 2 to 3 blocks each (7 blocks,
    the last partial) equal the sums of one block per program to fp32 rounding: the loop changes how the sums are
    grouped, not what is summed. (The bf16 test above compares with the layers; at this size, on a GPU whose
    forward is one bf16 step from the CPU's, a moved pool winner would move a whole pixel's gradient.)"""
    skip_if_unavailable(device)
    images, conv = images_and_layer(device, batch=2, side=15)
    grad = torch.randn(2, 4, 7, 7, generator=torch.Generator().manual_seed(2)).bfloat16().to(device)

    def gradients(programs):
        loop_over_blocks_of_16(monkeypatch, programs)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = stem(images, conv.weight, conv.bias)
        return torch.autograd.grad(out, (conv.weight, conv.bias), grad)

    for a, b in zip(gradients(3), gradients(7), strict=True):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_model_with_and_without_the_fused_kernels_agrees(device, channels_last, monkeypatch):
    """Same parameters, same outputs and gradients: train.fused_blocks and train.fused_pool (bias_pool_kernel.py)
    change speed, not the model."""
    skip_if_unavailable(device)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the layers in full fp32, as the kernels
    torch.manual_seed(0)
    model = FaceDetector(image_size=32, max_boxes=8, channels=[4, 16, 8, 8], hidden=16).to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
        model.channels_last = True
    images = torch.randint(0, 256, (2, 1, 32, 32), dtype=torch.uint8, device=device)
    results = {}
    # (fused_blocks, fused_pool): the layers; 1 or 2 fused blocks; the pool of all 4 blocks, of the last 2
    for options in [(0, False), (1, False), (2, False), (0, True), (2, True)]:
        model.fused_blocks, model.fused_pool = options
        model.zero_grad()
        out = model(images)
        out.square().sum().backward()
        results[options] = out.detach(), [p.grad.clone() for p in model.parameters()]
    layers_out, layers_grads = results.pop((0, False))
    for out, grads in results.values():  # conv + bias in one sum or two, other orders of sums: fp32 roundings apart
        torch.testing.assert_close(out, layers_out, rtol=1e-5, atol=1e-4)
        for fused_grad, layer_grad in zip(grads, layers_grads, strict=True):
            torch.testing.assert_close(fused_grad, layer_grad, rtol=1e-4, atol=1e-4)


def block_input(device, batch=2, c_in=4, side=8, channels_last=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c_in, side, side, generator=generator)
    if batch:
        x[0, :, 2:6, 2:6] = 0.5  # equal inputs: ties in the pool windows
    x = x.to(device).contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return x.requires_grad_()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("c_in", "c_out", "side", "channels_last"),
    [(4, 16, 8, False), (4, 16, 9, True), (16, 16, 6, True), (8, 32, 6, True)],
)
def test_conv_pool_fp32_matches_float64_layers(device, c_in, c_out, side, channels_last):
    skip_if_unavailable(device)
    x = block_input(device, c_in=c_in, side=side, channels_last=channels_last)
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(c_in, c_out, 3, padding=1).to(device)
    out = conv_pool(x, conv.weight, conv.bias)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    ref = F.relu(F.max_pool2d(F.conv2d(x64, w64, b64, padding=1), 2))
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    mine = torch.autograd.grad(out, (x, conv.weight, conv.bias), grad.float())
    theirs = torch.autograd.grad(ref, (x64, w64, b64), grad)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_pool_winner_is_the_pool_argmax_or_no_winner_where_the_relu_blocks(device):
    """The byte the backward routes by: each pooled value's winning window position (dy * 2 + dx) where the
    output is positive, NO_WINNER where the ReLU passed nothing (windows whose top is tied are not checked)."""
    skip_if_unavailable(device)
    x = block_input(device, batch=2, side=8, channels_last=True, seed=4).detach()
    torch.manual_seed(5)
    conv = torch.nn.Conv2d(4, 16, 3, padding=1).to(device)
    out, winner = torch.ops.detector.conv_pool_forward(x, conv.weight.detach(), conv.bias.detach())
    y = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1).cpu()
    windows = y.unflatten(2, (4, 2)).unflatten(4, (4, 2)).permute(0, 2, 4, 1, 3, 5).flatten(-2)  # [B, H2, W2, C, 4]
    top2 = windows.topk(2, dim=-1).values
    positive = out.permute(0, 2, 3, 1).cpu() > 0
    assert winner.shape == positive.shape and winner.dtype == torch.uint8
    assert positive.any() and (~positive).any()  # both cases are checked
    assert torch.equal(winner.cpu()[~positive], torch.full_like(winner.cpu()[~positive], NO_WINNER))
    clear = positive & (top2[..., 0] - top2[..., 1] > 1e-4)
    assert torch.equal(winner.cpu()[clear].long(), windows.argmax(-1)[clear])


@pytest.mark.parametrize("device", DEVICES)
def test_conv_pool_bf16_autocast_rounds_as_the_layers_do(device):
    """Against the layers under the CPU's bf16 autocast, as the stem's test."""
    skip_if_unavailable(device)
    x = block_input("cpu", batch=3, side=16, channels_last=True).detach().bfloat16().requires_grad_()
    conv = torch.nn.Conv2d(4, 16, 3, padding=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.relu(F.max_pool2d(conv(x), 2))
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    theirs = torch.autograd.grad(ref, (x, conv.weight, conv.bias), grad)
    conv.to(device)
    x_here = x.detach().to(device).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = conv_pool(x_here, conv.weight, conv.bias)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_same_bf16(out, ref)
    mine = torch.autograd.grad(out, (x_here, conv.weight, conv.bias), grad.to(device))
    for a, b in zip(mine, theirs, strict=True):  # both round d x to bf16; the weights' sums differ in order
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=0, atol=2e-2 * b.float().abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_conv_pool_without_input_gradient_and_empty_batch(device):
    skip_if_unavailable(device)
    conv = torch.nn.Conv2d(4, 16, 3, padding=1).to(device)
    x = block_input(device).detach()
    d_weight = torch.autograd.grad(conv_pool(x, conv.weight, conv.bias).sum(), conv.weight)[0]
    x64, w64 = x.double(), conv.weight.detach().double().requires_grad_()
    ref = F.relu(F.max_pool2d(F.conv2d(x64, w64, conv.bias.detach().double(), padding=1), 2)).sum()
    torch.testing.assert_close(d_weight.double(), torch.autograd.grad(ref, w64)[0], rtol=1e-5, atol=1e-5)
    empty = block_input(device, batch=0)
    out = conv_pool(empty, conv.weight, conv.bias)
    assert out.shape == (0, 16, 4, 4)
    d_x, d_weight = torch.autograd.grad(out.sum(), (empty, conv.weight))
    assert d_x.shape == empty.shape and torch.equal(d_weight, torch.zeros_like(d_weight))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [1, 2, 3])
def test_conv_pool_programs_looping_over_several_blocks(device, programs, monkeypatch):
    """The forward and the weight gradient with fewer programs than pixel blocks: each program takes several
    blocks of 8 pooled pixels (and one a partial last block: 2 x 5 x 5 = 50 pooled pixels), its weight sums
    adding up across them; against float64 layers, as the test above."""
    skip_if_unavailable(device)
    monkeypatch.setitem(conv_pool_module.CONFIGS, "interpreted", (8, 1))
    monkeypatch.setitem(conv_pool_module.CONFIGS, "forward", (32, 4))  # where the GPU runs it: the same loop
    monkeypatch.setitem(conv_pool_module.CONFIGS, "wgrad", (32, 4))
    monkeypatch.setitem(conv_pool_module.PROGRAMS, "forward", programs)
    monkeypatch.setitem(conv_pool_module.PROGRAMS, "wgrad", programs)
    x = block_input(device, batch=2, side=11, channels_last=True)
    torch.manual_seed(4)
    conv = torch.nn.Conv2d(4, 16, 3, padding=1).to(device)
    out = conv_pool(x, conv.weight, conv.bias)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    ref = F.relu(F.max_pool2d(F.conv2d(x64, w64, b64, padding=1), 2))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mine = torch.autograd.grad(out, (x, conv.weight, conv.bias), grad.float().to(device))
    theirs = torch.autograd.grad(ref, (x64, w64, b64), grad.to(device))
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_unavailable_says_why(monkeypatch):
    assert "power of two" in stem_unavailable(torch.device("cuda"), 6)
    assert "power of two" in stem_unavailable(torch.device("cuda"), 128)
    monkeypatch.setattr(stem_module, "INTERPRETED", False)
    assert "needs CUDA" in stem_unavailable(torch.device("cpu"), 4)
    monkeypatch.setattr(stem_module, "triton", None)
    assert "triton is not installed" in stem_unavailable(torch.device("cuda"), 4)


def test_train_step_refuses_it_in_one_line(monkeypatch):
    from detector.config.schema import load_config
    from detector.train.run.step import TrainStep

    monkeypatch.setattr(stem_module, "INTERPRETED", False)
    cfg = load_config(["preset=cpu", "train.fused_blocks=2", "data.image_size=16", "model.hidden=8"], announce=None)
    with pytest.raises(UserError, match="train.fused_blocks=2 cannot run here: .*needs CUDA.*train.fused_blocks=0"):
        TrainStep(cfg, torch.device("cpu"))


def test_fused_blocks_need_blocks_of_the_right_widths():
    device = torch.device("cuda")
    assert "has 1 blocks" in fused_blocks_unavailable(2, [4], device)
    assert "2..16 input and 16 or 32 output" in fused_blocks_unavailable(2, [4, 8, 64], device)
    assert fused_blocks_unavailable(1, [4, 8, 64], device) is None or stem_module.triton is None
    if stem_module.triton is not None:  # the window's tiles: 16 x 16 input channels x 32 outputs do not fit
        assert "<= 4096 (2..8 -> 32, 9..16 -> 16)" in fused_blocks_unavailable(2, [16, 32], device)
        assert "16 or 32 output" in fused_blocks_unavailable(2, [4, 64], device)
        assert fused_blocks_unavailable(2, [16, 16], device) is None
        assert fused_blocks_unavailable(2, [8, 32], device) is None


@pytest.mark.skipif(not HAS_CUDA, reason="torch.compile of the kernels: CUDA only")
def test_compiles_with_fullgraph():
    images, conv = images_and_layer("cuda", batch=8, side=64)
    second = torch.nn.Conv2d(4, 16, 3, padding=1).cuda()

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return conv_pool(stem(images, conv.weight, conv.bias, True), second.weight, second.bias)

    assert_compiled_matches_eager(forward, (conv.weight, second.weight))


def test_cuda_graphs_refuse_the_fused_blocks_in_one_line():
    """Capturing their backward failed on an H200 (see speed_option_refusal): refused, with what to do."""
    from detector.config.schema import load_config
    from detector.losses import get_strategy
    from detector.train.run.step import speed_option_refusal

    tcfg = load_config(["preset=cpu", "train.cuda_graphs=true", "train.fused_blocks=2"], announce=None).train
    reason = speed_option_refusal(get_strategy("padded"), tcfg, 1, torch.device("cuda"))
    assert "cannot capture the fused blocks" in reason and "train.fused_blocks=0" in reason


@pytest.mark.parametrize("device", DEVICES)
def test_ops_and_their_fakes_agree_for_channels_last_parameters(device):
    """torch.compile runs the fakes: their layouts must be the kernels' (model.to(channels_last) included)."""
    skip_if_unavailable(device)
    images, conv = images_and_layer(device, batch=2, side=8)
    second = torch.nn.Conv2d(4, 16, 3, padding=1).to(device)
    for layer in (conv, second):
        layer.to(memory_format=torch.channels_last)
    x = stem(images, conv.weight, conv.bias, True).detach().requires_grad_()
    torch.library.opcheck(torch.ops.detector.stem_forward, (images, conv.weight, conv.bias, False, True))
    torch.library.opcheck(torch.ops.detector.conv_pool_forward, (x, second.weight, second.bias))
    out, winner = torch.ops.detector.conv_pool_forward(x, second.weight, second.bias)
    grad = torch.randn_like(out)
    weights = second.weight.detach(), conv.weight.detach(), conv.bias.detach()  # the backward ops have no backward
    torch.library.opcheck(torch.ops.detector.conv_pool_backward, (grad, x.detach(), weights[0], winner, True))
    grad = torch.randn_like(x)
    torch.library.opcheck(torch.ops.detector.stem_backward, (grad, images, *weights[1:], False))
