"""The detector::giou_loss custom ops beyond the strategy grid (tests/test_strategies.py runs the
cuda_fused, cuda_conditional and packed strategies against the reference on CPU and CUDA).

Here: torch.library.opcheck, the dtypes, strides, alignments and counts the grid does not draw, ties,
what backward saves, bad input, the nvcc compile-only check of the kernels, and on a GPU the CUDA kernels
against the CPU kernel at sizes where grid-stride loops, 16-byte chunks and the packed prefix sums (each
block's own scan and the block sums) matter, torch.compile and CUDA graphs.
"""

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_dtype_table import COUNTS_DTYPES, PRED_DTYPES, TARGET_DTYPES  # the one dtype table

from detector.data import make_targets
from detector.data.targets import PackedTargets, PaddedTargets
from detector.kernels import cuda_op as ops
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES, giou_loss_reference

pytestmark = pytest.mark.skipif(ops.kernel_unavailable(torch.device("cpu")) is not None, reason=ops.BUILD_HINT)

HAS_CUDA = torch.cuda.is_available() and ops.kernel_unavailable(torch.device("cuda")) is None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device, or detector._C built without CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
EXTENSIONS = Path(__file__).resolve().parents[2] / "extensions"

# Gradient tolerance by pred dtype: fp32 compute against the fp64 reference, then one rounding to the
# stored dtype (bf16 keeps 8 bits, fp16 11).
# fp64 computes in fp64: only the order of operations differs from the reference's autograd.
GRAD_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# Loss tolerance: fp32 rounding, or fp64 rounding with a different summation order.
LOSS_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


def padded_case(batch, slots, distribution, pred_dtype=torch.float32, target_dtype=torch.uint8, seed=0, nan=True):
    pred, boxes_list = random_case(batch, slots, distribution, pred_dtype, target_dtype, seed=seed, nan_padding=nan)
    boxes, counts = make_targets(boxes_list, "padded", slots)
    return pred, boxes, counts


def packed_targets(boxes, counts):
    """Padded [B, M, 4] boxes as packed [N, 4] rows, image after image."""
    valid = torch.arange(boxes.shape[1], device=boxes.device) < counts[:, None]
    return boxes[valid]


def reference(pred, boxes, counts):
    """(loss, gradient) of the fp64 reference on the CPU, for padded boxes."""
    ref_pred = pred.detach().cpu().double().requires_grad_()
    loss = giou_loss_reference(ref_pred, boxes.cpu(), counts.cpu().long())
    loss.backward()
    return loss.detach(), ref_pred.grad


def loss_and_grad(fn, pred, *args):
    p = pred.detach().clone().requires_grad_()
    loss = fn(p, *args)
    loss.backward()
    return loss.detach(), p.grad


def assert_close_to(loss, grad, ref_loss, ref_grad, pred_dtype, atol=1e-12):
    loss_dtype = torch.promote_types(pred_dtype, torch.float32)  # the compute dtype
    assert loss.dtype == loss_dtype and loss.dim() == 0 and grad.dtype == pred_dtype
    loss_rtol = LOSS_RTOL[pred_dtype]
    torch.testing.assert_close(loss.double().cpu(), ref_loss.double().cpu(), rtol=loss_rtol, atol=loss_rtol / 10)
    rtol = GRAD_RTOL[pred_dtype]
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad.double().cpu(), ref_grad.double().cpu(), rtol=rtol, atol=rtol * scale + atol)


def strided(pred, boxes, counts):
    """Non-contiguous copies: pred with stride(0) == 4, boxes with a coordinate stride of 2, counts with
    a stride of 2, and the packed rows [N, 4] with strides (1, N)."""
    pred_t = pred.transpose(0, 1).contiguous().transpose(0, 1)
    boxes_s = torch.stack([boxes, boxes], dim=-1).flatten(-2)[..., ::2]
    counts_s = torch.stack([counts, counts], dim=-1).flatten()[::2]
    rows = packed_targets(boxes, counts).t().contiguous().t()
    assert not any(t.is_contiguous() for t in (pred_t, boxes_s, counts_s, rows))
    return pred_t, boxes_s, counts_s, rows


def padded_op(skip_invalid):
    return lambda p, b, c: ops.giou_loss(p, b, c, skip_invalid)


