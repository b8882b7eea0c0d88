"""The rest of a detector block after cuDNN's bias-less convolution — bias, 2x2 max-pool, ReLU — as one Triton
kernel forward and one backward.

Why: inductor lowers ``conv2d(x, w, b)`` as a bias-less cuDNN convolution plus a pointwise pass that adds the
bias and rewrites the whole pre-pool output, then pools it in another pass and keeps the pre-pool output for
the backward, which reads it again to recompute the pool and sums the bias gradient in a pass of its own: at
seed scale, 6 passes a block a step over 537 MB of pre-pool output in bf16 (blocks 3 and 4; `make profile`
shows them). Here the forward reads the convolution's output once and writes the pooled output plus one uint8 per pooled
value; the backward reads those and writes the convolution's gradient once. ``python -m detector bench step``
times the step with and without it (train.fused_pool).

Contract: ``y`` is the bias-less convolution [B, C, H, W] (fp32, or bf16 under autocast), in any strides
(channels_last is the fast path), ``bias`` [C] the layer's (fp32) parameter. The output is
``relu(max_pool2d(y + bias, 2))`` [B, C, H // 2, W // 2] in y's dtype and memory format (an odd last row or
column is dropped, as max_pool2d does, and gets a zero gradient). Each value is rounded as inductor's bias add
after a bias-less convolution under bf16 autocast: ``round_bf16(float(y) + float(bias.to(bf16)))`` before the
max; for fp32 ``y``, ``y + bias`` in fp32 (another dtype: fp32 sums, rounded once at the store). Where the
compiled layers add the bias inside cuDNN's convolution instead (one rounding, not two), values differ by at
most one bf16 step. NaN wins its window and
passes the ReLU, as in PyTorch.

- Forward, a [BLOCK pooled pixels, CB channels] tile per program: the 4 values of each window, their maximum
  (the first in row-major order wins ties, as max_pool2d), the ReLU; it writes the output and ``winner``
  (uint8 [B, H // 2, W // 2, C]: which of the 4 positions won; NO_WINNER where the ReLU blocked the gradient).
- Backward, the same tiles: the output gradient written to the winning position and zeros to the 3 others (all
  4 where NO_WINNER), in one dense pass in grad_out's dtype and y's memory format; and each program's fp32 sums
  of the gradient that passed, per channel, which one ``sum`` over programs turns into the bias gradient
  (deterministic, no atomics; not rounded to bf16 as autocast's bias gradient is).

Any C: a tile holds up to MAX_TILE_CHANNELS channels (masked beyond C), more channels take more tiles.
Runs on CUDA, or on the CPU in the Triton interpreter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detector.kernels.jit import _add, tl, triton
from detector.model.stem_kernel import is_channels_last, kernels_unavailable, launch

if triton is not None:
    # the same helpers: round as autocast, sum; the no-winner byte
    from detector.model.stem_kernel import _NO_WINNER, _round_bf16

# (pooled pixels per program, warps) of each kernel, for a tile of up to MAX_TILE_CHANNELS channels: a first
# guess, to be replaced by the fastest of `make bench TARGET=blocks` (which sweeps them) on the GPU we train on;
# in the interpreter each operation has a fixed cost: fewer, larger programs
CONFIGS = {"forward": (64, 4), "backward": (64, 4), "interpreted": (256, 1)}
# 64 bf16 channels = one 128-byte line per pixel and position in NHWC; the same tile shape for every C >= 64,
# so one configuration serves blocks of 64 and 256 channels
MAX_TILE_CHANNELS = 64


def bias_pool_unavailable(device: torch.device) -> str | None:
    """Why the fused bias + pool + ReLU cannot run on ``device``, or None (it takes any channel count)."""
    return kernels_unavailable(device)


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _tile(n_pooled, C, H2, W2, channel_tiles, BLOCK: tl.constexpr, CB: tl.constexpr):
        """This program's tiles: the pixel tile's index, its pooled pixels (b, py, px), the channels, the mask."""
        pid = tl.program_id(0)
        pixel_tile = pid // channel_tiles  # the channel tiles of one pixel tile are neighbours in the launch order
        p = pixel_tile * BLOCK + tl.arange(0, BLOCK)  # flat pooled pixel (b, py, px): int32 (launch checks)
        b = (p // (H2 * W2)).to(tl.int64)  # memory offsets in int64
        c = (pid % channel_tiles) * CB + tl.arange(0, CB)
        mask = (p < n_pooled)[:, None] & (c < C)[None, :]
        return pixel_tile, b, (p // W2) % H2, p % W2, c, mask

    @triton.jit
    def _bias_pool_fwd_kernel(
        y_ptr,  # [B, C, H, W] the bias-less convolution, any strides
        bias_ptr,  # [C]
        out_ptr,  # [B, C, H2, W2] relu(max_pool2d(y + bias)), y's dtype
        winner_ptr,  # [B, H2, W2, C] uint8: the winning position 0..3, or NO_WINNER
        n_pooled,  # B * H2 * W2
        C,
        H2,
        W2,
        channel_tiles,  # cdiv(C, CB)
        sy_b,
        sy_c,
        sy_h,
        sy_w,
        so_b,
        so_c,
        so_h,
        so_w,
        ROUND: tl.constexpr,  # y is bf16: round the bias and each sum to bf16, as inductor's bias add
        CB: tl.constexpr,  # channels per tile
        BLOCK: tl.constexpr,  # pooled pixels per tile
    ):
        _, b, py, px, c, mask = _tile(n_pooled, C, H2, W2, channel_tiles, BLOCK, CB)
        bias = tl.load(bias_ptr + c, mask=c < C, other=0).to(tl.float32)
        if ROUND:
            bias = _round_bf16(bias)
        top = tl.full((BLOCK, CB), float("-inf"), tl.float32)
        winner = tl.full((BLOCK, CB), 0, tl.int32)
        for position in tl.static_range(4):
            pixel = b * sy_b + (2 * py + position // 2) * sy_h + (2 * px + position % 2) * sy_w
            v = tl.load(y_ptr + pixel[:, None] + (c * sy_c)[None, :], mask=mask, other=0).to(tl.float32)
            v += bias[None, :]
            if ROUND:
                v = _round_bf16(v)
            better = (v > top) | (v != v)  # strictly: the first maximum keeps the gradient; NaN wins, as max_pool2d
            winner = tl.where(better, position, winner)
            top = tl.where(better, v, top)
        out = tl.where(top <= 0, 0.0, top)  # the ReLU, NaN passing
        pooled = b * so_b + py * so_h + px * so_w
        tl.store(out_ptr + pooled[:, None] + (c * so_c)[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
        winner = tl.where(top <= 0, _NO_WINNER, winner)  # the ReLU passes no gradient
        flat = ((b * H2 + py) * W2 + px)[:, None] * C + c[None, :]
        tl.store(winner_ptr + flat, winner.to(tl.uint8), mask=mask)

    @triton.jit
    def _bias_pool_bwd_kernel(
        gout_ptr,  # [B, C, H2, W2] the output's gradient, any strides
        winner_ptr,  # [B, H2, W2, C] uint8, from the forward
        dy_ptr,  # [B, C, H, W] y's gradient, grad_out's dtype
        partial_ptr,  # [pixel tiles, C] fp32: each pixel tile's sums of the gradient the ReLU passed
        n_pooled,
        C,
        H2,
        W2,
        channel_tiles,
        sg_b,
        sg_c,
        sg_h,
        sg_w,
        sd_b,
        sd_c,
        sd_h,
        sd_w,
        CB: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pixel_tile, b, py, px, c, mask = _tile(n_pooled, C, H2, W2, channel_tiles, BLOCK, CB)
        pooled = b * sg_b + py * sg_h + px * sg_w
        g = tl.load(gout_ptr + pooled[:, None] + (c * sg_c)[None, :], mask=mask, other=0)
        flat = ((b * H2 + py) * W2 + px)[:, None] * C + c[None, :]
        winner = tl.load(winner_ptr + flat, mask=mask, other=_NO_WINNER).to(tl.int32)
        for position in tl.static_range(4):
            pixel = b * sd_b + (2 * py + position // 2) * sd_h + (2 * px + position % 2) * sd_w
            routed = tl.where(winner == position, g, 0.0).to(dy_ptr.dtype.element_ty)
            tl.store(dy_ptr + pixel[:, None] + (c * sd_c)[None, :], routed, mask=mask)
        passed = tl.where(winner != _NO_WINNER, g.to(tl.float32), 0.0)
        tl.store(partial_ptr + pixel_tile * C + c, tl.reduce(passed, 0, _add), mask=c < C)


# ----------------------------------------------------------------------------- launchers and the op


def _launch(kernel: str, n_pooled: int, channels: int) -> tuple[int, int, dict]:
    """(pixel tiles, channel tiles, keyword arguments) of one of the CONFIGS kernels over [n_pooled, channels]."""
    pixel_tiles, keywords = launch(CONFIGS, kernel, n_pooled)
    tile = min(MAX_TILE_CHANNELS, triton.next_power_of_2(channels))
    return pixel_tiles, triton.cdiv(channels, tile), keywords | {"CB": tile}


def _empty(t: Tensor, shape: tuple, dtype: torch.dtype, channels_last: bool) -> Tensor:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=dtype, device=t.device, memory_format=fmt)


def _forward_outputs(y: Tensor) -> tuple[Tensor, Tensor]:
    batch, channels, height, width = y.shape
    out = _empty(y, (batch, channels, height // 2, width // 2), y.dtype, is_channels_last(y))
    return out, _empty(y, (batch, height // 2, width // 2, channels), torch.uint8, False)


if triton is not None:

    @torch.library.custom_op("detector::bias_pool_forward", mutates_args=())
    def bias_pool_forward(y: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """(relu(max_pool2d(y + bias, 2)) in y's dtype and memory format, winner uint8 [B, H/2, W/2, C])."""
        out, winner = _forward_outputs(y)
        batch, channels, height, width = y.shape
        if winner.numel():
            pixel_tiles, channel_tiles, launch = _launch("forward", winner.numel() // channels, channels)
            _bias_pool_fwd_kernel[(pixel_tiles * channel_tiles,)](
                y, bias, out, winner, winner.numel() // channels, channels, height // 2, width // 2, channel_tiles,
                *y.stride(), *out.stride(), ROUND=y.dtype == torch.bfloat16, **launch,
            )  # fmt: skip
        return out, winner

    @bias_pool_forward.register_fake
    def _forward_fake(y: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        return _forward_outputs(y)

    @torch.library.custom_op("detector::bias_pool_backward", mutates_args=())
    def bias_pool_backward(
        grad_out: Tensor, winner: Tensor, height: int, width: int, channels_last: bool
    ) -> tuple[Tensor, Tensor]:
        """(d y [B, C, height, width] in grad_out's dtype, NHWC if channels_last; d bias [C] fp32) of
        bias_pool_forward."""
        batch, h2, w2, channels = winner.shape
        d_y = _empty(grad_out, (batch, channels, height, width), grad_out.dtype, channels_last)
        d_bias = torch.zeros(channels, dtype=torch.float32, device=grad_out.device)
        if winner.numel():
            pixel_tiles, channel_tiles, launch = _launch("backward", batch * h2 * w2, channels)
            partial = torch.empty(pixel_tiles, channels, dtype=torch.float32, device=grad_out.device)
            _bias_pool_bwd_kernel[(pixel_tiles * channel_tiles,)](
                grad_out, winner, d_y, partial, batch * h2 * w2, channels, h2, w2, channel_tiles,
                *grad_out.stride(), *d_y.stride(), **launch,
            )  # fmt: skip
            d_bias = partial.sum(0)
        if height % 2:  # the rows and columns the pool dropped
            d_y[:, :, height - 1].zero_()
        if width % 2:
            d_y[:, :, :, width - 1].zero_()
        return d_y, d_bias

    @bias_pool_backward.register_fake
    def _backward_fake(grad_out, winner, height, width, channels_last):
        batch, _, _, channels = winner.shape
        d_y = _empty(grad_out, (batch, channels, height, width), grad_out.dtype, channels_last)
        return d_y, grad_out.new_empty(channels, dtype=torch.float32)

    def _setup_context(ctx, inputs, output):
        y, bias = inputs
        ctx.save_for_backward(output[1])  # the winners only: neither y nor the output
        ctx.height, ctx.width = y.shape[2:]
        ctx.channels_last, ctx.bias_dtype = is_channels_last(y), bias.dtype

    def _backward(ctx, grad_out, _grad_winner):
        (winner,) = ctx.saved_tensors
        d_y, d_bias = bias_pool_backward(grad_out, winner, ctx.height, ctx.width, ctx.channels_last)
        return d_y, d_bias.to(ctx.bias_dtype)

    bias_pool_forward.register_autograd(_backward, setup_context=_setup_context)


def bias_pool(y: Tensor, bias: Tensor) -> Tensor:
    """relu(max_pool2d(y + bias, 2)) of a bias-less convolution's output y [B, C, H, W] (the module docstring)."""
    if y.dim() != 4 or bias.shape != (y.shape[1],):
        raise ValueError(f"bias_pool: y {tuple(y.shape)} and bias {tuple(bias.shape)}: expected [B, C, H, W] and [C]")
    return torch.ops.detector.bias_pool_forward(y, bias)[0]
