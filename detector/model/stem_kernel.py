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
passed the gradient (output > 0, as PyTorch's threshold_backward). At most PROGRAMS["backward"] programs loop
over the blocks of BLOCK pooled pixels. Per block, the gradient routed to each position of the window
[BLOCK, 4 C] transposed times the window's 16 input pixels [BLOCK, 16] is one ``tl.dot`` (on tensor cores
under bf16 autocast), added to a [4 C, 16] fp32 sum that stays in registers across the program's blocks:
no cross-thread sum per weight and per block. Each program writes that sum and its C bias sums once; one
``sum`` over programs and a fold of the window's cells onto the 3x3 taps (tap (ky, kx) at position
(dy, dx) reads cell (dy + ky, dx + kx)) finish them: deterministic, no atomics.

Under bf16 autocast the kernel rounds as the layers do: the normalised pixel and the weights to bf16
before the products (fp32 sums), and each convolution value to bf16 before the pool. The gradients are
summed in fp32 and not rounded (cuDNN rounds its weight gradient to bf16).

Runs on CUDA tensors, or CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from detector.kernels.jit import INTERPRETED, _add, tl, triton

# (pooled pixels per program, or per step of the backward's loop, warps) of each kernel: the fastest of a sweep at
# seed scale (docs/kernels.md, "Launch configurations"; `make bench TARGET=blocks` sweeps them on yours). In the
# interpreter each operation has a fixed cost: fewer, larger blocks
CONFIGS = {"forward": (128, 4), "backward": (64, 2), "interpreted": (1024, 1)}
# At most this many backward programs, each writing one [4 C, 16] partial sum (8.5 MB in all at C = 4): fewer
# programs sum across threads less often, more keep more SMs busy. Chosen as CONFIGS are
PROGRAMS = {"backward": 8192}
MAX_CHANNELS = 64  # one [BLOCK, C] tile per convolution position stays in registers up to here
# the fused blocks' winner byte (conv_pool_kernel.py, bias_pool_kernel.py) where the ReLU passed no gradient
NO_WINNER = 255


def kernels_unavailable(device: torch.device) -> str | None:
    """Why the fused blocks' Triton kernels (this module's and conv_pool_kernel.py's) cannot run on ``device``."""
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda" and not INTERPRETED:
        return f"it is a Triton kernel and this run is on {device} (it needs CUDA)"
    return None


def launch(configs: dict, kernel: str, items: int, most: dict | None = None) -> tuple[int, dict]:
    """(programs, launch keywords) of ``configs[kernel]`` (``configs["interpreted"]`` in the interpreter)
    over ``items`` pixels, which the fused blocks' kernels index with int32: one program a block of pixels, or,
    for a kernel that ``most`` (a module's PROGRAMS) names, at most that many, which loop over the blocks."""
    block, warps = configs["interpreted" if INTERPRETED else kernel]
    if items + block >= 2**31:
        raise ValueError(f"{items} pixels: the fused blocks' kernels index pixels with int32 (< 2**31)")
    blocks = triton.cdiv(items, block)
    return min(blocks, (most or {}).get(kernel, blocks)), {"BLOCK": block, "num_warps": warps}


