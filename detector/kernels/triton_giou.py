"""The GIoU loss as two Triton kernels: the loss and its mean forward, the gradient recomputed backward.

Forward launches one kernel over padded targets ([B, M, 4] boxes + [B] counts). Its loads are masked,
so padded slots are never read; it sums the loss and counts the valid boxes on the device, and the
last program to finish writes the mean loss and ``inv_count`` = 1 / max(n_valid, 1). Backward launches
one kernel that recomputes the gradient from pred, the targets and the counts, scales it by
grad_output * inv_count (both read from device memory: nothing waits for the host) and writes every
slot of d loss / d pred, exactly 0 in padded ones. Both read pred and the targets in valid slots only,
so forward+backward moves the gradient plus twice the valid boxes' bytes (saving a gradient in forward
and scaling it in backward moved 4 x pred + targets whatever the boxes): with the seed boxes (~2 of 256
slots valid) that is little more than the gradient itself.

Two entries, one pair of kernels:
- eager: ``_GiouLossTriton``, a torch.autograd.Function that launches the kernels itself, reusing the
  autotuned compiled kernel per key (``_launch``): no torch.library dispatch and no Triton launcher on
  the hot path, which cost ~0.5 ms of host time per forward+backward on an H200 host;
- torch.compile: the ops ``detector::giou_loss_triton`` and ``detector::giou_loss_triton_backward``
  are ``torch.library.triton_op``s, so ``torch.compile(fullgraph=True)`` traces into the kernels.

On a machine without CUDA the kernels run through the Triton interpreter (numpy on the CPU) where TRITON_INTERPRET=1
was set before Triton was imported (detector/kernels/jit.py, the one place that imports it).

Order, as in Liger-Kernel: the @triton.jit kernels, the host launchers, the autograd Function and the
ops, with the public ``giou_loss_triton`` at the bottom. What it calls trusts its caller
(``detector.losses.Strategy`` checks the inputs once).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.library import wrap_triton

from detector.kernels.jit import INTERPRETED, _add, _maximum, tl, triton

PROGRAMS_PER_SM = 4  # the persistent grid: enough resident programs per SM to hide memory latency
INTERPRETER_PROGRAMS = 2  # the interpreter runs programs one after another; a few keep it honest
MAX_ELEMENTS = 2**31  # kernel offsets are int32
EPS = 1e-7  # the contract's eps (detector.losses.geometry.EPS; tests/kernels checks they agree)
DOUBLE_BACKWARD_ERROR = (
    "double backward through 'triton' (detector::giou_loss_triton) is not supported: its backward is one "
    "Triton kernel with no autograd graph of its own, so there is nothing to differentiate again; use the "
    "'padded' strategy for higher-order gradients"
)


# ----------------------------------------------------------------------------- kernels

if triton is not None:
    # The kernels use triton.language builtins only, not its library @triton.jit functions (tl.sum,
    # tl.zeros, ...): those are compiled-only if triton was imported before TRITON_INTERPRET was set
    # (torch._dynamo imports it), and the interpreter cannot call them. Hence tl.reduce and tl.full.

    # Sums and maxima combine with detector/kernels/jit.py's _add and _maximum (handed to tl.reduce).

    @triton.jit
    def _share_of_max(a, b):
        """d max(a, b) / d a, as PyTorch autograd gives it: 1 if a > b, 1/2 at a tie, else 0."""
        return tl.where(a > b, 1.0, tl.where(a == b, 0.5, 0.0))

    @triton.jit
    def _tile_counts(counts_ptr, first_image, B, M, IMAGES: tl.constexpr):
        """counts[first_image : first_image + IMAGES] clamped to [0, M] (0 past B): the valid boxes per image."""
        images = first_image + tl.arange(0, IMAGES)
        counts = tl.load(counts_ptr + images, mask=images < B, other=0)
        return tl.minimum(tl.maximum(counts, 0), M).to(tl.int32)

    @triton.jit
    def _tile_slots(counts_ptr, first_image, j0, B, M, IMAGES: tl.constexpr, SLOTS: tl.constexpr):
        """Slots j0 .. j0 + SLOTS of images first_image .. + IMAGES, image-major, flattened to [IMAGES * SLOTS]:
        the flat slot b * M + j, whether it exists, and whether it is valid (j < counts[b])."""
        s = tl.arange(0, IMAGES * SLOTS)
        image, j = first_image + s // SLOTS, j0 + s % SLOTS  # SLOTS is a power of two: a shift and a mask
        in_range = (image < B) & (j < M)
        count = tl.load(counts_ptr + image, mask=in_range, other=0)  # IMAGES distinct addresses: cache hits
        return image * M + j, in_range, in_range & (j < count)  # j < M, so counts above M need no clamp

    @triton.jit
    def _load_boxes(ptr, box, valid, dtype, BLOCK: tl.constexpr):
        """x1, y1, x2, y2 [BLOCK] of the boxes at slots ``box``, in ``dtype``; 0 where not ``valid`` (not read).

        One [BLOCK, 4] tile, so a box is one vector load (16 bytes fp32, 8 bytes bf16, 4 bytes uint8)."""
        tile = tl.load(ptr + 4 * box[:, None] + tl.arange(0, 4)[None, :], mask=valid[:, None], other=0)
        xs, ys = tl.split(tl.reshape(tile.to(dtype), (BLOCK, 2, 2)))  # [BLOCK, 2] each: (x1, x2), (y1, y2)
        x1, x2 = tl.split(xs)
        y1, y2 = tl.split(ys)
        return x1, y1, x2, y2

    @triton.jit
    def _store_boxes(ptr, box, in_range, x1, y1, x2, y2, BLOCK: tl.constexpr):
        """x1, y1, x2, y2 [BLOCK] stored as one [BLOCK, 4] tile at slots ``box``, in ptr's dtype."""
        tile = tl.reshape(tl.join(tl.join(x1, x2), tl.join(y1, y2)), (BLOCK, 4))  # the inverse of _load_boxes
        offsets = 4 * box[:, None] + tl.arange(0, 4)[None, :]
        tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=in_range[:, None])

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
    # splits it), 0. The mean over the valid boxes scales the loss and the gradient by 1 / n_valid,
    # n_valid = sum over b of clamp(counts[b], 0, M).
    @triton.jit
    def _overlap(x1, y1, x2, y2, gx1, gy1, gx2, gy2):
        """What the loss and its gradient share: overlap test, intersection, union, enclosing box sides."""
        xi1, yi1 = tl.maximum(x1, gx1), tl.maximum(y1, gy1)
        xi2, yi2 = tl.minimum(x2, gx2), tl.minimum(y2, gy2)
        overlaps = (xi2 > xi1) & (yi2 > yi1)  # the contract's strict test
        iw, ih = xi2 - xi1, yi2 - yi1
        inter = tl.where(overlaps, iw * ih, 0.0)
        union = (x2 - x1) * (y2 - y1) + (gx2 - gx1) * (gy2 - gy1) - inter
        cw = tl.maximum(x2, gx2) - tl.minimum(x1, gx1)
        ch = tl.maximum(y2, gy2) - tl.minimum(y1, gy1)
        return overlaps, iw, ih, inter, union, cw, ch

    @triton.jit
    def _giou_grad(x1, y1, x2, y2, gx1, gy1, gx2, gy2, scale, EPS: tl.constexpr):
        """scale * d loss / d (x1, y1, x2, y2) of each box (the formulas above)."""
        overlaps, iw, ih, inter, union, cw, ch = _overlap(x1, y1, x2, y2, gx1, gy1, gx2, gy2)
        pw, ph = x2 - x1, y2 - y1
        inv_union, inv_enclose = 1.0 / (union + EPS), 1.0 / (cw * ch + EPS)  # 1 / U, 1 / Ce
        iou = inter * inv_union
        d_area = (iou * inv_union - inv_enclose) * scale
        d_inter = tl.where(overlaps, (inv_enclose - (1.0 + iou) * inv_union) * scale, 0.0)
        d_encl = (union + EPS) * inv_enclose * inv_enclose * scale
        dx1 = -(d_area * ph + d_inter * ih * _share_of_max(x1, gx1) + d_encl * ch * _share_of_max(gx1, x1))
        dy1 = -(d_area * pw + d_inter * iw * _share_of_max(y1, gy1) + d_encl * cw * _share_of_max(gy1, y1))
        dx2 = d_area * ph + d_inter * ih * _share_of_max(gx2, x2) + d_encl * ch * _share_of_max(x2, gx2)
        dy2 = d_area * pw + d_inter * iw * _share_of_max(gy2, y2) + d_encl * cw * _share_of_max(y2, gy2)
        return dx1, dy1, dx2, dy2

    # Both kernels work on tiles of IMAGES images x SLOTS slots. Valid slots are a prefix of each image, so
    # a tile's slots past its largest count are all padded: the forward kernel skips them, the backward
    # kernel only stores their zeros. With the seed boxes (about 2 per image of 256 slots) that leaves the
    # arithmetic of one SLOTS-wide chunk per tile instead of every slot. B and M are not specialised on
    # (do_not_specialize): one compiled kernel serves every shape, which _launch relies on.
    @triton.jit(do_not_specialize=["B", "M"])
    def _giou_loss_forward_kernel(
        pred_ptr,  # [B, M, 4] predicted boxes xyxy, contiguous; fp32, bf16, fp16 or fp64
        target_ptr,  # [B, M, 4] target boxes xyxy, contiguous; any integer or floating dtype
        counts_ptr,  # [B] integer: slots j < counts[b] of image b are valid, the others are never read
        work_ptr,  # [3] fp64, zero on entry: loss sum, valid boxes, programs finished (one zero-fill)
        loss_ptr,  # [] out: the mean loss, in the compute dtype (fp32, or fp64 for fp64 predictions)
        inv_count_ptr,  # [] out: 1 / max(n_valid, 1), in the compute dtype, for the backward kernel
        B,  # number of images
        M,  # slots per image
        EPS: tl.constexpr,  # added to the union and enclosing-area denominators
        IMAGES: tl.constexpr,  # images per tile (autotuned)
        SLOTS: tl.constexpr,  # slots per tile and step, a power of two (autotuned)
    ):
        # A persistent grid: P programs (a few per SM) stride over the image tiles, so there are only P
        # atomic adds of each sum.
        compute_dtype = loss_ptr.dtype.element_ty
        pid, num_programs = tl.program_id(0), tl.num_programs(0)
        loss_sum = tl.full((IMAGES * SLOTS,), 0, compute_dtype)
        n_valid = tl.full((IMAGES,), 0, tl.int32)
        for first_image in range(pid * IMAGES, B, num_programs * IMAGES):
            counts = _tile_counts(counts_ptr, first_image, B, M, IMAGES)
            n_valid += counts
            for j0 in range(0, tl.reduce(counts, 0, _maximum), SLOTS):  # the steps that hold a valid slot
                box, _, valid = _tile_slots(counts_ptr, first_image, j0, B, M, IMAGES, SLOTS)
                x1, y1, x2, y2 = _load_boxes(pred_ptr, box, valid, compute_dtype, IMAGES * SLOTS)
                gx1, gy1, gx2, gy2 = _load_boxes(target_ptr, box, valid, compute_dtype, IMAGES * SLOTS)
                _, _, _, inter, union, cw, ch = _overlap(x1, y1, x2, y2, gx1, gy1, gx2, gy2)
                loss = 1.0 - inter / (union + EPS) + (cw * ch - union) / (cw * ch + EPS)
                loss_sum += tl.where(valid, loss, 0.0)

        # One atomic add per sum and program, in fp64 (exact counts; the loss's last bits depend on the
        # programs' order only rarely). The atomics are acq_rel: the program that finishes last sees every
        # sum, and writes the mean; nothing waits for the host, and there is no second launch.
        tl.atomic_add(work_ptr, tl.reduce(loss_sum, 0, _add).to(tl.float64))
        tl.atomic_add(work_ptr + 1, tl.reduce(n_valid, 0, _add).to(tl.float64))
        if tl.atomic_add(work_ptr + 2, 1.0) == num_programs - 1:
            total = tl.atomic_add(work_ptr, 0.0)  # atomic reads: through L2, after every program's add
            inv_count = 1.0 / tl.maximum(tl.atomic_add(work_ptr + 1, 0.0), 1.0)
            tl.store(loss_ptr, (total * inv_count).to(compute_dtype))
            tl.store(inv_count_ptr, inv_count.to(compute_dtype))

    @triton.jit(do_not_specialize=["B", "M"])
    def _giou_loss_backward_kernel(
        pred_ptr,  # [B, M, 4] predicted boxes xyxy, contiguous, as in forward
        target_ptr,  # [B, M, 4] target boxes xyxy, contiguous, as in forward
        counts_ptr,  # [B] integer counts, as in forward; padded slots are never read
        grad_output_ptr,  # [] d out / d loss (autograd's grad_output), any floating dtype
        inv_count_ptr,  # [] 1 / max(n_valid, 1) from the forward kernel, in the compute dtype
        grad_ptr,  # [B, M, 4] out, like pred: d out / d pred, every slot written, exactly 0 in padded ones
        B,  # number of images
        M,  # slots per image
        EPS: tl.constexpr,  # added to the union and enclosing-area denominators
        IMAGES: tl.constexpr,  # images per tile (autotuned)
        SLOTS: tl.constexpr,  # slots per tile, a power of two (autotuned)
    ):
        # One program per tile: the slot steps of a tile of images (M / SLOTS of them) run side by side.
        compute_dtype = inv_count_ptr.dtype.element_ty
        steps = (M + SLOTS - 1) // SLOTS
        first_image, j0 = tl.program_id(0) // steps * IMAGES, tl.program_id(0) % steps * SLOTS
        box, in_range, valid = _tile_slots(counts_ptr, first_image, j0, B, M, IMAGES, SLOTS)
        zero = tl.full((IMAGES * SLOTS,), 0, compute_dtype)
        dx1, dy1, dx2, dy2 = zero, zero, zero, zero
        if j0 < tl.reduce(_tile_counts(counts_ptr, first_image, B, M, IMAGES), 0, _maximum):
            scale = tl.load(grad_output_ptr).to(compute_dtype) * tl.load(inv_count_ptr)  # d out / d (a box's loss)
            x1, y1, x2, y2 = _load_boxes(pred_ptr, box, valid, compute_dtype, IMAGES * SLOTS)
            gx1, gy1, gx2, gy2 = _load_boxes(target_ptr, box, valid, compute_dtype, IMAGES * SLOTS)
            dx1, dy1, dx2, dy2 = _giou_grad(x1, y1, x2, y2, gx1, gy1, gx2, gy2, scale, EPS)
            dx1, dy1 = tl.where(valid, dx1, 0.0), tl.where(valid, dy1, 0.0)
            dx2, dy2 = tl.where(valid, dx2, 0.0), tl.where(valid, dy2, 0.0)
        _store_boxes(grad_ptr, box, in_range, dx1, dy1, dx2, dy2, IMAGES * SLOTS)

    # IMAGES * SLOTS / (32 * num_warps) slots per thread: 4 to 8 keeps the ~40 live values per box in
    # registers. Few images per tile make a crowded image cost less; wide steps suit crowded images.
    # Benchmarking in the interpreter would time numpy, so it gets one config with a few images per tile
    # (batches of the tests then span several tiles and both programs of its persistent grid).
    _CONFIGS = [
        triton.Config({"IMAGES": 64, "SLOTS": 16}, num_warps=4),
        triton.Config({"IMAGES": 32, "SLOTS": 32}, num_warps=4),
        triton.Config({"IMAGES": 16, "SLOTS": 32}, num_warps=4),
        triton.Config({"IMAGES": 8, "SLOTS": 128}, num_warps=8),
    ]
    _INTERPRETER_CONFIGS = [triton.Config({"IMAGES": 8, "SLOTS": 32})]
    # The kernels run for microseconds: 20 ms of repetitions per config are thousands of runs, and a new
    # M costs ~0.2 s of autotuning instead of the default 125 ms x 4 configs x 2 kernels.
    _bench = functools.partial(triton.testing.do_bench, warmup=5, rep=20)
    _autotune = functools.partial(
        triton.autotune, configs=_INTERPRETER_CONFIGS if INTERPRETED else _CONFIGS, key=["M"], do_bench=_bench
    )
    # autotuning reruns the forward kernel, whose sums accumulate atomically
    _giou_loss_forward_kernel = _autotune(reset_to_zero=["work_ptr"])(_giou_loss_forward_kernel)
    _giou_loss_backward_kernel = _autotune()(_giou_loss_backward_kernel)


