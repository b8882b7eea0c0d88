"""The GIoU loss as one Triton kernel: the loss, its gradient and the mean, in a single launch.

Forward launches one kernel over padded targets ([B, M, 4] boxes + [B] counts). It writes the scalar
loss and d loss / d pred (saved for backward), so backward is one multiply by ``grad_output``. The
number of valid boxes is counted on the device, so nothing waits for the host. The op is a
``torch.library.triton_op``: ``torch.compile(fullgraph=True)`` traces into the kernel.

On a machine without CUDA the kernel runs through the Triton interpreter (numpy on the CPU) when
TRITON_INTERPRET=1 is set before this module is imported: the CLI and the tests' conftest.py set it
(and say so) where there is no GPU; importing this module sets nothing.

Order, as in Liger-Kernel: the @triton.jit kernels, the host launcher, the op at the bottom. The
launcher trusts its caller (``detector.losses.Strategy`` checks the inputs once).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # e.g. macOS or Windows: the strategy stays listed, with the reason it cannot run
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # kernels run as numpy on the host
PROGRAMS_PER_SM = 4  # the persistent grid: enough resident programs per SM to hide memory latency
INTERPRETER_PROGRAMS = 2  # the interpreter runs programs one after another; a few keep it honest
MAX_ELEMENTS = 2**31  # kernel offsets are int32
EPS = 1e-7  # the contract's eps (detector.losses.geometry.EPS; tests/kernels checks they agree)
DOUBLE_BACKWARD_ERROR = (
    "double backward through 'triton' (detector::giou_loss_triton) is not supported: its gradient is "
    "computed inside the forward kernel and only scaled in backward, so it has no graph to differentiate "
    "again; use the 'padded' strategy for higher-order gradients"
)


# ----------------------------------------------------------------------------- kernels

if triton is not None:
    # The kernels use triton.language builtins only, not its library @triton.jit functions (tl.sum,
    # tl.zeros, ...): those are compiled-only if triton was imported before TRITON_INTERPRET was set
    # (torch._dynamo imports it), and the interpreter cannot call them. Hence tl.reduce and tl.full.

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _share_of_max(a, b):
        """d max(a, b) / d a, as PyTorch autograd gives it: 1 if a > b, 1/2 at a tie, else 0."""
        return tl.where(a > b, 1.0, tl.where(a == b, 0.5, 0.0))

    # The maths, for one box: pred (x1, y1, x2, y2), target (gx1, gy1, gx2, gy2), eps = 1e-7.
    #
    #   iw = min(x2, gx2) - max(x1, gx1)     ih = min(y2, gy2) - max(y1, gy1)     (intersection)
    #   cw = max(x2, gx2) - min(x1, gx1)     ch = max(y2, gy2) - min(y1, gy1)     (enclosing box)
    #   inter = iw * ih if iw > 0 and ih > 0 else 0
    #   union = (x2 - x1) (y2 - y1) + (gx2 - gx1) (gy2 - gy1) - inter,     U = union + eps
    #   C     = cw * ch,                                                    Ce = C + eps
    #   loss  = 1 - inter / U + (C - union) / Ce                            (= 1 - GIoU)
    #
    # Its partial derivatives, with iou = inter / U (union depends on inter too):
    #
    #   d_area  = d loss / d area(pred) = iou / U - 1 / Ce
    #   d_inter = d loss / d inter      = 1 / Ce - (1 + iou) / U        (0 when the boxes do not overlap)
    #   d_encl  = d loss / d C          = U / Ce^2
    #
    # and through the widths (the heights are the same with x <-> y, w <-> h):
    #
    #   d loss / d x1 = -(d_area ph + d_inter ih [x1 > gx1] + d_encl ch [x1 < gx1])
    #   d loss / d x2 =   d_area ph + d_inter ih [x2 < gx2] + d_encl ch [x2 > gx2]
    #
    # with ph = y2 - y1, and [a > b] the share of max(a, b) that a gets: 1, 1/2 at a tie (as autograd
    # splits it), 0. The mean over the valid boxes multiplies the loss and the gradient by 1 / n_valid,
    # n_valid = sum over b of clamp(counts[b], 0, M). Every program sums the B counts itself (B integers
    # from L2), so it can scale its gradient before storing it: no second pass and no host round trip.
    #
    # The grid is persistent: P programs (a few per SM) stride over blocks of BLOCK consecutive slots
    # of the flattened [B * M] boxes, so BLOCK is independent of M and the counts are summed P times,
    # not once per block. Each program adds its share of the mean loss to the scalar with one atomic
    # (so the loss's last bits depend on the programs' order; the gradient is deterministic).
    @triton.jit
    def _giou_loss_fwd_bwd_kernel(
        pred_ptr,  # [B, M, 4] predicted boxes xyxy, contiguous; fp32, bf16, fp16 or fp64
        target_ptr,  # [B, M, 4] target boxes xyxy, contiguous; any integer or floating dtype
        counts_ptr,  # [B] integer: slots j < counts[b] of image b are valid, the others are never read
        loss_ptr,  # [] zero on entry; receives the mean loss; its dtype is the compute dtype
        grad_ptr,  # [B, M, 4] like pred: d loss / d pred, exactly 0 in padded slots
        B,  # number of images
        M,  # slots per image
        EPS: tl.constexpr,  # added to the union and enclosing-area denominators
        COUNT_BLOCK: tl.constexpr,  # counts summed this many at a time
        BLOCK: tl.constexpr,  # boxes per program and iteration (autotuned)
    ):
        compute_dtype = loss_ptr.dtype.element_ty  # fp32, or fp64 for fp64 predictions
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)

        # n_valid, summed by every program on its own
        n_valid = 0
        for start in range(0, B, COUNT_BLOCK):
            images = start + tl.arange(0, COUNT_BLOCK)
            counts = tl.load(counts_ptr + images, mask=images < B, other=0)
            n_valid += tl.reduce(tl.minimum(tl.maximum(counts, 0), M).to(tl.int32), 0, _add)
        scale = 1.0 / tl.maximum(n_valid, 1).to(compute_dtype)

        loss_sum = tl.full((BLOCK,), 0, compute_dtype)
        n_boxes = B * M
        for block_start in range(pid * BLOCK, n_boxes, num_programs * BLOCK):
            box = block_start + tl.arange(0, BLOCK)  # flat index b * M + j
            in_range = box < n_boxes
            count = tl.load(counts_ptr + box // M, mask=in_range, other=0)
            valid = in_range & (box % M < count)  # j < counts[b]; j < M, so no clamp is needed here

            # four strided loads per side, in the input dtypes; padded slots are never read
            x1 = tl.load(pred_ptr + 4 * box + 0, mask=valid, other=0).to(compute_dtype)
            y1 = tl.load(pred_ptr + 4 * box + 1, mask=valid, other=0).to(compute_dtype)
            x2 = tl.load(pred_ptr + 4 * box + 2, mask=valid, other=0).to(compute_dtype)
            y2 = tl.load(pred_ptr + 4 * box + 3, mask=valid, other=0).to(compute_dtype)
            gx1 = tl.load(target_ptr + 4 * box + 0, mask=valid, other=0).to(compute_dtype)
            gy1 = tl.load(target_ptr + 4 * box + 1, mask=valid, other=0).to(compute_dtype)
            gx2 = tl.load(target_ptr + 4 * box + 2, mask=valid, other=0).to(compute_dtype)
            gy2 = tl.load(target_ptr + 4 * box + 3, mask=valid, other=0).to(compute_dtype)

            # forward
            pw, ph = x2 - x1, y2 - y1
            xi1, yi1 = tl.maximum(x1, gx1), tl.maximum(y1, gy1)
            xi2, yi2 = tl.minimum(x2, gx2), tl.minimum(y2, gy2)
            overlaps = (xi2 > xi1) & (yi2 > yi1)  # the contract's strict test
            iw, ih = xi2 - xi1, yi2 - yi1
            inter = tl.where(overlaps, iw * ih, 0.0)
            union = pw * ph + (gx2 - gx1) * (gy2 - gy1) - inter
            cw = tl.maximum(x2, gx2) - tl.minimum(x1, gx1)
            ch = tl.maximum(y2, gy2) - tl.minimum(y1, gy1)
            enclose = cw * ch
            inv_union, inv_enclose = 1.0 / (union + EPS), 1.0 / (enclose + EPS)  # 1 / U, 1 / Ce
            iou = inter * inv_union
            loss = 1.0 - iou + (enclose - union) * inv_enclose
            loss_sum += tl.where(valid, loss, 0.0)

            # backward, scaled by 1 / n_valid
            d_area = (iou * inv_union - inv_enclose) * scale
            d_inter = tl.where(overlaps, (inv_enclose - (1.0 + iou) * inv_union) * scale, 0.0)
            d_encl = (union + EPS) * inv_enclose * inv_enclose * scale
            dx1 = -(d_area * ph + d_inter * ih * _share_of_max(x1, gx1) + d_encl * ch * _share_of_max(gx1, x1))
            dy1 = -(d_area * pw + d_inter * iw * _share_of_max(y1, gy1) + d_encl * cw * _share_of_max(gy1, y1))
            dx2 = d_area * ph + d_inter * ih * _share_of_max(gx2, x2) + d_encl * ch * _share_of_max(x2, gx2)
            dy2 = d_area * pw + d_inter * iw * _share_of_max(gy2, y2) + d_encl * cw * _share_of_max(y2, gy2)

            # every slot in range is written: padded ones get exactly 0
            grad_dtype = grad_ptr.dtype.element_ty
            tl.store(grad_ptr + 4 * box + 0, tl.where(valid, dx1, 0.0).to(grad_dtype), mask=in_range)
            tl.store(grad_ptr + 4 * box + 1, tl.where(valid, dy1, 0.0).to(grad_dtype), mask=in_range)
            tl.store(grad_ptr + 4 * box + 2, tl.where(valid, dx2, 0.0).to(grad_dtype), mask=in_range)
            tl.store(grad_ptr + 4 * box + 3, tl.where(valid, dy2, 0.0).to(grad_dtype), mask=in_range)

        tl.atomic_add(loss_ptr, tl.reduce(loss_sum, 0, _add) * scale)

    # BLOCK / (32 * num_warps) boxes per thread: 4 to 8 keeps the ~40 live values per box in registers.
    # Benchmarking in the interpreter would time numpy, so it gets one config: a large block, because
    # each interpreted operation has a fixed cost.
    _CONFIGS = [
        triton.Config({"BLOCK": 256}, num_warps=2),
        triton.Config({"BLOCK": 512}, num_warps=4),
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 1024}, num_warps=8),
    ]
    _giou_loss_fwd_bwd_kernel = triton.autotune(
        configs=_CONFIGS[2:3] if INTERPRETED else _CONFIGS,
        key=["M"],
        reset_to_zero=["loss_ptr"],  # autotuning reruns the kernel; the loss accumulates atomically
    )(_giou_loss_fwd_bwd_kernel)


# ----------------------------------------------------------------------------- host launchers


@functools.cache
def _max_programs(device: torch.device) -> int:
    if INTERPRETED or device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM


def _giou_loss_fwd_bwd(pred: Tensor, boxes: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(mean loss [] in the compute dtype, d loss / d pred [B, M, 4] in pred's dtype), one launch."""
    pred, boxes, counts = pred.contiguous(), boxes.contiguous(), counts.contiguous()
    batch, max_boxes, _ = pred.shape
    compute_dtype = torch.promote_types(pred.dtype, torch.float32)  # fp32, or fp64 for fp64 predictions
    loss = torch.zeros((), dtype=compute_dtype, device=pred.device)
    grad = torch.empty_like(pred)
    if pred.numel():
        max_programs = _max_programs(pred.device)
        count_block = min(triton.next_power_of_2(batch), 1024)
        n_boxes = batch * max_boxes

        def grid(meta):
            return (min(triton.cdiv(n_boxes, meta["BLOCK"]), max_programs),)

        torch.library.wrap_triton(_giou_loss_fwd_bwd_kernel)[grid](
            pred, boxes, counts, loss, grad, batch, max_boxes, EPS=EPS, COUNT_BLOCK=count_block
        )
    return loss, grad


