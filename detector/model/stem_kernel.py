"""The detector's first block — 3x3 convolution (1 -> C channels, zero "same" padding), 2x2 max-pool, ReLU —
with the input normalisation ``images / 127.5 - 1``, as one Triton kernel forward and one backward.

Why: cuDNN has no fast path for a convolution with one input channel. At seed scale (batch 1024, 256 px,
C = 4) its forward and, above all, its weight gradient run in an engine without tensor cores, and its NCHW
output needs a conversion before the NHWC second block: a large share of the step, for tiny bytes (the
uint8 images, 67 MB, and the pooled output, 134 MB in bf16: ~0.05 ms at a 4 TB/s copy rate).
``python -m detector bench step`` times the step with and without the fused blocks (train.fused_blocks).

Forward: each program takes BLOCK pooled pixels; for each it loads the 4x4 input patch under its 2x2
window, computes the C convolutions at the 4 positions, keeps their maximum and applies the ReLU. Only the
pooled output is written (NCHW or NHWC strides), so nothing is saved for backward but the inputs.

Backward (the images need no gradient): it recomputes the 4 convolution values, so it knows which position
won the max-pool (the first maximum in row-major order, as PyTorch's max_pool2d) and whether the ReLU
passed the gradient (output > 0, as PyTorch's threshold_backward). Each program writes its partial sums of
the C x 9 weight gradients and C bias gradients; one ``sum`` over programs finishes them: deterministic,
no atomics.

Under bf16 autocast the kernel rounds as the layers do: the normalised pixel and the weights to bf16
before the products (fp32 sums), and each convolution value to bf16 before the pool. The gradients are
summed in fp32 and not rounded (cuDNN rounds its weight gradient to bf16).

Runs on CUDA tensors, or CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from detector.kernels.triton_giou import INTERPRETED, triton

if triton is not None:
    import triton.language as tl

# (pooled pixels per program, warps) of each kernel: the fastest at seed scale in `make bench TARGET=blocks` on
# an H100 (an H200's sweep had chosen (256, 8) and (128, 4): within 2 % and 15 % of these on the H100; the
# bench sweeps them on yours); in the interpreter each operation has a fixed cost: fewer, larger programs
CONFIGS = {"forward": (128, 4), "backward": (64, 2), "interpreted": (1024, 1)}
MAX_CHANNELS = 64  # one [BLOCK, C] tile per convolution position stays in registers up to here


def kernels_unavailable(device: torch.device) -> str | None:
    """Why the fused blocks' Triton kernels (this module's and conv_pool_kernel.py's) cannot run on ``device``."""
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda" and not INTERPRETED:
        return f"it is a Triton kernel and this run is on {device} (it needs CUDA)"
    return None


def launch(configs: dict, kernel: str, items: int) -> tuple[int, dict]:
    """(programs, launch keywords) of ``configs[kernel]`` (``configs["interpreted"]`` in the interpreter)
    over ``items`` pixels, which the fused blocks' kernels index with int32."""
    block, warps = configs["interpreted" if INTERPRETED else kernel]
    if items + block >= 2**31:
        raise ValueError(f"{items} pixels: the fused blocks' kernels index pixels with int32 (< 2**31)")
    return triton.cdiv(items, block), {"BLOCK": block, "num_warps": warps}


def is_channels_last(t: Tensor) -> bool:
    """Whether the fused kernels' output keeps ``t``'s NHWC layout: NHWC-contiguous with more than one channel
    (one channel is contiguous in both layouts, and is taken as NCHW)."""
    return t.shape[1] > 1 and t.is_contiguous(memory_format=torch.channels_last)


def stem_unavailable(device: torch.device, channels: int) -> str | None:
    """Why the fused first block cannot run here, or None."""
    if reason := kernels_unavailable(device):
        return reason
    if channels & (channels - 1) or not 1 <= channels <= MAX_CHANNELS:
        return f"model.channels[0] is {channels}; the kernel needs a power of two <= {MAX_CHANNELS}"
    return None


# ----------------------------------------------------------------------------- kernels

