"""The detector::giou_loss custom ops beyond the strategy grid (tests/test_strategies.py runs the
cuda_fused, cuda_conditional and packed strategies against the reference on CPU and CUDA).

Here: torch.library.opcheck, the dtypes, strides and counts the grid does not draw, ties, bad input,
the nvcc compile-only check of the kernels, and on a GPU the CUDA kernels against the CPU kernel at
sizes where grid-stride loops and the packed prefix sums matter, torch.compile and CUDA graphs.
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

from detector.bench.cases import random_case
from detector.data import make_targets
from detector.kernels import cuda_op as ops
from detector.losses import STRATEGIES, giou_loss_reference
from detector.targets import PackedTargets, PaddedTargets

pytestmark = pytest.mark.skipif(ops.kernel_unavailable(torch.device("cpu")) is not None, reason=ops.BUILD_HINT)

HAS_CUDA = torch.cuda.is_available() and ops.kernel_unavailable(torch.device("cuda")) is None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device, or detector._C built without CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
EXTENSIONS = Path(__file__).resolve().parents[2] / "extensions"

# Gradient tolerance by pred dtype: fp32 compute against the fp64 reference, then rounding to the
# stored dtype (bf16 keeps 8 bits, fp16 11; the saved gradient and its scaled copy are both rounded).
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
    for dtype in (torch.float32, torch.float64):
        grad_sum = torch.randn(6, 9, 4, device=device, dtype=dtype)
        two = torch.tensor(2.0, device=device, dtype=dtype)
        yield torch.ops.detector.giou_loss_backward.default, (two, grad_sum, grad_sum.sum())


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
def test_grad_output_scales_the_saved_gradient(device):
    pred, boxes, counts = padded_case(5, 8, "seed", seed=4)
    p = pred.to(device).requires_grad_()
    loss = ops.giou_loss(p, boxes.to(device), counts.to(device))
    (3.0 * loss).backward()
    ref_loss, ref_grad = reference(pred, boxes, counts)
    assert_close_to(loss.detach(), p.grad / 3, ref_loss, ref_grad, torch.float32)


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
    one, grad_sum = torch.tensor(1.0), torch.zeros(2, 8, 4)
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
        "grad_output_dtype": (TypeError, "grad_output", backward, (one.double(), grad_sum, one)),  # fp32 grad_sum
        "inv_count_dtype": (TypeError, "inv_count", backward, (one.double(), grad_sum.double(), one)),
        "inv_count_rank": (RuntimeError, "inv_count", backward, (one, grad_sum, torch.ones(1))),
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


def test_compiles_fullgraph_on_cpu():
    """Traceable end to end (fake kernels + autograd): aot_eager keeps it fast on the CPU."""
    pred, boxes, counts = padded_case(4, 8, "seed", seed=7)
    fn = torch.compile(lambda p, b, c: ops.giou_loss(p, b, c) * 2, fullgraph=True, backend="aot_eager")
    got = loss_and_grad(fn, pred, boxes, counts)
    want = loss_and_grad(lambda p, b, c: ops.giou_loss(p, b, c) * 2, pred, boxes, counts)
    torch.testing.assert_close(got, want)


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
@pytest.mark.parametrize(
    "batch,slots,distribution",
    [
        (4096, 256, "seed"),  # more slots than resident threads: the grid-stride loop
        (2048, 256, "full"),  # 524k packed boxes: several tiles per block
        (700, 40, "tail"),  # empty images between full ones: the binary search over the prefix sums
        (16384, 256, "seed"),  # the large batch where each packed block used to walk all B counts
        (1, 4096, "full"),  # one image, many slots
        (0, 8, "zero"),  # no image at all
    ],
)
def test_cuda_large_and_odd_shapes_match_cpu(batch, slots, distribution):
    pred, boxes, counts = padded_case(batch, slots, distribution, seed=batch)
    cuda_vs_cpu(padded_op(False), pred, boxes, counts)
    cuda_vs_cpu(padded_op(True), pred, boxes, counts)
    cuda_vs_cpu(ops.giou_loss_packed, pred, packed_targets(boxes, counts), counts)


@needs_cuda
@pytest.mark.gpu
def test_cuda_is_deterministic():
    pred, boxes, counts = padded_case(1024, 256, "tail", seed=1)
    pred, boxes, counts = pred.cuda(), boxes.cuda(), counts.cuda()
    first = torch.ops.detector.giou_loss(pred, boxes, counts)
    for _ in range(3):
        again = torch.ops.detector.giou_loss(pred, boxes, counts)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cuda_torch_compile_fullgraph(layout):
    pred, boxes, counts = padded_case(64, 32, "tail", torch.bfloat16, seed=9)
    pred, boxes, counts = pred.cuda(), boxes.cuda(), counts.cuda()
    if layout == "packed":
        boxes = packed_targets(boxes, counts)

    def loss_fn(p, b, c):
        loss = ops.giou_loss_packed(p, b, c) if layout == "packed" else ops.giou_loss(p, b, c)
        return loss * 2 + 1

    got = loss_and_grad(torch.compile(loss_fn, fullgraph=True), pred, boxes, counts)
    want = loss_and_grad(loss_fn, pred, boxes, counts)
    torch.testing.assert_close(got, want)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cuda_graph_capture_and_replay(layout):
    pred, boxes, counts = padded_case(256, 64, "tail", seed=8)
    pred, boxes, counts = pred.cuda().requires_grad_(), boxes.cuda(), counts.cuda()
    if layout == "packed":
        boxes = packed_targets(boxes, counts)
    loss_fn = ops.giou_loss_packed if layout == "packed" else ops.giou_loss

    def step():
        pred.grad = None
        loss = loss_fn(pred, boxes, counts)
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
    want_loss, want_grad = loss_and_grad(loss_fn, new_pred, boxes, counts)
    assert torch.equal(got, want_loss)  # deterministic kernels: replay equals eager bit for bit
    assert torch.equal(pred.grad, want_grad)