def triton_unavailable(device: torch.device) -> str | None:
    if triton is None:
        return "triton is not installed (pip install triton; Linux only)"
    if INTERPRETED or device.type == "cuda":
        return None
    if device.type == "cpu":
        return (
            "the Triton kernels are compiled for CUDA in this process: move pred and the targets to the GPU, "
            "or set TRITON_INTERPRET=1 before detector is imported to run CPU tensors in the interpreter"
        )
    return f"Triton has no backend for {device.type} tensors here"


# ----------------------------------------------------------------------------- the op


if triton is not None:
    # A triton_op shows its kernel to torch.compile, which traces the launch with fake tensors. The
    # interpreter would read their (absent) memory, so there the op is opaque: a custom_op with a fake.
    _define_op = torch.library.custom_op if INTERPRETED else torch.library.triton_op

    @_define_op("detector::giou_loss_triton", mutates_args=())
    def _giou_loss_triton_op(pred: Tensor, boxes: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        return _giou_loss_fwd_bwd(pred, boxes, counts)

    if INTERPRETED:

        @_giou_loss_triton_op.register_fake
        def _giou_loss_triton_fake(pred: Tensor, boxes: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
            return pred.new_empty((), dtype=torch.promote_types(pred.dtype, torch.float32)), torch.empty_like(pred)

    def _setup_context(ctx, inputs, output):
        _, grad = output
        ctx.save_for_backward(grad)

    def _backward(ctx, grad_loss, _grad_of_grad):
        if torch.is_grad_enabled():  # create_graph=True: `grad` has no graph, a second derivative would be 0
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None  # the gradient was computed in forward: only scale it

    _giou_loss_triton_op.register_autograd(_backward, setup_context=_setup_context)


def giou_loss_triton(pred: Tensor, boxes: Tensor, counts: Tensor) -> Tensor:
    """Mean GIoU loss (the contract of ``giou_loss_reference``) over padded targets, in one Triton launch.

    pred [B, M, 4] (fp32/bf16/fp16/fp64), boxes [B, M, 4] (integer or floating), counts [B] integer,
    all on one device, as ``detector.losses.checks.check_padded`` verifies. Counts outside [0, M] count
    as clamped to [0, M]: the kernel never reads them on the host.
    """
    if pred.numel() >= MAX_ELEMENTS:
        raise ValueError(f"pred has {pred.numel()} elements; the Triton kernel indexes with int32 (< 2**31)")
    reason = triton_unavailable(pred.device)
    if reason:
        raise RuntimeError(f"giou_loss_triton cannot run on pred's device {pred.device}: {reason}")
    loss, _ = torch.ops.detector.giou_loss_triton.default(pred, boxes, counts)
    return loss