def packed_op(block_scan_max_batch):
    return lambda p, t, c: ops.giou_loss_packed(p, t, c, block_scan_max_batch)


def misaligned(t, elements):
    """t's values in a contiguous tensor whose data starts ``elements`` elements into its storage: not
    16-byte aligned, so the kernels take their box-by-box path."""
    storage = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = storage[elements:].view(t.shape)
    view.copy_(t)
    return view


# ----------------------------------------------------------------------------- opcheck


def sample_inputs(device="cpu"):
    """(op, args) pairs over dtypes, strides and counts; no NaN, so that opcheck's mutation check holds."""
    rows = [
        (torch.float32, torch.uint8, torch.int64, 7, 13, "seed"),
        (torch.bfloat16, torch.uint8, torch.int32, 5, 16, "one_full"),
        (torch.float16, torch.float32, torch.int64, 3, 8, "zero"),
        (torch.float32, torch.int16, torch.int32, 4, 6, "full"),
        (torch.float64, torch.int64, torch.uint8, 5, 7, "seed"),  # fp64 loss and inv_count
        (torch.float64, torch.float64, torch.int8, 3, 5, "full"),
        (torch.float16, torch.int8, torch.int16, 4, 6, "seed"),
    ]
    for pred_dtype, target_dtype, counts_dtype, batch, slots, distribution in rows:
        pred, boxes, counts = padded_case(batch, slots, distribution, pred_dtype, target_dtype, nan=False)
        pred, boxes, counts = pred.to(device).requires_grad_(), boxes.to(device), counts.to(device, counts_dtype)
        for skip_invalid in (False, True):
            yield torch.ops.detector.giou_loss.default, (pred, boxes, counts, skip_invalid)
        yield torch.ops.detector.giou_loss_packed.default, (pred, packed_targets(boxes, counts), counts)
    # non-contiguous (views made on the device: .to() copies a strided tensor contiguous)
    pred, boxes, counts = padded_case(6, 9, "seed", torch.float32, torch.float32, nan=False)
    pred_t, boxes_s, counts_s, rows = strided(pred.to(device), boxes.to(device), counts.to(device))
    yield torch.ops.detector.giou_loss.default, (pred_t.requires_grad_(), boxes_s, counts_s, False)
    yield torch.ops.detector.giou_loss_packed.default, (pred_t, rows, counts_s)
    yield torch.ops.detector.giou_loss_packed.default, (pred_t, rows, counts_s, 0)  # the block sums on CUDA
    # the backward ops on their own
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        pred, boxes, counts = padded_case(6, 9, "seed", dtype, torch.uint8, nan=False)
        pred, boxes, counts = pred.to(device), boxes.to(device), counts.to(device)
        scalar = torch.promote_types(dtype, torch.float32)
        two, quarter = torch.tensor(2.0, device=device, dtype=scalar), torch.tensor(0.25, device=device, dtype=scalar)
        yield torch.ops.detector.giou_loss_backward.default, (two, pred, boxes, counts, quarter)
        rows, offsets = packed_targets(boxes, counts), counts.cumsum(0)
        yield torch.ops.detector.giou_loss_packed_backward.default, (two, pred, rows, offsets, quarter)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in sample_inputs(device):
        torch.library.opcheck(op, args)


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pred_dtype", PRED_DTYPES, ids=str)
@pytest.mark.parametrize("target_dtype", TARGET_DTYPES, ids=str)
def test_every_dtype_pair_matches_the_reference(device, pred_dtype, target_dtype):
    """Every (pred, target) dtype pair of the table, counts of every integer dtype, all three op variants."""
    pred, boxes, counts = padded_case(9, 13, "tail", pred_dtype, target_dtype, seed=5)
    ref_loss, ref_grad = reference(pred, boxes, counts)
    for counts_dtype in COUNTS_DTYPES:
        args = (pred.to(device), boxes.to(device), counts.to(device, counts_dtype))
        for skip_invalid in (False, True):
            assert_close_to(*loss_and_grad(padded_op(skip_invalid), *args), ref_loss, ref_grad, pred_dtype)
        packed = (args[0], packed_targets(*args[1:]), args[2])
        assert_close_to(*loss_and_grad(ops.giou_loss_packed, *packed), ref_loss, ref_grad, pred_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pred_dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(device, pred_dtype):
    pred, boxes, counts = padded_case(8, 11, "one_full", pred_dtype, torch.float32, seed=2)
    ref_loss, ref_grad = reference(pred, boxes, counts)
    pred_t, boxes_s, counts_s, rows = strided(pred.to(device), boxes.to(device), counts.to(device))
    for skip_invalid in (False, True):
        got = loss_and_grad(padded_op(skip_invalid), pred_t, boxes_s, counts_s)
        assert_close_to(*got, ref_loss, ref_grad, pred_dtype)
    assert_close_to(*loss_and_grad(ops.giou_loss_packed, pred_t, rows, counts_s), ref_loss, ref_grad, pred_dtype)


# Analytic geometry; the gradient of each is checked against PyTorch autograd of the reference, ties
# included (integer coordinates make max/min ties: autograd gives half to each side).
ANALYTIC = [
    ([0, 0, 1, 1], [1, 1, 2, 2], 1.5),  # diagonally adjacent unit boxes: GIoU = 0 - (4 - 2) / 4 = -0.5
    ([0, 0, 2, 2], [0, 0, 2, 2], 0.0),  # identical boxes, every coordinate a tie: GIoU = 1, gradient 0
    ([0, 0, 2, 2], [1, 0, 3, 2], 1 - 2 / 6),  # half overlap sharing y edges: iou = 2 / 6, no enclosing gap
    ([0, 0, 4, 4], [1, 1, 3, 3], 0.75),  # target inside pred: iou = 4 / 16
    ([0, 0, 4, 4], [0, 1, 2, 3], 0.75),  # inside, sharing the x1 edge: a tie in both max(x1) and min(x1)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pred_box,target_box,expected", ANALYTIC)
def test_analytic_cases_and_ties(device, pred_box, target_box, expected):
    pred = torch.tensor([[pred_box, [float("nan")] * 4]], dtype=torch.float32)  # [1, 2, 4], slot 1 padding
    boxes = torch.tensor([[target_box, [7, 7, 9, 9]]], dtype=torch.uint8)
    counts = torch.tensor([1])
    ref_loss, ref_grad = reference(pred, boxes, counts)
    assert ref_loss.item() == pytest.approx(expected, abs=1e-6)
    args = (pred.to(device), boxes.to(device), counts.to(device))
    # atol 1e-7: the fp64 reference keeps eps-sized terms (1e-7 / area) that fp32 rounds away
    for skip_invalid in (False, True):
        got = loss_and_grad(padded_op(skip_invalid), *args)
        assert_close_to(*got, ref_loss, ref_grad, torch.float32, atol=1e-7)
    got = loss_and_grad(ops.giou_loss_packed, args[0], boxes[0, :1].to(device), args[2])
    assert_close_to(*got, ref_loss, ref_grad, torch.float32, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_output_scales_the_gradient(device):
    pred, boxes, counts = padded_case(5, 8, "seed", seed=4)
    ref_loss, ref_grad = reference(pred, boxes, counts)
    args = (boxes.to(device), counts.to(device))
    for loss_fn, target in ((ops.giou_loss, args[0]), (ops.giou_loss_packed, packed_targets(*args))):
        p = pred.to(device).clone().requires_grad_()
        loss = loss_fn(p, target, args[1])
        (3.0 * loss).backward()
        assert_close_to(loss.detach(), p.grad / 3, ref_loss, ref_grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pred_dtype,elements", [(torch.bfloat16, 4), (torch.bfloat16, 1), (torch.float32, 2)])
def test_misaligned_inputs(device, pred_dtype, elements):
    """Contiguous but not 16-byte aligned (a view into a storage): the box-by-box path, same values."""
    pred, boxes, counts = padded_case(7, 13, "tail", pred_dtype, torch.uint8, seed=6)
    ref_loss, ref_grad = reference(pred, boxes, counts)
    pred_m, boxes_m = misaligned(pred.to(device), elements), misaligned(boxes.to(device), elements)
    rows_m = misaligned(packed_targets(boxes, counts).to(device), elements)
    args = (pred_m, boxes_m, counts.to(device))
    for skip_invalid in (False, True):
        assert_close_to(*loss_and_grad(padded_op(skip_invalid), *args), ref_loss, ref_grad, pred_dtype)
    assert_close_to(*loss_and_grad(ops.giou_loss_packed, pred_m, rows_m, args[2]), ref_loss, ref_grad, pred_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_saves_the_inputs_by_reference(device):
    """Saved for backward: pred, target and counts themselves (no copies, no gradient buffer; packed: the
    forward's offsets, the prefix sums of the counts, in place of the counts) and the 0-dim inv_count; the
    backward op's gradient is contiguous even for strided pred, as its fake says."""
    pred, boxes, counts = padded_case(6, 9, "seed", nan=False)
    pred_t, boxes_s, counts_s, rows = strided(pred.to(device), boxes.to(device), counts.to(device))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    for loss_fn, target in ((ops.giou_loss, boxes_s), (ops.giou_loss_packed, rows)):
        saved.clear()
        p = pred_t.detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(p, target, counts_s)
        assert [t.data_ptr() for t in saved[:2]] == [p.data_ptr(), target.data_ptr()]
        if loss_fn is ops.giou_loss:
            assert saved[2].data_ptr() == counts_s.data_ptr()
        else:
            assert saved[2].dtype == torch.int64 and saved[2].tolist() == counts.cumsum(0).tolist()
        assert len(saved) == 4 and saved[3].dim() == 0 and saved[3].item() == pytest.approx(1 / counts.sum().item())
    one = torch.tensor(1.0, device=device)
    for backward, target, counts_or_offsets in (
        (torch.ops.detector.giou_loss_backward, boxes_s, counts_s),
        (torch.ops.detector.giou_loss_packed_backward, rows, counts_s.cumsum(0).repeat_interleave(2)[::2]),  # strided
    ):
        grad = backward(one, pred_t, target, counts_or_offsets, one)
        assert grad.is_contiguous() and grad.shape == pred_t.shape


@pytest.mark.parametrize("device", DEVICES)
def test_packed_forward_returns_the_prefix_sums_of_the_clamped_counts(device):
    """The packed forward's third output, which its backward takes: C[b + 1] of the clamped counts, int64,
    on both prefix-sum paths of the CUDA kernel (every block's own scan, the block sums)."""
    pred, boxes, counts = padded_case(5, 8, "full", seed=4)
    bad = torch.tensor([3, -2, 11, 0, 5], dtype=torch.int16)  # clamped to [3, 0, 8, 0, 5]
    rows = packed_targets(boxes, torch.tensor([3, 0, 8, 0, 5])).to(device)
    for scan in (0, 2048):
        *_, offsets = torch.ops.detector.giou_loss_packed(pred.to(device), rows, bad.to(device), scan)
        assert offsets.dtype == torch.int64 and offsets.device == rows.device
        assert offsets.tolist() == [3, 3, 11, 11, 16]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_backward_clamps_any_offsets(device):
    """Offsets handed to the backward op are clamped as counts are (an image's rows within [0, N), at most
    M of them): garbage never reads or writes out of bounds, and gives the gradient of the clamped rows."""
    pred, boxes, counts = padded_case(4, 6, "full", seed=5)
    rows = packed_targets(boxes, counts)[:10].to(device)  # 24 boxes counted, 10 rows
    pred = pred.to(device)
    one = torch.tensor(1.0, device=device)
    backward = torch.ops.detector.giou_loss_packed_backward
    # image 0: rows [0, 4); image 1: from row 4, 100 - 4 > M = 6 and > the 6 rows left -> rows [4, 10);
    # image 2: from row 100 -> the end (10), -5 - 10 < 0 -> none; image 3: from row -5 -> 0, 2 - 0 -> rows [0, 2)
    garbage = torch.tensor([4, 100, -5, 2], device=device)
    got = backward(one, pred, rows, garbage, one)
    want = torch.zeros_like(pred)
    for b, (first, present) in enumerate([(0, 4), (4, 6), (10, 0), (0, 2)]):
        if present:
            one_image = torch.tensor([present], device=device)
            want[b] = backward(one, pred[b : b + 1], rows[first : first + present], one_image, one)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------- counts out of range


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_counts_are_clamped(device):
    """The lab's rule, on every device: counts clamped to [0, M]; packed rows past their sum ignored."""
    pred, boxes, counts = padded_case(3, 8, "full", seed=3)
    pred, boxes = pred.to(device), boxes.to(device)
    bad, clamped = torch.tensor([-2, 11, 5], device=device), torch.tensor([0, 8, 5], device=device)
    for skip_invalid in (False, True):
        got = loss_and_grad(padded_op(skip_invalid), pred, boxes, bad)
        want = loss_and_grad(padded_op(skip_invalid), pred, boxes, clamped)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    rows = packed_targets(boxes, clamped)  # 13 rows; counts [-2, 11, 5] clamp to [0, 8, 5]
    want = loss_and_grad(ops.giou_loss_packed, pred, rows, clamped)
    torch.testing.assert_close(loss_and_grad(ops.giou_loss_packed, pred, rows, bad), want, rtol=0, atol=0)
    extra = torch.cat([rows, rows[:4]])  # 4 rows past the counts' sum: ignored
    torch.testing.assert_close(loss_and_grad(ops.giou_loss_packed, pred, extra, bad), want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_rows_fewer_than_the_counts_sum(device):
    """N < sum of the clamped counts: the boxes past row N are absent (never read), as if counted out."""
    pred, boxes, counts = padded_case(3, 8, "full", seed=3)
    pred, boxes = pred.to(device), boxes.to(device)
    counts = torch.tensor([2, 8, 5], device=device)  # 15 boxes, but only 12 rows: image 2 keeps 2 of its 5
    rows = packed_targets(boxes, counts)[:12]
    want = loss_and_grad(ops.giou_loss_packed, pred, rows, torch.tensor([2, 8, 2], device=device))
    got = loss_and_grad(ops.giou_loss_packed, pred, rows, counts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref_loss, ref_grad = reference(pred, boxes, torch.tensor([2, 8, 2]))
    assert_close_to(*got, ref_loss, ref_grad, torch.float32)


# ----------------------------------------------------------------------------- bad input


def bad_input(kind):
    """(error, argument named in the message, op, args) for one kind of bad input."""
    pred, boxes, counts = padded_case(2, 8, "seed", nan=False)
    padded, packed, backward = (
        torch.ops.detector.giou_loss,
        torch.ops.detector.giou_loss_packed,
        torch.ops.detector.giou_loss_backward,
    )
    backward_packed = torch.ops.detector.giou_loss_packed_backward
    one, rows, offsets = torch.tensor(1.0), packed_targets(boxes, counts), counts.cumsum(0)
    return {
        "pred_rank": (RuntimeError, "pred", padded, (pred.flatten(0, 1), boxes, counts)),
        "pred_last_dim": (RuntimeError, "pred", padded, (torch.zeros(2, 8, 5), boxes, counts)),
        "target_shape": (RuntimeError, "target", padded, (pred, boxes[:, :7], counts)),
        "packed_target_shape": (RuntimeError, "target", packed, (pred, torch.zeros(3, 5), counts)),
        "counts_batch": (RuntimeError, "counts", padded, (pred, boxes, counts[:1])),
        "counts_rank": (RuntimeError, "counts", padded, (pred, boxes, counts[:, None])),
        "pred_int": (TypeError, "pred", padded, (pred.int(), boxes, counts)),
        "target_bool": (TypeError, "target", padded, (pred, boxes.bool(), counts)),
        "counts_float": (TypeError, "counts", padded, (pred, boxes, counts.float())),
        "counts_bool": (TypeError, "counts", padded, (pred, boxes, counts.bool())),
        "grad_output_dtype": (
            TypeError,
            "grad_output",
            backward,
            (one.double(), pred, boxes, counts, one),
        ),  # fp32 pred
        "inv_count_dtype": (TypeError, "inv_count", backward, (one.double(), pred.double(), boxes, counts, one)),
        "inv_count_rank": (RuntimeError, "inv_count", backward, (one, pred, boxes, counts, torch.ones(1))),
        "backward_pred_shape": (RuntimeError, "pred", backward, (one, pred[:, :, :3], boxes, counts, one)),
        "backward_target_shape": (RuntimeError, "target", backward_packed, (one, pred, boxes, offsets, one)),
        "block_scan_negative": (RuntimeError, "block_scan_max_batch", packed, (pred, rows, counts, -1)),
        "backward_offsets_dtype": (TypeError, "offsets", backward_packed, (one, pred, rows, offsets.int(), one)),
        "backward_offsets_shape": (RuntimeError, "offsets", backward_packed, (one, pred, rows, offsets[:1], one)),
    }[kind]


BAD_INPUTS = [
    "pred_rank",
    "pred_last_dim",
    "target_shape",
    "packed_target_shape",
    "counts_batch",
    "counts_rank",
    "pred_int",
    "target_bool",
    "counts_float",
    "counts_bool",
    "grad_output_dtype",
    "inv_count_dtype",
    "inv_count_rank",
    "backward_pred_shape",
    "backward_target_shape",
    "block_scan_negative",
    "backward_offsets_dtype",
    "backward_offsets_shape",
]


# The bad inputs run in a child process: should a native error path crash (one did on a GPU machine,
# torch 2.11, CPU tensors), that fails these tests instead of killing the whole pytest session.
BAD_INPUT_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_cuda_op
for kind in sys.argv[2:]:
    print(json.dumps({"kind": kind}), flush=True)
    _, _, op, args = test_cuda_op.bad_input(kind)
    try:
        op(*args)
        outcome = {"kind": kind, "raised": None, "message": ""}
    except Exception as err:
        outcome = {"kind": kind, "raised": type(err).__name__, "message": str(err)}
    print(json.dumps(outcome), flush=True)
"""


@functools.cache
def bad_input_outcomes() -> dict:
    """kind -> what calling the op raised, or how the child process died; children restart after a crash."""
    outcomes, todo = {}, list(BAD_INPUTS)
    while todo:
        command = [sys.executable, "-c", BAD_INPUT_CHILD, str(Path(__file__).parent), *todo]
        child = subprocess.run(command, capture_output=True, text=True, timeout=300)
        started = None
        for line in child.stdout.splitlines():
            record = json.loads(line)
            started = None if "raised" in record else record["kind"]
            if "raised" in record:
                outcomes[record["kind"]] = record
        if child.returncode != 0:  # died inside `started`, or before the first kind (then all of them)
            for kind in [started] if started else todo:
                outcomes[kind] = {"kind": kind, "exit": child.returncode, "stderr": child.stderr[-3000:]}
        todo = [kind for kind in todo if kind not in outcomes]
    return outcomes


@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_inputs_name_the_argument(kind):
    error, name, _, _ = bad_input(kind)
    outcome = bad_input_outcomes()[kind]
    assert "exit" not in outcome, f"the op crashed (exit {outcome['exit']}) instead of raising:\n{outcome['stderr']}"
    assert outcome["raised"] == error.__name__, outcome
    assert name in outcome["message"], outcome


@needs_cuda
@pytest.mark.gpu
def test_inputs_on_different_devices():
    pred, boxes, counts = padded_case(2, 8, "seed", nan=False)
    with pytest.raises(RuntimeError, match="one device"):
        torch.ops.detector.giou_loss(pred.cuda(), boxes.cuda(), counts)
    with pytest.raises(RuntimeError, match="one device"):
        torch.ops.detector.giou_loss_packed(pred, packed_targets(boxes, counts).cuda(), counts)
    with pytest.raises(ValueError, match="one device"):
        STRATEGIES["cuda_fused"](pred.cuda(), PaddedTargets(boxes.cuda(), counts))


@pytest.mark.parametrize("kind", ["pred_rank", "pred_last_dim", "target_shape", "packed_target_shape", "counts_batch"])
def test_strategies_raise_python_errors_before_the_op(kind):
    # The public entry (Strategy.__call__) checks once, in Python, before any native code runs.
    _, name, op, (pred, boxes, counts) = bad_input(kind)
    packed = op is torch.ops.detector.giou_loss_packed
    strategy = STRATEGIES["packed" if packed else "cuda_fused"]
    targets = (PackedTargets if packed else PaddedTargets)(boxes, counts)
    with pytest.raises(ValueError, match=name):
        strategy(pred, targets)


def test_missing_extension_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(ops, "_C", None)
    assert ops.kernel_unavailable(torch.device("cpu")) == ops.BUILD_HINT
    with pytest.raises(RuntimeError, match="make setup"):
        ops.giou_loss(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, dtype=torch.long))


# ----------------------------------------------------------------------------- build


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    """The kernels have no torch headers: a plain nvcc builds them on a machine without a GPU."""
    command = ["nvcc", "-c", str(EXTENSIONS / "giou_kernels.cu"), "-o", str(tmp_path / "giou_kernels.o")]
    command += ["-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_compiles_fullgraph_on_cpu(layout):
    """Traceable end to end (fake kernels + autograd): aot_eager keeps it fast on the CPU."""
    pred, boxes, counts = padded_case(4, 8, "seed", seed=7)
    if layout == "packed":
        boxes = packed_targets(boxes, counts)

    def loss_fn(p, b, c):
        return (ops.giou_loss_packed(p, b, c, 0) if layout == "packed" else ops.giou_loss(p, b, c)) * 2

    got = loss_and_grad(torch.compile(loss_fn, fullgraph=True, backend="aot_eager"), pred, boxes, counts)
    torch.testing.assert_close(got, loss_and_grad(loss_fn, pred, boxes, counts))


# ----------------------------------------------------------------------------- GPU


def cuda_vs_cpu(fn, pred, target, counts):
    """The CUDA kernel against the CPU kernel of the same op (same fp32 maths, other summation order)."""
    want_loss, want_grad = loss_and_grad(fn, pred, target, counts)
    got_loss, got_grad = loss_and_grad(fn, pred.cuda(), target.cuda(), counts.cuda())
    torch.testing.assert_close(got_loss.cpu(), want_loss, rtol=1e-5, atol=1e-6)
    rtol = GRAD_RTOL[pred.dtype] if pred.dtype != torch.float32 else 1e-5
    scale = want_grad.abs().max().item() if want_grad.numel() else 0.0
    torch.testing.assert_close(got_grad.cpu().double(), want_grad.double(), rtol=rtol, atol=rtol * scale + 1e-12)
    padding = torch.arange(pred.shape[1]) >= counts.long()[:, None]
    assert torch.all(got_grad.cpu()[padding] == 0), "padded slots must get exactly zero gradient"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("pred_dtype", PRED_DTYPES, ids=str)
@pytest.mark.parametrize("target_dtype", TARGET_DTYPES, ids=str)
def test_cuda_every_dtype_matches_cpu(pred_dtype, target_dtype):
    pred, boxes, counts = padded_case(33, 37, "tail", pred_dtype, target_dtype, seed=11)
    for counts_dtype in COUNTS_DTYPES:
        c = counts.to(counts_dtype)
        cuda_vs_cpu(padded_op(False), pred, boxes, c)
        cuda_vs_cpu(padded_op(True), pred, boxes, c)
        cuda_vs_cpu(ops.giou_loss_packed, pred, packed_targets(boxes, c), c)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("pred_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "batch,slots,distribution",
    [
        (4096, 256, "seed"),  # more slots than resident threads: the grid-stride loop
        (2048, 256, "full"),  # 524k packed boxes: several chunks per thread, every chunk whole
        (700, 40, "tail"),  # empty images between full ones: the binary search over the prefix sums
        (1024, 13, "tail"),  # 4-slot chunks that cross into the next image
        (16384, 256, "seed"),  # the large batch: the block sums of the counts, 128 blocks
        (8192, 256, "full"),  # 2M packed rows: the block-sums grid sized by rows, a full wave
        (300_000, 4, "full"),  # more images than a wave's warps take in one run: two runs a warp
        (1, 4096, "full"),  # one image, many slots
        (0, 8, "zero"),  # no image at all
    ],
)
def test_cuda_large_and_odd_shapes_match_cpu(batch, slots, distribution, pred_dtype):
    pred, boxes, counts = padded_case(batch, slots, distribution, pred_dtype, seed=batch)
    cuda_vs_cpu(padded_op(False), pred, boxes, counts)
    cuda_vs_cpu(padded_op(True), pred, boxes, counts)
    cuda_vs_cpu(ops.giou_loss_packed, pred, packed_targets(boxes, counts), counts)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("pred_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_fused_forward_division_fallback(pred_dtype):
    """cuda_fused's forward divides by a reciprocal without nvcc's range check, and recomputes a lane's
    boxes with '/' when an operand leaves the range where that rounds correctly (ChunkDivide). Finite
    padding, so whole chunks take the reciprocal; every third image scaled by 2^-70 (areas below
    2^-60) and every third by 2^45 (areas above 2^60), so others take '/': the loss as the CPU's '/'."""
    pred, boxes, counts = padded_case(512, 256, "seed", torch.float64, torch.float64, seed=3, nan=False)
    scale = torch.tensor([1.0, 2.0**-70, 2.0**45], dtype=torch.float64).repeat(171)[:512, None, None]
    pred, boxes = (pred * scale).to(pred_dtype), (boxes * scale).float()
    cuda_vs_cpu(padded_op(False), pred, boxes, counts)
    cuda_vs_cpu(padded_op(True), pred, boxes, counts)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 700, 2048, 2049, 4096, 4097])
def test_cuda_packed_prefix_sums_both_ways(batch):
    """Every block's own scan of the counts and the block sums give the same loss and gradient, bit for bit
    (one kernel either way), on both sides of the default threshold (2048) and of the limit (4096)."""
    pred, boxes, counts = padded_case(batch, 16, "tail", torch.bfloat16, seed=batch)
    rows = packed_targets(boxes, counts)
    cuda_vs_cpu(ops.giou_loss_packed, pred, rows, counts)
    args = (pred.cuda(), rows.cuda(), counts.cuda())
    block_sums = loss_and_grad(packed_op(0), *args)
    for block_scan_max_batch in (2048, 4096):
        assert all(map(torch.equal, loss_and_grad(packed_op(block_scan_max_batch), *args), block_sums))


@needs_cuda
@pytest.mark.gpu
def test_cuda_is_deterministic():
    pred, boxes, counts = padded_case(1024, 256, "tail", seed=1)
    pred, boxes, counts = pred.cuda(), boxes.cuda(), counts.cuda()
    rows = packed_targets(boxes, counts)
    calls = [functools.partial(torch.ops.detector.giou_loss, pred, boxes, counts, skip) for skip in (False, True)]
    calls += [functools.partial(torch.ops.detector.giou_loss_packed, pred, rows, counts, scan) for scan in (0, 2048)]
    for call in calls:
        first = call()  # loss, inv_count
        for _ in range(3):
            assert all(map(torch.equal, first, call()))


LAYOUTS = ["padded", "packed", "packed_block_sums"]


def layout_case(layout, batch, slots, pred_dtype, seed):
    """(loss_fn, pred, target, counts) on CUDA; packed_block_sums: the block sums even at this small batch."""
    pred, boxes, counts = padded_case(batch, slots, "tail", pred_dtype, seed=seed)
    pred, boxes, counts = pred.cuda(), boxes.cuda(), counts.cuda()
    if layout == "padded":
        return ops.giou_loss, pred, boxes, counts
    return packed_op(0 if layout == "packed_block_sums" else 2048), pred, packed_targets(boxes, counts), counts


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_torch_compile_fullgraph(layout):
    loss_op, pred, target, counts = layout_case(layout, 64, 32, torch.bfloat16, seed=9)

    def loss_fn(p, b, c):
        return loss_op(p, b, c) * 2 + 1

    got = loss_and_grad(torch.compile(loss_fn, fullgraph=True), pred, target, counts)
    want = loss_and_grad(loss_fn, pred, target, counts)
    torch.testing.assert_close(got, want)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_capture_and_replay(layout):
    loss_fn, pred, target, counts = layout_case(layout, 256, 64, torch.float32, seed=8)
    pred.requires_grad_()

    def step():
        pred.grad = None
        loss = loss_fn(pred, target, counts)
        loss.backward()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graphs asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    new_pred = pred.detach() + torch.randn_like(pred)  # other values in the captured buffers
    with torch.no_grad():
        pred.copy_(new_pred)
    graph.replay()
    torch.cuda.synchronize()
    want_loss, want_grad = loss_and_grad(loss_fn, new_pred, target, counts)
    assert torch.equal(got, want_loss)  # deterministic kernels: replay equals eager bit for bit
    assert torch.equal(pred.grad, want_grad)