def fold_window(by_cell: Tensor) -> Tensor:
    """The weight gradient [C_out, C_in, 3, 3] from a pooled block's window sums ``by_cell`` [2, 2, C_out, 4, 4,
    C_in] (pool position (dy, dx), output channel, cell of the 4x4 window, input channel): tap (ky, kx) at
    position (dy, dx) read cell (dy + ky, dx + kx), so each position's sums are added onto the taps at that offset."""
    taps = sum(by_cell[dy, dx, :, dy : dy + 3, dx : dx + 3] for dy in (0, 1) for dx in (0, 1))
    return taps.permute(0, 3, 1, 2)


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
    _NO_WINNER = tl.constexpr(NO_WINNER)  # the kernels' copy: a JIT function reads only constexpr globals

    # Builtins only (tl.reduce, tl.full, ...), as in triton_giou.py, so that the interpreter runs them; sums combine
    # with detector/kernels/jit.py's _add.

    @triton.jit
    def _round_bf16(v):
        """fp32 -> the nearest bf16 (ties to even) -> fp32, by bits: the interpreter's cast truncates instead."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _pixel(img_ptr, image, yy, xx, S: tl.constexpr, live, ROUND: tl.constexpr):
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
        img_ptr,
        w_ptr,
        b_ptr,
        first,
        n_pooled,
        S: tl.constexpr,
        W2: tl.constexpr,
        C: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK: tl.constexpr,
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
        S: tl.constexpr,  # the image side: a constant, so the pixel index's divisions compile to shifts and multiplies
        W2: tl.constexpr,  # S // 2
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
    def _dot(a, b, UPCAST: tl.constexpr):
        """a @ b with fp32 sums; UPCAST (the interpreter, whose dot misreads bf16): fp32 operands, the same
        products (a bf16 x bf16 product is exact in fp32)."""
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)

    @triton.jit
    def _cat4(a, b, c, d):
        """[BLOCK, 4 N]: column 4 n + i is column n of the i-th of a, b, c, d ([BLOCK, N] each, or [BLOCK])."""
        t = tl.join(tl.join(a, c), tl.join(b, d))  # [BLOCK, (N,) 2, 2]: [..., i // 2, i % 2]
        return tl.reshape(t, (t.shape[0], t.numel // t.shape[0]))

    @triton.jit
    def _stem_bwd_kernel(
        img_ptr,
        w_ptr,
        b_ptr,
        gout_ptr,  # [B, C, S/2, S/2] gradient of the output, strides below
        partial_ptr,  # [programs, ROWS * 16 + C] fp32 out: acc (below), then the bias gradient
        n_pooled,
        S: tl.constexpr,
        W2: tl.constexpr,
        sg_b,
        sg_c,
        sg_h,
        sg_w,
        C: tl.constexpr,
        ROWS: tl.constexpr,  # max(4 C, 16): some Triton versions take no dot dimension under 16
        ROUND: tl.constexpr,
        UPCAST: tl.constexpr,  # the interpreter: fp32 dot operands
        BLOCK: tl.constexpr,
    ):
        # acc[j, cell]: over the program's pixels, the sum of the gradient routed to channel j // (ROWS / C) at window
        # position (j // (ROWS / 4 C)) % 4 (row-major) times the 4x4 patch's cell (row-major); where ROWS > 4 C each
        # row comes ROWS / 4 C times
        acc = tl.zeros((ROWS, 16), dtype=tl.float32)
        d_bias = tl.zeros((BLOCK, C), dtype=tl.float32)  # summed over pixels once, at the end
        ch = tl.arange(0, C)
        # under bf16 autocast both operands are bf16 values (the pixels rounded, the gradient bf16): exact products
        operand: tl.constexpr = tl.bfloat16 if ROUND and gout_ptr.dtype.element_ty == tl.bfloat16 else tl.float32
        for blk in range(tl.program_id(0), tl.cdiv(n_pooled, BLOCK), tl.num_programs(0)):
            v00, v01, v10, v11, q, at = _window(img_ptr, w_ptr, b_ptr, blk * BLOCK, n_pooled, S, W2, C, ROUND, BLOCK)
            b, py, px, live = at
            g = tl.load(
                gout_ptr + (b * sg_b + py * sg_h + px * sg_w)[:, None] + (ch * sg_c)[None, :],
                mask=live[:, None],
                other=0,
            ).to(tl.float32)
            top = tl.maximum(tl.maximum(v00, v01), tl.maximum(v10, v11))
            g = tl.where(live[:, None] & (top > 0), g, 0.0)  # ReLU: the gradient passes where the output is > 0
            d_bias += g
            # the first maximum in row-major order takes the whole gradient (PyTorch's max_pool2d)
            first00 = v00 == top
            first01 = (v01 == top) & ~first00
            first10 = (v10 == top) & ~first00 & ~first01
            first11 = ~first00 & ~first01 & ~first10
            g00, g01 = tl.where(first00, g, 0.0), tl.where(first01, g, 0.0)
            g10, g11 = tl.where(first10, g, 0.0), tl.where(first11, g, 0.0)
            routed = _cat4(g00, g01, g10, g11)  # [BLOCK, 4 C]: channel-major, position-minor
            if ROWS > 4 * C:
                routed = tl.reshape(tl.broadcast_to(routed[:, :, None], (BLOCK, 4 * C, ROWS // (4 * C))), (BLOCK, ROWS))
            patch = _cat4(  # [BLOCK, 16] row-major, from the patch's 4 columns
                _cat4(q[0], q[4], q[8], q[12]),
                _cat4(q[1], q[5], q[9], q[13]),
                _cat4(q[2], q[6], q[10], q[14]),
                _cat4(q[3], q[7], q[11], q[15]),
            )
            acc += _dot(tl.trans(routed.to(operand)), patch.to(operand), UPCAST)
        out = partial_ptr + tl.program_id(0) * (ROWS * 16 + C)
        tl.store(out + tl.arange(0, ROWS)[:, None] * 16 + tl.arange(0, 16)[None, :], acc)
        tl.store(out + ROWS * 16 + ch, tl.reduce(d_bias, 0, _add))


# ----------------------------------------------------------------------------- launchers and the op


def _launch_shape(images: Tensor, kernel: str) -> tuple[int, int, int, dict]:
    """(side, pooled pixels, programs, launch keywords) of one of the CONFIGS kernels."""
    side = images.shape[2]
    n_pooled = images.shape[0] * (side // 2) ** 2
    return side, n_pooled, *launch(CONFIGS, kernel, n_pooled, PROGRAMS)


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
        rows = max(16, 4 * channels)
        partial = torch.empty(programs, rows * 16 + channels, device=images.device, dtype=torch.float32)
        if programs:
            _stem_bwd_kernel[(programs,)](
                images, weight, bias, grad_out, partial, n_pooled, side, side // 2, *grad_out.stride(),
                C=channels, ROWS=rows, ROUND=bf16, UPCAST=INTERPRETED, **launch,
            )  # fmt: skip
        total = partial.sum(0)
        # [channel, dy, dx, patch row, patch column]: tap (ky, kx) at position (dy, dx) reads cell (dy + ky, dx + kx)
        acc = total[: rows * 16].view(channels, 2, 2, rows // (4 * channels), 4, 4)[:, :, :, 0]
        d_weight = fold_window(acc.permute(1, 2, 0, 3, 4).unsqueeze(-1))  # one input channel
        # copies laid out as the fake's: a custom op's outputs may not be views of one another
        return torch.empty_like(weight).copy_(d_weight), torch.empty_like(bias).copy_(total[rows * 16 :])

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
