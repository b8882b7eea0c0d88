"""A detector block — 3x3 convolution (C_in >= 2 -> C_out >= 16 channels, zero "same" padding), 2x2 max-pool,
ReLU — as Triton kernels: one forward, and two backward (the weight and bias gradients; the input's).

Why: after the fused first block (stem_kernel.py), cuDNN runs the second block (4 -> 16 channels at 128 px) in an
engine without tensor cores, pads its channels and runs the pool's backward as kernels of their own: many
times what its ~1 GB of data takes at the copy rate (~0.25 ms). ``python -m detector bench step`` times the
step with and without the fused blocks (train.fused_blocks).

The kernels build the convolution from tensor-core products. The forward and the weight gradient take each
pooled pixel's 4x4 input window (rows 2py-1 .. 2py+2, columns 2px-1 .. 2px+2: every input its 2x2 pool window's
4 convolutions read) as one row of a [BLOCK, KW] tile, gathered once: cell-major (cell = 4 row + column),
channel-minor, padded with zeros to a power of two KW = 16 C_in (64 for 4 channels: no padding). Gathering four
3x3 patches instead (one per position, each padded from 9 C_in to a power of two) took 4x the loads and their
address arithmetic, which, not the bytes, set these kernels' time.

- Forward, BLOCK pooled pixels per step of a loop over the program's blocks: the window times each position's
  [KW, C_out] weights (the 3x3 weights placed at that position's cells, zeros elsewhere; built by
  ``_window_weights``, loaded once per program) gives the 4 convolutions of each 2x2 window; their maximum (the
  first in row-major order wins ties, as PyTorch's max_pool2d), the ReLU; it writes the output and, per output
  value, which of the 4 positions won (``winner``, uint8; NO_WINNER where the ReLU blocked the gradient).
- Weight gradient, the same blocks: the output gradient routed to its winning position, [BLOCK, 4 C_out]
  (position-major), transposed times the window: [4 C_out, KW] summed in fp32 over every block of the program.
  At most PROGRAMS["wgrad"] programs, so their partial sums are few (34 MB at seed scale, where one per block of 32
  pixels would write and read back 2.2 GB); one ``sum`` over programs and a fold of the cells onto the 3x3 taps
  (tap (ky, kx) at position (dy, dx) read cell (dy + ky, dx + kx)) finish it: deterministic, no atomics.
- Input gradient, BLOCK 2x2 quads of input pixels per program: the 16 convolutions that feed a quad (rows
  and columns 2q-1 .. 2q+2) each read the output gradient of the pooled pixel whose window holds them and keep
  it where that convolution won; a row of 4 of them at a time, [BLOCK, 4 C_out], times the [4 C_out, 4 C_in]
  weights through which each feeds each of the quad's pixels (``_quad_weights``) gives the quad's gradient in 4
  products. Routed once for four pixels: one pixel at a time routes each convolution 9 times, and took 1.5 ms
  at seed scale on an H100 where the quads took 1.0 (as 36 products of one convolution and one tap each).

Under bf16 autocast (bf16 input) the products take bf16 operands with fp32 sums and each convolution is
rounded to bf16 before the pool, as the layers do. Runs on CUDA, or on the CPU in the Triton interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from detector.kernels.jit import INTERPRETED, _add, tl, triton
from detector.model.stem_kernel import fold_window, is_channels_last, kernels_unavailable, launch

if triton is not None:
    # the same helpers: round as autocast, sum, dot; the no-winner byte
    from detector.model.stem_kernel import _NO_WINNER, _dot, _round_bf16

# (pixels per block, warps) of each kernel; pixels: pooled for forward and wgrad, 2x2 input quads for dgrad. The
# fastest of a sweep at seed scale (docs/kernels.md, "Launch configurations"); `make bench TARGET=blocks` sweeps
# them on the GPU you train on
CONFIGS = {"forward": (32, 2), "wgrad": (64, 4), "dgrad": (64, 4), "interpreted": (256, 1)}
# At most this many programs loop over the forward's and the weight gradient's pixel blocks: the forward loads its
# 4 [KW, C_out] weight tiles once per program, the weight gradient writes one [4 C_out, KW + 1] partial sum per
# program; fewer programs write fewer partial sums, more keep more SMs busy. Chosen as CONFIGS are
PROGRAMS = {"forward": 8192, "wgrad": 2048}
# The largest window times output channels (KW x C_out) whose fp32 tiles fit the 227 KB of shared memory of a
# Hopper SM (docs/kernels.md, "The second block": which channel counts ran and which did not)
MAX_WINDOW_PRODUCT = 4096


def conv_pool_unavailable(device: torch.device, c_in: int, c_out: int) -> str | None:
    """Why the fused block cannot run here, or None."""
    if reason := kernels_unavailable(device):
        return reason
    if not 2 <= c_in <= 16 or c_out not in (16, 32) or _k_window(c_in) * c_out > MAX_WINDOW_PRODUCT:
        return (
            f"a {c_in} -> {c_out} block: the kernels take 2..16 input and 16 or 32 output channels, with 16 x input "
            f"channels (to a power of two) x output channels <= {MAX_WINDOW_PRODUCT} (2..8 -> 32, 9..16 -> 16)"
        )
    return None


def _k_quad(c_in: int) -> int:
    return max(16, triton.next_power_of_2(4 * c_in))


def _k_window(c_in: int) -> int:
    return triton.next_power_of_2(16 * c_in)  # >= 32 for c_in >= 2: tl.dot's operands need 16


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _pooled_pixels(first, n_pooled, W2: tl.constexpr, BLOCK: tl.constexpr):
        p = first + tl.arange(0, BLOCK)
        return (p // (W2 * W2)).to(tl.int64), (p // W2) % W2, p % W2, p < n_pooled

    @triton.jit
    def _window(x_ptr, b, py, px, live, S: tl.constexpr, sx_b, sx_c, sx_h, sx_w, C_IN: tl.constexpr, KW: tl.constexpr):
        """[BLOCK, KW] 4x4 input windows under the pooled pixels (b, py, px): rows 2py-1 .. 2py+2 and columns
        2px-1 .. 2px+2, cell-major (cell = 4 row + column), channel-minor; zeros outside the image (the
        convolution's padding) and past 16 C_IN."""
        k = tl.arange(0, KW)
        cell, ch = k // C_IN, k % C_IN
        yy = (2 * py - 1)[:, None] + (cell // 4)[None, :]
        xx = (2 * px - 1)[:, None] + (cell % 4)[None, :]
        inside = live[:, None] & (cell < 16)[None, :] & (yy >= 0) & (yy < S) & (xx >= 0) & (xx < S)
        offsets = b[:, None] * sx_b + (ch * sx_c)[None, :] + yy * sx_h + xx * sx_w
        return tl.load(x_ptr + offsets, mask=inside, other=0)

    @triton.jit
    def _conv_pool_fwd_kernel(
        x_ptr,
        w_ptr,  # [4, KW, C_OUT] the positions' window weights (_window_weights), in x's dtype
        b_ptr,
        out_ptr,
        winner_ptr,
        n_pooled,
        S: tl.constexpr,  # the input's side, a constant: the pixel index's divisions compile to shifts and multiplies
        W2: tl.constexpr,  # S // 2
        sx_b,
        sx_c,
        sx_h,
        sx_w,
        so_b,
        so_c,
        so_h,
        so_w,
        C_IN: tl.constexpr,
        C_OUT: tl.constexpr,
        KW: tl.constexpr,
        ROUND: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        k, o = tl.arange(0, KW), tl.arange(0, C_OUT)
        tile = k[:, None] * C_OUT + o[None, :]
        w0 = tl.load(w_ptr + tile)
        w1 = tl.load(w_ptr + KW * C_OUT + tile)
        w2 = tl.load(w_ptr + 2 * KW * C_OUT + tile)
        w3 = tl.load(w_ptr + 3 * KW * C_OUT + tile)
        bias = tl.load(b_ptr + o).to(tl.float32)
        if ROUND:
            bias = _round_bf16(bias)
        for block in range(tl.program_id(0), tl.cdiv(n_pooled, BLOCK), tl.num_programs(0)):
            b, py, px, live = _pooled_pixels(block * BLOCK, n_pooled, W2, BLOCK)
            window = _window(x_ptr, b, py, px, live, S, sx_b, sx_c, sx_h, sx_w, C_IN, KW)
            top = _conv(window, w0, bias, ROUND, UPCAST)
            winner = tl.zeros((BLOCK, C_OUT), dtype=tl.int32)
            top, winner = _keep_max(_conv(window, w1, bias, ROUND, UPCAST), 1, top, winner)
            top, winner = _keep_max(_conv(window, w2, bias, ROUND, UPCAST), 2, top, winner)
            top, winner = _keep_max(_conv(window, w3, bias, ROUND, UPCAST), 3, top, winner)
            mask = live[:, None]
            tl.store(
                out_ptr + (b * so_b + py * so_h + px * so_w)[:, None] + (o * so_c)[None, :],
                tl.maximum(top, 0.0).to(out_ptr.dtype.element_ty),
                mask=mask,
            )
            winner = tl.where(top > 0, winner, _NO_WINNER)  # the ReLU passes no gradient
            flat = ((b * W2 + py) * W2 + px)[:, None] * C_OUT + o[None, :]
            tl.store(winner_ptr + flat, winner.to(tl.uint8), mask=mask)

    @triton.jit
    def _conv(window, w, bias, ROUND: tl.constexpr, UPCAST: tl.constexpr):
        """[BLOCK, C_OUT] convolutions at one position of the pool window: the window times its weights."""
        v = _dot(window, w, UPCAST) + bias[None, :]
        if ROUND:
            v = _round_bf16(v)
        return v

    @triton.jit
    def _keep_max(v, position: tl.constexpr, top, winner):
        """The running maximum and its position, taking ``v`` only where strictly greater: the first maximum
        in row-major order keeps the gradient, as in max_pool2d."""
        better = v > top
        return tl.where(better, v, top), tl.where(better, position, winner)

    @triton.jit
    def _conv_pool_wgrad_kernel(
        x_ptr,
        gout_ptr,
        winner_ptr,
        partial_ptr,  # [programs, 4 C_OUT, KW + 1] fp32: per position and output channel, the cells' sums, the bias's
        n_pooled,
        S: tl.constexpr,  # the input's side, a constant: the pixel index's divisions compile to shifts and multiplies
        W2: tl.constexpr,  # S // 2
        sx_b,
        sx_c,
        sx_h,
        sx_w,
        sg_b,
        sg_c,
        sg_h,
        sg_w,
        C_IN: tl.constexpr,
        C_OUT: tl.constexpr,
        KW: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.arange(0, 4 * C_OUT)  # routed column: position j // C_OUT, output channel j % C_OUT
        position, o = j // C_OUT, j % C_OUT
        acc = tl.zeros((4 * C_OUT, KW), dtype=tl.float32)
        passed = tl.zeros((BLOCK, 4 * C_OUT), dtype=tl.float32)  # summed over pixels once, at the end
        for block in range(tl.program_id(0), tl.cdiv(n_pooled, BLOCK), tl.num_programs(0)):
            b, py, px, live = _pooled_pixels(block * BLOCK, n_pooled, W2, BLOCK)
            mask = live[:, None]
            pixel = b * sg_b + py * sg_h + px * sg_w
            g = tl.load(gout_ptr + pixel[:, None] + (o * sg_c)[None, :], mask=mask, other=0)
            flat = ((b * W2 + py) * W2 + px)[:, None] * C_OUT + o[None, :]
            won = tl.load(winner_ptr + flat, mask=mask, other=_NO_WINNER).to(tl.int32) == position[None, :]
            window = _window(x_ptr, b, py, px, live, S, sx_b, sx_c, sx_h, sx_w, C_IN, KW)
            routed = tl.where(won, g, 0.0)
            passed += routed.to(tl.float32)
            acc += _dot(tl.trans(routed.to(window.dtype)), window, UPCAST)
        base = partial_ptr + tl.program_id(0) * (4 * C_OUT) * (KW + 1) + j * (KW + 1)
        tl.store(base[:, None] + tl.arange(0, KW)[None, :], acc)
        tl.store(base + KW, tl.reduce(passed, 0, _add))

    @triton.jit
    def _conv_pool_dgrad_kernel(
        w_ptr,  # [16 C_OUT, KQ] the quad weights (_quad_weights), in dx's dtype
        gout_ptr,
        winner_ptr,
        dx_ptr,
        n_quads,
        S: tl.constexpr,  # as the forward's
        Q: tl.constexpr,  # (S + 1) // 2 quads a side
        W2: tl.constexpr,
        sg_b,
        sg_c,
        sg_h,
        sg_w,
        sd_b,
        sd_c,
        sd_h,
        sd_w,
        C_IN: tl.constexpr,
        C_OUT: tl.constexpr,
        KQ: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """The input gradient of BLOCK 2x2 quads of input pixels per program (Q x Q quads per image): the 16
        convolutions that feed a quad's 4 pixels (rows and columns 2q-1 .. 2q+2), routed once each, times the
        weights through which each feeds each of the quad's pixels, one row of 4 convolutions at a time."""
        q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = q < n_quads
        b = (q // (Q * Q)).to(tl.int64)
        y0 = 2 * ((q // Q) % Q)  # the quad's top-left input pixel
        x0 = 2 * (q % Q)
        dt = dx_ptr.dtype.element_ty
        j = tl.arange(0, 4 * C_OUT)  # routed column: convolution column j // C_OUT of the row, output channel j % C_OUT
        o = j % C_OUT
        cx = (x0 - 1)[:, None] + (j // C_OUT)[None, :]
        px = tl.where(cx >= 0, cx // 2, 0)
        k = tl.arange(0, KQ)  # the product's column: quad pixel (k // C_IN) // 2, k // C_IN % 2; channel k % C_IN
        d = tl.zeros((BLOCK, KQ), dtype=tl.float32)
        for r in tl.static_range(4):
            cy = y0 - 1 + r
            py = tl.where(cy >= 0, cy // 2, 0)
            feeds = (live & (cy >= 0) & (cy < 2 * W2))[:, None] & (cx >= 0) & (cx < 2 * W2)
            pixel = b[:, None] * sg_b + (py * sg_h)[:, None] + px * sg_w
            g = tl.load(gout_ptr + pixel + (o * sg_c)[None, :], mask=feeds, other=0)
            flat = ((b * W2 + py)[:, None] * W2 + px) * C_OUT + o[None, :]
            position = ((cy % 2) * 2)[:, None] + cx % 2
            won = tl.load(winner_ptr + flat, mask=feeds, other=_NO_WINNER).to(tl.int32) == position
            routed = tl.where(won, g, 0.0).to(dt)
            w = tl.load(w_ptr + (r * 4 * C_OUT + j)[:, None] * KQ + k[None, :])
            d += _dot(routed, w, UPCAST)
        quad_pixel, ch = k // C_IN, k % C_IN
        yy = y0[:, None] + (quad_pixel // 2)[None, :]
        xx = x0[:, None] + (quad_pixel % 2)[None, :]
        keep = live[:, None] & (quad_pixel < 4)[None, :] & (yy < S) & (xx < S)  # an odd side's last quads: half out
        tl.store(dx_ptr + b[:, None] * sd_b + yy * sd_h + xx * sd_w + (ch * sd_c)[None, :], d.to(dt), mask=keep)


# ----------------------------------------------------------------------------- launchers and the op


def _launch(kernel: str, items: int) -> tuple[tuple[int], dict]:
    """(grid, keyword arguments) of one of the CONFIGS kernels over ``items`` pixels (PROGRAMS caps the looping
    kernels' grids)."""
    programs, keywords = launch(CONFIGS, kernel, items, PROGRAMS)
    return (programs,), keywords | {"UPCAST": INTERPRETED}


def _window_weights(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """[4, KW, C_out] in ``dtype`` (rounded to nearest): for each position (dy, dx) of the pool window, row-major,
    the weights over the 4x4 window's cells as ``_window`` orders them: tap (ky, kx) at cell (dy + ky, dx + kx),
    zeros at the other cells and past 16 C_in."""
    c_out, c_in = weight.shape[:2]
    taps = weight.permute(2, 3, 1, 0)  # [3, 3, C_in, C_out]
    placed = [F.pad(taps, (0, 0, 0, 0, dx, 1 - dx, dy, 1 - dy)) for dy in (0, 1) for dx in (0, 1)]  # [4, 4, ...]
    window = torch.stack(placed).reshape(4, 16 * c_in, c_out)
    return F.pad(window, (0, 0, 0, _k_window(c_in) - 16 * c_in)).to(dtype).contiguous()


def _quad_weights(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """[16 C_out, KQ] in ``dtype`` (rounded to nearest): rows (convolution cell (r, c) of the 4x4 around a quad,
    output channel), columns (quad pixel (i, j), input channel): the convolution at cell (r, c) feeds pixel (i, j)
    through tap (i + 2 - r, j + 2 - c) where that tap exists, zeros elsewhere and past 4 C_in."""
    c_out, c_in = weight.shape[:2]
    quad = weight.new_zeros(4, 4, c_out, 2, 2, c_in)
    taps = weight.flip(2, 3).permute(2, 3, 0, 1)  # [3, 3, C_out, C_in]: (t, u) is tap (2 - t, 2 - u)
    for i in (0, 1):
        for j in (0, 1):
            quad[i : i + 3, j : j + 3, :, i, j] = taps
    quad = quad.reshape(16 * c_out, 4 * c_in)
    return F.pad(quad, (0, _k_quad(c_in) - 4 * c_in)).to(dtype).contiguous()


def _fold_window(cells: Tensor, c_in: int) -> tuple[Tensor, Tensor]:
    """(d weight [C_out, C_in, 3, 3], d bias [C_out]) from the weight gradient's [4 C_out, KW + 1] sums: each
    position's window cells summed onto the taps that read them, and the positions' bias sums added."""
    c_out = cells.shape[0] // 4
    kw = cells.shape[1] - 1
    return fold_window(cells[:, : 16 * c_in].reshape(2, 2, c_out, 4, 4, c_in)), cells[:, kw].reshape(4, c_out).sum(0)


def _empty_like_output(x: Tensor, c_out: int, dtype: torch.dtype) -> Tensor:
    batch, _, side, _ = x.shape
    fmt = torch.channels_last if is_channels_last(x) else torch.contiguous_format
    return torch.empty(batch, c_out, side // 2, side // 2, dtype=dtype, device=x.device, memory_format=fmt)


if triton is not None:

    @torch.library.custom_op("detector::conv_pool_forward", mutates_args=())
    def conv_pool_forward(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """(relu(max_pool2d(conv2d(x, weight, bias, padding=1), 2)) in x's dtype and layout, winner uint8)."""
        c_out, c_in = weight.shape[:2]
        out = _empty_like_output(x, c_out, x.dtype)
        batch, _, side, _ = x.shape
        winner = torch.empty(batch, side // 2, side // 2, c_out, dtype=torch.uint8, device=x.device)
        n_pooled = winner.numel() // c_out
        if n_pooled:
            grid, launch = _launch("forward", n_pooled)
            _conv_pool_fwd_kernel[grid](
                x, _window_weights(weight, x.dtype), bias, out, winner, n_pooled, side, side // 2,
                *x.stride(), *out.stride(), C_IN=c_in, C_OUT=c_out, KW=_k_window(c_in),
                ROUND=x.dtype == torch.bfloat16, **launch,
            )  # fmt: skip
        return out, winner

    @conv_pool_forward.register_fake
    def _forward_fake(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        batch, _, side, _ = x.shape
        c_out = weight.shape[0]
        winner = x.new_empty((batch, side // 2, side // 2, c_out), dtype=torch.uint8)
        return _empty_like_output(x, c_out, x.dtype), winner

    @torch.library.custom_op("detector::conv_pool_backward", mutates_args=())
    def conv_pool_backward(
        grad_out: Tensor, x: Tensor, weight: Tensor, winner: Tensor, needs_input_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(d x or an empty tensor, d weight, d bias) of conv_pool_forward."""
        c_out, c_in = weight.shape[:2]
        batch, _, side, _ = x.shape
        kw = _k_window(c_in)
        n_pooled = winner.numel() // c_out
        grid, launch = _launch("wgrad", n_pooled)
        partial = torch.empty(grid[0], 4 * c_out, kw + 1, device=x.device, dtype=torch.float32)
        d_x = torch.empty_like(x) if needs_input_grad else x.new_empty(0)
        if n_pooled:
            _conv_pool_wgrad_kernel[grid](
                x, grad_out, winner, partial, n_pooled, side, side // 2, *x.stride(),
                *grad_out.stride(), C_IN=c_in, C_OUT=c_out, KW=kw, **launch,
            )  # fmt: skip
        if needs_input_grad and x.numel():
            quads = (side + 1) // 2
            grid, launch = _launch("dgrad", batch * quads * quads)
            _conv_pool_dgrad_kernel[grid](
                _quad_weights(weight, d_x.dtype), grad_out, winner, d_x, batch * quads * quads, side, quads,
                side // 2, *grad_out.stride(), *d_x.stride(), C_IN=c_in, C_OUT=c_out, KQ=_k_quad(c_in), **launch,
            )  # fmt: skip
        d_weight, d_bias = _fold_window(partial.sum(0), c_in)
        # fresh tensors laid out as the fake's (weight may be channels_last): outputs may not be views
        return d_x, torch.empty_like(weight).copy_(d_weight), weight.new_empty(c_out).copy_(d_bias)

    @conv_pool_backward.register_fake
    def _backward_fake(grad_out, x, weight, winner, needs_input_grad):
        d_x = torch.empty_like(x) if needs_input_grad else x.new_empty(0)
        return d_x, torch.empty_like(weight), weight.new_empty(weight.shape[0])

    def _setup_context(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.bias_dtype = inputs[2].dtype

    def _backward(ctx, grad_out, _grad_winner):
        x, weight, winner = ctx.saved_tensors
        d_x, d_weight, d_bias = conv_pool_backward(grad_out, x, weight, winner, ctx.needs_input_grad[0])
        return (d_x if ctx.needs_input_grad[0] else None), d_weight, d_bias.to(ctx.bias_dtype)

    conv_pool_forward.register_autograd(_backward, setup_context=_setup_context)


def conv_pool(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """relu(max_pool2d(conv2d(x, weight, bias, padding=1), 2)) of x [B, C_in, S, S], in x's dtype and layout."""
    return torch.ops.detector.conv_pool_forward(x, weight, bias)[0]
