"""A detector block — 3x3 convolution (C_in >= 2 -> C_out >= 16 channels, zero "same" padding), 2x2 max-pool,
ReLU — as Triton kernels: one forward, and two backward (the weight and bias gradients; the input's).

Why: after the fused first block (stem_kernel.py), cuDNN runs the second block (4 -> 16 channels at 128 px) in an
engine without tensor cores, pads its channels and runs the pool's backward as kernels of their own: many
times what its ~1 GB of data takes at the copy rate (~0.25 ms). ``python -m detector bench step`` times the
step with and without the fused blocks (train.fused_blocks).

All three kernels build the convolution as tensor-core products of im2col tiles gathered on the fly:
the K = 9 C_in products of one output pixel (tap-major, channel-minor, padded with zeros to a power of
two KP) form one row of a [BLOCK, KP] tile, multiplied by the [KP, C_out] weights.

- Forward, BLOCK pooled pixels per program: the 4 convolutions of each 2x2 window, their maximum (the
  first in row-major order wins ties, as PyTorch's max_pool2d), the ReLU; it writes the output and, per
  output value, which of the 4 positions won (``winner``, uint8; 255 where the ReLU blocked the gradient).
- Weight gradient, BLOCK pooled pixels per program: sum over pixels of the output gradient routed to its
  winning position times that position's patch, [C_out, KP] per program; one ``sum`` over programs.
- Input gradient, BLOCK 2x2 quads of input pixels per program: the 16 convolutions that feed a quad (rows
  and columns 2q-1 .. 2q+2) each read the output gradient of the pooled pixel whose window holds them, keep
  it where that convolution won, and multiply it by the weights of each tap through which it feeds each of
  the quad's pixels ([C_out, C_in] a tap). Routed once for four pixels: one pixel at a time routes each
  convolution 9 times, and took 1.5 ms at seed scale on an H100 where the quads take 1.0.

Under bf16 autocast (bf16 input) the products take bf16 operands with fp32 sums and each convolution is
rounded to bf16 before the pool, as the layers do. Runs on CUDA, or on the CPU in the Triton interpreter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detector.kernels.triton_giou import INTERPRETED, triton
from detector.model.stem_kernel import is_channels_last, kernels_unavailable, launch

if triton is not None:
    import triton.language as tl

    from detector.model.stem_kernel import _add, _round_bf16  # the same helpers: round as autocast, sum

# (pixels per program, warps) of each kernel; pixels: pooled for forward and wgrad, 2x2 input quads for dgrad. The
# fastest at seed scale in `make bench TARGET=blocks` on an H100 (forward and wgrad 9-10 % faster each than (64, 4);
# dgrad of (32..128, 2..8): (64, 4), with (64, 2) and (128, 4) within 3 %)
CONFIGS = {"forward": (32, 2), "wgrad": (32, 2), "dgrad": (64, 4), "interpreted": (256, 1)}
NO_WINNER = 255  # `winner` where the ReLU passed no gradient


def conv_pool_unavailable(device: torch.device, c_in: int, c_out: int) -> str | None:
    """Why the fused block cannot run here, or None."""
    if reason := kernels_unavailable(device):
        return reason
    if not 2 <= c_in <= 16 or c_out & (c_out - 1) or not 16 <= c_out <= 64:
        return f"a {c_in} -> {c_out} block: the kernel takes 2..16 input and 16, 32 or 64 output channels"
    return None


def _k_padded(c_in: int) -> int:
    return max(16, triton.next_power_of_2(9 * c_in))


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr):
        """a @ b with fp32 sums; UPCAST (the interpreter, whose dot misreads bf16): fp32 operands, the same
        products (a bf16 x bf16 product is exact in fp32)."""
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)

    @triton.jit
    def _pooled_pixels(first, n_pooled, W2, BLOCK: tl.constexpr):
        p = first + tl.arange(0, BLOCK)
        return (p // (W2 * W2)).to(tl.int64), (p // W2) % W2, p % W2, p < n_pooled

    @triton.jit
    def _patch(x_ptr, b, cy, cx, live, S, sx_b, sx_c, sx_h, sx_w, C_IN: tl.constexpr, KP: tl.constexpr):
        """[BLOCK, KP] im2col rows of the convolutions at (cy, cx): tap-major, channel-minor, zero padded."""
        k = tl.arange(0, KP)
        tap, ch = k // C_IN, k % C_IN
        yy = cy[:, None] + (tap // 3)[None, :] - 1
        xx = cx[:, None] + (tap % 3)[None, :] - 1
        inside = live[:, None] & (tap < 9)[None, :] & (yy >= 0) & (yy < S) & (xx >= 0) & (xx < S)
        offsets = b[:, None] * sx_b + (ch * sx_c)[None, :] + yy * sx_h + xx * sx_w
        return tl.load(x_ptr + offsets, mask=inside, other=0)

    @triton.jit
    def _weights(w_ptr, C_IN: tl.constexpr, C_OUT: tl.constexpr, KP: tl.constexpr):
        """[KP, C_OUT] weights in the patch's row order (w is [C_OUT, C_IN, 3, 3] contiguous)."""
        k = tl.arange(0, KP)
        o = tl.arange(0, C_OUT)
        offsets = o[None, :] * (C_IN * 9) + ((k % C_IN) * 9 + k // C_IN)[:, None]
        return tl.load(w_ptr + offsets, mask=(k < 9 * C_IN)[:, None], other=0).to(tl.float32)

    @triton.jit
    def _as_operand(w, dtype: tl.constexpr):
        """fp32 weights as the other operand's dtype, rounded to nearest (the interpreter's cast truncates)."""
        if dtype == tl.bfloat16:
            w = _round_bf16(w)
        return w.to(dtype)

    @triton.jit
    def _conv_pool_fwd_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        winner_ptr,
        n_pooled,
        S,
        W2,
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
        KP: tl.constexpr,
        ROUND: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b, py, px, live = _pooled_pixels(tl.program_id(0) * BLOCK, n_pooled, W2, BLOCK)
        w = _as_operand(_weights(w_ptr, C_IN, C_OUT, KP), x_ptr.dtype.element_ty)
        o = tl.arange(0, C_OUT)
        bias = tl.load(b_ptr + o).to(tl.float32)
        if ROUND:
            bias = _round_bf16(bias)
        top = tl.full((BLOCK, C_OUT), float("-inf"), tl.float32)
        winner = tl.full((BLOCK, C_OUT), 0, tl.int32)
        for position in tl.static_range(4):
            patch = _patch(
                x_ptr, b, 2 * py + position // 2, 2 * px + position % 2, live, S, sx_b, sx_c, sx_h, sx_w, C_IN, KP
            )
            v = _dot(patch, w, UPCAST) + bias[None, :]
            if ROUND:
                v = _round_bf16(v)
            better = v > top  # strictly: the first maximum keeps the gradient
            winner = tl.where(better, position, winner)
            top = tl.where(better, v, top)
        out = tl.maximum(top, 0.0)
        mask = live[:, None]
        tl.store(
            out_ptr + (b * so_b + py * so_h + px * so_w)[:, None] + (o * so_c)[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
        winner = tl.where(top > 0, winner, 255)  # NO_WINNER: the ReLU passes no gradient
        flat = ((b * W2 + py) * W2 + px)[:, None] * C_OUT + o[None, :]
        tl.store(winner_ptr + flat, winner.to(tl.uint8), mask=mask)

    @triton.jit
    def _conv_pool_wgrad_kernel(
        x_ptr,
        gout_ptr,
        winner_ptr,
        partial_ptr,
        n_pooled,
        S,
        W2,
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
        KP: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b, py, px, live = _pooled_pixels(pid * BLOCK, n_pooled, W2, BLOCK)
        o = tl.arange(0, C_OUT)
        mask = live[:, None]
        g = tl.load(gout_ptr + (b * sg_b + py * sg_h + px * sg_w)[:, None] + (o * sg_c)[None, :], mask=mask, other=0)
        flat = ((b * W2 + py) * W2 + px)[:, None] * C_OUT + o[None, :]
        winner = tl.load(winner_ptr + flat, mask=mask, other=255).to(tl.int32)
        acc = tl.zeros((C_OUT, KP), dtype=tl.float32)
        for position in tl.static_range(4):
            patch = _patch(
                x_ptr, b, 2 * py + position // 2, 2 * px + position % 2, live, S, sx_b, sx_c, sx_h, sx_w, C_IN, KP
            )
            routed = tl.where(winner == position, g, 0.0).to(patch.dtype)
            acc += _dot(tl.trans(routed), patch, UPCAST)
        base = partial_ptr + pid * C_OUT * (KP + 1) + o * (KP + 1)
        k = tl.arange(0, KP)
        tl.store(base[:, None] + k[None, :], acc)
        passed = tl.where(winner != 255, g.to(tl.float32), 0.0)
        tl.store(base + KP, tl.reduce(passed, 0, _add))

    @triton.jit
    def _routed(gout_ptr, winner_ptr, b, cy, cx, live, W2, sg_b, sg_c, sg_h, sg_w, C_OUT: tl.constexpr):
        """[BLOCK, C_OUT] gradient of the convolutions at (cy, cx): the pooled gradient where that convolution won
        its window, else 0 (and 0 outside the pooled windows)."""
        o = tl.arange(0, C_OUT)
        feeds = live & (cy >= 0) & (cy < 2 * W2) & (cx >= 0) & (cx < 2 * W2)
        py, px = tl.where(feeds, cy // 2, 0), tl.where(feeds, cx // 2, 0)
        mask = feeds[:, None]
        g = tl.load(gout_ptr + (b * sg_b + py * sg_h + px * sg_w)[:, None] + (o * sg_c)[None, :], mask=mask, other=0)
        flat = ((b * W2 + py) * W2 + px)[:, None] * C_OUT + o[None, :]
        won = tl.load(winner_ptr + flat, mask=mask, other=255).to(tl.int32) == ((cy % 2) * 2 + cx % 2)[:, None]
        return tl.where(won, g, 0.0)

    @triton.jit
    def _tap(w_ptr, ty: tl.constexpr, tx: tl.constexpr, C_IN: tl.constexpr, C_OUT: tl.constexpr, CP: tl.constexpr):
        """[C_OUT, CP] weights of tap (ty, tx), fp32, zero past C_IN."""
        o, c = tl.arange(0, C_OUT), tl.arange(0, CP)
        mask = (c < C_IN)[None, :]
        w = tl.load(w_ptr + o[:, None] * (C_IN * 9) + (c * 9 + ty * 3 + tx)[None, :], mask=mask, other=0)
        return w.to(tl.float32)

    @triton.jit
    def _conv_pool_dgrad_kernel(
        w_ptr,
        gout_ptr,
        winner_ptr,
        dx_ptr,
        n_quads,
        S,
        Q,
        W2,
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
        CP: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """The input gradient of BLOCK 2x2 quads of input pixels per program (Q x Q quads per image): the 16
        convolutions that feed a quad's 4 pixels (rows and columns 2q-1 .. 2q+2) are routed once each and
        multiplied into every pixel they feed, where one pixel at a time would route each 9 times."""
        q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = q < n_quads
        b = (q // (Q * Q)).to(tl.int64)
        y0 = 2 * ((q // Q) % Q)  # the quad's top-left input pixel
        x0 = 2 * (q % Q)
        dt = dx_ptr.dtype.element_ty
        d00 = tl.zeros((BLOCK, CP), dtype=tl.float32)
        d01 = tl.zeros((BLOCK, CP), dtype=tl.float32)
        d10 = tl.zeros((BLOCK, CP), dtype=tl.float32)
        d11 = tl.zeros((BLOCK, CP), dtype=tl.float32)
        for r in tl.static_range(4):
            for c in tl.static_range(4):
                # the convolution at (y0 - 1 + r, x0 - 1 + c) feeds pixel (y0 + i, x0 + j) by tap (i + 2 - r, j + 2 - c)
                cy, cx = y0 - 1 + r, x0 - 1 + c
                routed = _routed(gout_ptr, winner_ptr, b, cy, cx, live, W2, sg_b, sg_c, sg_h, sg_w, C_OUT).to(dt)
                if r <= 2:
                    if c <= 2:
                        d00 += _dot(routed, _as_operand(_tap(w_ptr, 2 - r, 2 - c, C_IN, C_OUT, CP), dt), UPCAST)
                    if c >= 1:
                        d01 += _dot(routed, _as_operand(_tap(w_ptr, 2 - r, 3 - c, C_IN, C_OUT, CP), dt), UPCAST)
                if r >= 1:
                    if c <= 2:
                        d10 += _dot(routed, _as_operand(_tap(w_ptr, 3 - r, 2 - c, C_IN, C_OUT, CP), dt), UPCAST)
                    if c >= 1:
                        d11 += _dot(routed, _as_operand(_tap(w_ptr, 3 - r, 3 - c, C_IN, C_OUT, CP), dt), UPCAST)
        ch = tl.arange(0, CP)
        top_left = dx_ptr + (b * sd_b + y0 * sd_h + x0 * sd_w)[:, None] + (ch * sd_c)[None, :]
        keep = live[:, None] & (ch < C_IN)[None, :]
        right, below = (x0 + 1 < S)[:, None], (y0 + 1 < S)[:, None]  # an odd side's last quad is half outside
        tl.store(top_left, d00.to(dt), mask=keep)
        tl.store(top_left + sd_w, d01.to(dt), mask=keep & right)
        tl.store(top_left + sd_h, d10.to(dt), mask=keep & below)
        tl.store(top_left + sd_h + sd_w, d11.to(dt), mask=keep & below & right)


# ----------------------------------------------------------------------------- launchers and the op


def _launch(kernel: str, items: int) -> tuple[tuple[int], dict]:
    """(grid, keyword arguments) of one of the CONFIGS kernels over ``items`` pixels."""
    programs, keywords = launch(CONFIGS, kernel, items)
    return (programs,), keywords | {"UPCAST": INTERPRETED}


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
                x, weight.contiguous(), bias, out, winner, n_pooled, side, side // 2, *x.stride(), *out.stride(),
                C_IN=c_in, C_OUT=c_out, KP=_k_padded(c_in), ROUND=x.dtype == torch.bfloat16, **launch,
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
        kp = _k_padded(c_in)
        n_pooled = winner.numel() // c_out
        grid, launch = _launch("wgrad", n_pooled)
        partial = torch.empty(grid[0], c_out, kp + 1, device=x.device, dtype=torch.float32)
        d_x = torch.empty_like(x) if needs_input_grad else x.new_empty(0)
        if n_pooled:
            _conv_pool_wgrad_kernel[grid](
                x, grad_out, winner, partial, n_pooled, side, side // 2, *x.stride(), *grad_out.stride(),
                C_IN=c_in, C_OUT=c_out, KP=kp, **launch,
            )  # fmt: skip
        if needs_input_grad and x.numel():
            quads = (side + 1) // 2
            grid, launch = _launch("dgrad", batch * quads * quads)
            _conv_pool_dgrad_kernel[grid](
                weight.contiguous(), grad_out, winner, d_x, batch * quads * quads, side, quads, side // 2,
                *grad_out.stride(), *d_x.stride(), C_IN=c_in, C_OUT=c_out, CP=max(16, triton.next_power_of_2(c_in)),
                **launch,
            )  # fmt: skip
        total = partial.sum(0)  # [C_out, KP + 1]: the products in patch order (tap-major), then the bias
        d_weight = total[:, : 9 * c_in].reshape(c_out, 3, 3, c_in).permute(0, 3, 1, 2)
        # fresh tensors laid out as the fake's (weight may be channels_last): outputs may not be views
        return d_x, torch.empty_like(weight).copy_(d_weight), weight.new_empty(c_out).copy_(total[:, kp])

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