# ----------------------------------------------------------------------------- host launchers


@functools.cache
def _max_programs(device: torch.device) -> int:
    if INTERPRETED or device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b  # not triton.cdiv: a constexpr_function (triton 3.6, 3.9), ~2 us a call on the host


def _forward_grid(batch: int, device: torch.device):
    """The forward kernel's persistent grid: a program per tile of images, at most a few per SM."""
    return lambda meta: (min(_cdiv(batch, meta["IMAGES"]), _max_programs(device)),)


def _backward_grid(batch: int, max_boxes: int):
    """The backward kernel's grid: a program per tile of IMAGES images x SLOTS slots."""
    return lambda meta: (_cdiv(batch, meta["IMAGES"]) * _cdiv(max_boxes, meta["SLOTS"]),)


TUNED = ("IMAGES", "SLOTS")  # the autotuned constexprs, last in both kernels' arguments
# (kernel, device, M, dtype and 16-byte alignment of each tensor argument) -> (CompiledKernel, config,
# the constexpr arguments EPS and TUNED's values)
_COMPILED: dict[tuple, tuple] = {}


def _launch(kernel, grid, *args) -> None:
    """Eager launch of an autotuned kernel on ``grid`` (a function of its config); ``args`` are tensors, then B, M.

    Triton's own launch (Autotuner.run, then JITFunction.run: argument binding, a specialisation key,
    cache look-ups, launch hooks, all in Python) costs tens of microseconds per call. Here the first call
    per key goes through it (autotuning once per M, compiling once per specialisation) and keeps the
    CompiledKernel it returns; later calls hand their arguments to its launcher directly, as inductor's
    generated launchers do, without Triton's launch hooks (its own profiler; torch.profiler still sees the
    kernels). The kernels do not specialise on B and M, so besides M (which picks the autotuned config)
    the key holds what Triton specialises on: each tensor's dtype and 16-byte alignment, and the device.
    """
    if INTERPRETED:  # numpy on the host: no launch cost worth caching
        kernel[grid](*args, EPS=EPS)
        return
    device = args[0].get_device()
    if device != torch.cuda.current_device():  # Triton launches on the current device
        with torch.cuda.device(device):
            return _launch(kernel, grid, *args)
    key = (kernel, device, args[-1], *[(t.dtype, t.data_ptr() % 16 == 0) for t in args[:-2]])
    cached = _COMPILED.get(key)
    if cached is None:
        compiled = kernel[grid](*args, EPS=EPS)  # autotunes (once per M), compiles and launches
        config = kernel.best_config.kwargs
        _COMPILED[key] = compiled, config, (EPS, *[config[name] for name in TUNED])
        return
    compiled, config, constexprs = cached
    stream = triton.runtime.driver.active.get_current_stream(device)
    # the launcher's arguments: grid, stream, kernel, its metadata, launch metadata and hooks, every argument
    compiled.run(
        grid(config)[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *constexprs
    )


def _forward_outputs(pred: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """(mean loss, inv_count) [] in the compute dtype, and the forward kernel's zeroed accumulators. With
    no slot there is nothing to launch: the loss is already 0 and inv_count 1, and there is no work."""
    compute_dtype = torch.promote_types(pred.dtype, torch.float32)  # fp32, or fp64 for fp64 predictions
    if not pred.numel():
        return pred.new_zeros((), dtype=compute_dtype), pred.new_ones((), dtype=compute_dtype), None
    loss = pred.new_empty((), dtype=compute_dtype)
    return loss, torch.empty_like(loss), pred.new_zeros(3, dtype=torch.float64)


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


# ----------------------------------------------------------------------------- the autograd Function and the ops


class _GiouLossTriton(torch.autograd.Function):
    """Eager mode: the kernels launched from autograd directly, with no torch.library dispatch on the way."""

    @staticmethod
    def forward(ctx, pred: Tensor, boxes: Tensor, counts: Tensor) -> Tensor:
        pred, boxes, counts = pred.contiguous(), boxes.contiguous(), counts.contiguous()
        loss, inv_count, work = _forward_outputs(pred)
        if pred.numel():
            batch, max_boxes = pred.shape[:2]
            grid = _forward_grid(batch, pred.device)
            _launch(_giou_loss_forward_kernel, grid, pred, boxes, counts, work, loss, inv_count, batch, max_boxes)
        ctx.save_for_backward(pred, boxes, counts, inv_count)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None]:
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradient has no graph to differentiate
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        pred, boxes, counts, inv_count = ctx.saved_tensors
        grad = torch.empty_like(pred)
        if pred.numel():
            batch, max_boxes = pred.shape[:2]
            grid = _backward_grid(batch, max_boxes)
            _launch(_giou_loss_backward_kernel, grid, pred, boxes, counts, grad_loss, inv_count, grad, batch, max_boxes)
        return grad, None, None


if triton is not None:
    # A triton_op shows its kernel to torch.compile, which traces the launch with fake tensors. The
    # interpreter would read their (absent) memory, so there the ops are opaque: custom_ops with fakes.
    _define_op = torch.library.custom_op if INTERPRETED else torch.library.triton_op

    @_define_op("detector::giou_loss_triton", mutates_args=())
    def _giou_loss_triton_op(pred: Tensor, boxes: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """(mean loss, inv_count): the forward kernel, for torch.compile (eager runs _GiouLossTriton)."""
        pred, boxes, counts = pred.contiguous(), boxes.contiguous(), counts.contiguous()
        loss, inv_count, work = _forward_outputs(pred)
        if pred.numel():
            batch, max_boxes = pred.shape[:2]
            wrap_triton(_giou_loss_forward_kernel)[_forward_grid(batch, pred.device)](
                pred, boxes, counts, work, loss, inv_count, batch, max_boxes, EPS=EPS
            )
        return loss, inv_count

    @_define_op("detector::giou_loss_triton_backward", mutates_args=())
    def _giou_loss_triton_backward_op(
        grad_loss: Tensor, pred: Tensor, boxes: Tensor, counts: Tensor, inv_count: Tensor
    ) -> Tensor:
        """d out / d pred: the backward kernel, for torch.compile."""
        pred, boxes, counts = pred.contiguous(), boxes.contiguous(), counts.contiguous()
        grad = torch.empty_like(pred)
        if pred.numel():
            batch, max_boxes = pred.shape[:2]
            wrap_triton(_giou_loss_backward_kernel)[_backward_grid(batch, max_boxes)](
                pred, boxes, counts, grad_loss, inv_count, grad, batch, max_boxes, EPS=EPS
            )
        return grad

    if INTERPRETED:

        @_giou_loss_triton_op.register_fake
        def _giou_loss_triton_fake(pred: Tensor, boxes: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
            loss = pred.new_empty((), dtype=torch.promote_types(pred.dtype, torch.float32))
            return loss, torch.empty_like(loss)

        @_giou_loss_triton_backward_op.register_fake
        def _giou_loss_triton_backward_fake(grad_loss, pred, boxes, counts, inv_count) -> Tensor:
            return torch.empty_like(pred, memory_format=torch.contiguous_format)

    def _setup_context(ctx, inputs, output):
        pred, boxes, counts = inputs
        ctx.save_for_backward(pred, boxes, counts, output[1])

    def _backward(ctx, grad_loss, _grad_inv_count):
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradient has no graph to differentiate
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        return torch.ops.detector.giou_loss_triton_backward.default(grad_loss, *ctx.saved_tensors), None, None

    _giou_loss_triton_op.register_autograd(_backward, setup_context=_setup_context)


def giou_loss_triton(pred: Tensor, boxes: Tensor, counts: Tensor) -> Tensor:
    """Mean GIoU loss (the contract of ``giou_loss_reference``) over padded targets, by the Triton kernels.

    pred [B, M, 4] (fp32/bf16/fp16/fp64), boxes [B, M, 4] (integer or floating), counts [B] integer,
    all on one device, as ``detector.losses.checks.check_padded`` verifies. Counts outside [0, M] count
    as clamped to [0, M]: the kernels never read them on the host. Eager calls go straight to the
    kernels; under torch.compile the call is the triton_op, which the compiler traces into.
    """
    if pred.numel() >= MAX_ELEMENTS:
        raise ValueError(f"pred has {pred.numel()} elements; the Triton kernels index with int32 (< 2**31)")
    reason = triton_unavailable(pred.device)
    if reason:
        raise RuntimeError(f"giou_loss_triton cannot run on pred's device {pred.device}: {reason}")
    if torch.compiler.is_compiling():
        return torch.ops.detector.giou_loss_triton.default(pred, boxes, counts)[0]
    return _GiouLossTriton.apply(pred, boxes, counts)