if triton is not None:
    # Builtins only (tl.reduce, tl.full, ...), as in triton_giou.py, so that the interpreter runs them.

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _round_bf16(v):
        """fp32 -> the nearest bf16 (ties to even) -> fp32, by bits: the interpreter's cast truncates instead."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _pixel(img_ptr, image, yy, xx, S, live, ROUND: tl.constexpr):
        """[BLOCK] normalised pixel (yy, xx) of each pixel's image; 0 outside it (the convolution's padding)."""
        inside = live & (yy >= 0) & (yy < S) & (xx >= 0) & (xx < S)
        raw = tl.load(img_ptr + image + yy * S + xx, mask=inside, other=0).to(tl.float32)
        value = tl.where(inside, raw / 127.5 - 1.0, 0.0)
        if ROUND:
            value = _round_bf16(value)
        return value

    @triton.jit
    def _weight(w_ptr, ch, tap: tl.constexpr, ROUND: tl.constexpr):
        """[1, C] weights of one of the 9 taps (row-major) of every output channel."""
        w = tl.load(w_ptr + ch * 9 + tap).to(tl.float32)
        if ROUND:
            w = _round_bf16(w)
        return w[None, :]

    @triton.jit
    def _conv(w_ptr, ch, bias, a0, a1, a2, a3, a4, a5, a6, a7, a8, ROUND: tl.constexpr):
        """[BLOCK, C] convolution at one position from its 3x3 patch a0..a8 (row-major)."""
        v = bias[None, :] + a0[:, None] * _weight(w_ptr, ch, 0, ROUND)
        v += a1[:, None] * _weight(w_ptr, ch, 1, ROUND)
        v += a2[:, None] * _weight(w_ptr, ch, 2, ROUND)
        v += a3[:, None] * _weight(w_ptr, ch, 3, ROUND)
        v += a4[:, None] * _weight(w_ptr, ch, 4, ROUND)
        v += a5[:, None] * _weight(w_ptr, ch, 5, ROUND)
        v += a6[:, None] * _weight(w_ptr, ch, 6, ROUND)
        v += a7[:, None] * _weight(w_ptr, ch, 7, ROUND)
        v += a8[:, None] * _weight(w_ptr, ch, 8, ROUND)
        if ROUND:
            v = _round_bf16(v)
        return v

    @triton.jit
    def _window(
        img_ptr, w_ptr, b_ptr, first, n_pooled, S, W2, C: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr
    ):
        """The 4 convolutions [BLOCK, C] under the 2x2 windows of pooled pixels first .. first + BLOCK - 1,
        their 16 patch pixels, and the pixels' coordinates."""
        p = first + tl.arange(0, BLOCK)  # flat pooled index (b, py, px): int32 (the launcher checks)
        live = p < n_pooled
        b = (p // (W2 * W2)).to(tl.int64)  # memory offsets in int64: B * S * S may pass 2**31
        py = (p // W2) % W2
        px = p % W2
        image = b * S * S
        y0, x0 = 2 * py - 1, 2 * px - 1  # top-left of the 4x4 patch
        q00 = _pixel(img_ptr, image, y0, x0, S, live, ROUND)
        q01 = _pixel(img_ptr, image, y0, x0 + 1, S, live, ROUND)
        q02 = _pixel(img_ptr, image, y0, x0 + 2, S, live, ROUND)
        q03 = _pixel(img_ptr, image, y0, x0 + 3, S, live, ROUND)
        q10 = _pixel(img_ptr, image, y0 + 1, x0, S, live, ROUND)
        q11 = _pixel(img_ptr, image, y0 + 1, x0 + 1, S, live, ROUND)
        q12 = _pixel(img_ptr, image, y0 + 1, x0 + 2, S, live, ROUND)
        q13 = _pixel(img_ptr, image, y0 + 1, x0 + 3, S, live, ROUND)
        q20 = _pixel(img_ptr, image, y0 + 2, x0, S, live, ROUND)
        q21 = _pixel(img_ptr, image, y0 + 2, x0 + 1, S, live, ROUND)
        q22 = _pixel(img_ptr, image, y0 + 2, x0 + 2, S, live, ROUND)
        q23 = _pixel(img_ptr, image, y0 + 2, x0 + 3, S, live, ROUND)
        q30 = _pixel(img_ptr, image, y0 + 3, x0, S, live, ROUND)
        q31 = _pixel(img_ptr, image, y0 + 3, x0 + 1, S, live, ROUND)
        q32 = _pixel(img_ptr, image, y0 + 3, x0 + 2, S, live, ROUND)
        q33 = _pixel(img_ptr, image, y0 + 3, x0 + 3, S, live, ROUND)
        ch = tl.arange(0, C)
        bias = tl.load(b_ptr + ch).to(tl.float32)
        if ROUND:
            bias = _round_bf16(bias)
        v00 = _conv(w_ptr, ch, bias, q00, q01, q02, q10, q11, q12, q20, q21, q22, ROUND)
        v01 = _conv(w_ptr, ch, bias, q01, q02, q03, q11, q12, q13, q21, q22, q23, ROUND)
        v10 = _conv(w_ptr, ch, bias, q10, q11, q12, q20, q21, q22, q30, q31, q32, ROUND)
        v11 = _conv(w_ptr, ch, bias, q11, q12, q13, q21, q22, q23, q31, q32, q33, ROUND)
        patch = (q00, q01, q02, q03, q10, q11, q12, q13, q20, q21, q22, q23, q30, q31, q32, q33)
        return v00, v01, v10, v11, patch, (b, py, px, live)

    @triton.jit
    def _stem_fwd_kernel(
        img_ptr,  # [B, 1, S, S] uint8, contiguous
        w_ptr,  # [C, 1, 3, 3] contiguous
        b_ptr,  # [C]
        out_ptr,  # [B, C, S/2, S/2], strides below (NCHW or NHWC)
        n_pooled,  # B * (S/2)^2
        S,
        W2,  # S / 2
        so_b,
        so_c,
        so_h,
        so_w,
        C: tl.constexpr,
        ROUND: tl.constexpr,  # bf16 autocast: round as the layers do, store bf16
        BLOCK: tl.constexpr,
    ):
        v00, v01, v10, v11, _, at = _window(
            img_ptr, w_ptr, b_ptr, tl.program_id(0) * BLOCK, n_pooled, S, W2, C, ROUND, BLOCK
        )
        b, py, px, live = at
        out = tl.maximum(tl.maximum(tl.maximum(v00, v01), tl.maximum(v10, v11)), 0.0)
        ch = tl.arange(0, C)
        offsets = (b * so_b + py * so_h + px * so_w)[:, None] + (ch * so_c)[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _tap(g00, g01, g10, g11, a, b, c, d):
        """[C]: one weight's gradient, sum over pixels of the gradient reaching each of the 4 positions times
        the patch pixel that this tap multiplies there."""
        return tl.reduce(g00 * a[:, None] + g01 * b[:, None] + g10 * c[:, None] + g11 * d[:, None], 0, _add)

    @triton.jit
    def _stem_bwd_kernel(
        img_ptr,
        w_ptr,
        b_ptr,
        gout_ptr,  # [B, C, S/2, S/2] gradient of the output, strides below
        partial_ptr,  # [programs, C, 10] fp32 out: the 9 weight gradients and the bias gradient
        n_pooled,
        S,
        W2,
        sg_b,
        sg_c,
        sg_h,
        sg_w,
        C: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        v00, v01, v10, v11, q, at = _window(img_ptr, w_ptr, b_ptr, pid * BLOCK, n_pooled, S, W2, C, ROUND, BLOCK)
        b, py, px, live = at
        ch = tl.arange(0, C)
        g = tl.load(
            gout_ptr + (b * sg_b + py * sg_h + px * sg_w)[:, None] + (ch * sg_c)[None, :],
            mask=live[:, None],
            other=0,
        ).to(tl.float32)
        top = tl.maximum(tl.maximum(v00, v01), tl.maximum(v10, v11))
        g = tl.where(live[:, None] & (top > 0), g, 0.0)  # ReLU: the gradient passes where the output is > 0
        # the first maximum in row-major order takes the whole gradient (PyTorch's max_pool2d)
        first00 = v00 == top
        first01 = (v01 == top) & ~first00
        first10 = (v10 == top) & ~first00 & ~first01
        first11 = ~first00 & ~first01 & ~first10
        g00, g01 = tl.where(first00, g, 0.0), tl.where(first01, g, 0.0)
        g10, g11 = tl.where(first10, g, 0.0), tl.where(first11, g, 0.0)
        out = partial_ptr + pid * C * 10 + ch * 10
        # tap (ky, kx) multiplies patch pixel (dy + ky, dx + kx) at position (dy, dx); q is the 4x4 patch
        tl.store(out + 0, _tap(g00, g01, g10, g11, q[0], q[1], q[4], q[5]))
        tl.store(out + 1, _tap(g00, g01, g10, g11, q[1], q[2], q[5], q[6]))
        tl.store(out + 2, _tap(g00, g01, g10, g11, q[2], q[3], q[6], q[7]))
        tl.store(out + 3, _tap(g00, g01, g10, g11, q[4], q[5], q[8], q[9]))
        tl.store(out + 4, _tap(g00, g01, g10, g11, q[5], q[6], q[9], q[10]))
        tl.store(out + 5, _tap(g00, g01, g10, g11, q[6], q[7], q[10], q[11]))
        tl.store(out + 6, _tap(g00, g01, g10, g11, q[8], q[9], q[12], q[13]))
        tl.store(out + 7, _tap(g00, g01, g10, g11, q[9], q[10], q[13], q[14]))
        tl.store(out + 8, _tap(g00, g01, g10, g11, q[10], q[11], q[14], q[15]))
        tl.store(out + 9, tl.reduce(g, 0, _add))


# ----------------------------------------------------------------------------- launchers and the op


def _launch_shape(images: Tensor, kernel: str) -> tuple[int, int, int, dict]:
    """(side, pooled pixels, programs, launch keywords) of one of the CONFIGS kernels."""
    side = images.shape[2]
    n_pooled = images.shape[0] * (side // 2) ** 2
    return side, n_pooled, *launch(CONFIGS, kernel, n_pooled)


if triton is not None:

    @torch.library.custom_op("detector::stem_forward", mutates_args=())
    def stem_forward(images: Tensor, weight: Tensor, bias: Tensor, bf16: bool, channels_last: bool) -> Tensor:
        """relu(max_pool2d(conv2d(images / 127.5 - 1, weight, bias, padding=1), 2)), [B, C, S/2, S/2]."""
        images, weight, bias = images.contiguous(), weight.contiguous(), bias.contiguous()
        side, n_pooled, programs, launch = _launch_shape(images, "forward")
        channels = weight.shape[0]
        out = _empty_output(images, channels, bf16, channels_last)
        if programs:
            _stem_fwd_kernel[(programs,)](
                images, weight, bias, out, n_pooled, side, side // 2, *out.stride(),
                C=channels, ROUND=bf16, **launch,
            )  # fmt: skip
        return out

    @stem_forward.register_fake
    def _stem_forward_fake(images: Tensor, weight: Tensor, bias: Tensor, bf16: bool, channels_last: bool) -> Tensor:
        return _empty_output(images, weight.shape[0], bf16, channels_last)

    @torch.library.custom_op("detector::stem_backward", mutates_args=())
    def stem_backward(
        grad_out: Tensor, images: Tensor, weight: Tensor, bias: Tensor, bf16: bool
    ) -> tuple[Tensor, Tensor]:
        """[d weight, d bias] of stem_forward, in the parameters' dtypes."""
        images, weight, bias = images.contiguous(), weight.contiguous(), bias.contiguous()
        side, n_pooled, programs, launch = _launch_shape(images, "backward")
        channels = weight.shape[0]
        partial = torch.empty(programs, channels, 10, device=images.device, dtype=torch.float32)
        if programs:
            _stem_bwd_kernel[(programs,)](
                images, weight, bias, grad_out, partial, n_pooled, side, side // 2, *grad_out.stride(),
                C=channels, ROUND=bf16, **launch,
            )  # fmt: skip
        total = partial.sum(0)  # [C, 10]
        # copies: a custom op's outputs may not be views of one another
        d_weight, d_bias = torch.empty_like(weight), torch.empty_like(bias)  # laid out as the fake's
        return d_weight.copy_(total[:, :9].reshape(weight.shape)), d_bias.copy_(total[:, 9])

    @stem_backward.register_fake
    def _stem_backward_fake(
        grad_out: Tensor, images: Tensor, weight: Tensor, bias: Tensor, bf16: bool
    ) -> tuple[Tensor, Tensor]:
        return torch.empty_like(weight), torch.empty_like(bias)

    def _setup_context(ctx, inputs, output):
        images, weight, bias, bf16, _ = inputs
        ctx.save_for_backward(images, weight, bias)
        ctx.bf16 = bf16

    def _backward(ctx, grad_out):
        images, weight, bias = ctx.saved_tensors
        d_weight, d_bias = stem_backward(grad_out, images, weight, bias, ctx.bf16)
        return None, d_weight, d_bias, None, None

    stem_forward.register_autograd(_backward, setup_context=_setup_context)


def _empty_output(images: Tensor, channels: int, bf16: bool, channels_last: bool) -> Tensor:
    batch, _, side, _ = images.shape
    return torch.empty(
        batch, channels, side // 2, side // 2,
        dtype=torch.bfloat16 if bf16 else torch.float32,
        device=images.device,
        memory_format=torch.channels_last if channels_last else torch.contiguous_format,
    )  # fmt: skip


def stem(images: Tensor, weight: Tensor, bias: Tensor, channels_last: bool = False) -> Tensor:
    """The first block on uint8 images [B, 1, S, S] (S even): bf16 under CUDA autocast, else fp32."""
    bf16 = torch.is_autocast_enabled(images.device.type) and (
        torch.get_autocast_dtype(images.device.type) == torch.bfloat16
    )
    return torch.ops.detector.stem_forward(images, weight, bias, bf16, channels_last)
