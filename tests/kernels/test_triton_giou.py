"""What the strategy grid (tests/losses/test_strategies.py) does not cover for the ``triton`` strategy.

The loss reaches the kernels by two paths, and both are tested against the float64 reference:
- ``eager``: ``giou_loss_triton`` outside torch.compile, the autograd.Function that launches the kernels;
- ``op``: the ops ``detector::giou_loss_triton`` (+ its registered autograd) and
  ``detector::giou_loss_triton_backward``, the path torch.compile traces (the ``compiled`` tests
  compile ``giou_loss_triton`` itself).
On a machine without CUDA the kernels run through the Triton interpreter (set up by tests/conftest.py);
the CUDA rows and the ``gpu`` tests run where a GPU is present.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import detector.kernels.triton_giou as triton_strategy
from detector.data import make_targets
from detector.data.targets import PaddedTargets
from detector.kernels import jit
from detector.kernels.triton_giou import giou_loss_triton
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES, giou_loss_reference
from detector.losses.geometry import EPS

pytestmark = pytest.mark.skipif(jit.triton is None, reason="triton is not installed")

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

# pred dtype -> (loss rtol, gradient rtol, gradient atol as a fraction of the largest reference gradient).
# The kernels compute in fp32 (fp64 for fp64 pred) from the very values the fp64 reference sees: fp32
# rounding on the loss whatever the pred dtype. The gradient is stored in pred's dtype, so bf16 and fp16
# carry their rounding (2^-8, 2^-11 relative) on top. fp64 differs from the reference only in the order
# of operations.
TOLERANCES = {
    torch.float64: (1e-12, 1e-9, 1e-12),
    torch.float32: (1e-5, 1e-4, 1e-5),
    torch.bfloat16: (1e-5, 1e-2, 1e-2),
    torch.float16: (1e-5, 5e-3, 5e-3),
}

# The edge cases: (batch, slots, box distribution, pred dtype, target dtype). Padded predictions are NaN.
EDGE_CASES = {
    "no boxes": (4, 13, "zero", torch.float32, torch.uint8),
    "one box": (1, 1, 1, torch.float32, torch.uint8),
    "256 boxes": (1, 256, "full", torch.float32, torch.float32),
    "prime slots, NaN padding": (7, 13, "seed", torch.float32, torch.uint8),
    "degenerate boxes": (7, 13, "degenerate", torch.float32, torch.float32),
    "bf16, uint8 targets": (64, 256, "tail", torch.bfloat16, torch.uint8),
    "fp16, int32 targets": (5, 37, "seed", torch.float16, torch.int32),
    "fp64": (7, 13, "seed", torch.float64, torch.int64),
}


def op_path(pred, boxes, counts):
    """The loss through the ops (the path torch.compile traces), run eagerly."""
    loss, _inv_count = torch.ops.detector.giou_loss_triton.default(pred, boxes, counts)
    return loss


PATHS = {"eager": giou_loss_triton, "op": op_path}


def skip_if_unavailable(device):
    reason = STRATEGIES["triton"].unavailable(torch.device(device))
    if reason:
        pytest.skip(f"triton on {device}: {reason}")


def case(batch, max_boxes, distribution, pred_dtype=torch.float32, device="cpu", seed=0, target_dtype=torch.uint8):
    """pred [B, M, 4] (NaN in padded slots) on ``device`` and padded (boxes, counts) there."""
    pred, boxes_list = random_case(batch, max_boxes, distribution, pred_dtype, target_dtype, seed=seed)
    boxes, counts = make_targets(boxes_list, "padded", max_boxes)
    return pred.to(device), boxes.to(device), counts.to(device)


def reference(pred, boxes, counts):
    """(loss, d loss / d pred) of the fp64 reference, on the CPU."""
    ref_pred = pred.detach().cpu().double().requires_grad_()
    loss = giou_loss_reference(ref_pred, boxes.cpu(), counts.cpu())
    loss.backward()
    return loss.detach(), ref_pred.grad


def loss_and_grad(fn, pred, boxes, counts, grad_output=None):
    p = pred.detach().clone().requires_grad_()
    loss = fn(p, boxes, counts)
    loss.backward(grad_output)
    return loss.detach(), p.grad


def assert_matches(loss, grad, ref_loss, ref_grad, grad_scale=1.0, dtype=torch.float32):
    """loss and grad against the reference's (the gradient times ``grad_scale``), in ``dtype``'s tolerances."""
    loss_rtol, grad_rtol, grad_atol = TOLERANCES[dtype]
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=loss_rtol, atol=loss_rtol / 10)
    want = ref_grad * grad_scale
    bound = want.abs().max().item()
    torch.testing.assert_close(grad.double().cpu(), want, rtol=grad_rtol, atol=grad_atol * bound + 1e-12)


def assert_padded_slots_zero(grad, counts):
    valid = torch.arange(grad.shape[1]) < counts.cpu().clamp(0, grad.shape[1])[:, None]
    assert torch.all(grad.cpu()[~valid] == 0), "padded slots must get exactly zero gradient"
    assert torch.isfinite(grad).all()


# ----------------------------------------------------------------------------- interpreter set-up


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels are compiled, not interpreted")
def test_interpreter_is_set_up_without_cuda():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert jit.INTERPRETED
    assert STRATEGIES["triton"].unavailable(torch.device("cpu")) is None


def run_fresh(script: str, **env_changes) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter with this checkout importable and the environment changed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_importing_the_losses_sets_no_environment_variable_and_imports_no_torchvision():
    """One fresh interpreter for both: torchvision is imported lazily, by the torchvision strategies' first call
    (tests/losses/test_torchvision.py)."""
    script = "import os, sys; before = dict(os.environ); import detector.losses; "
    script += "print(dict(os.environ) == before, 'torchvision' in sys.modules)"
    done = run_fresh(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True False", "an environment variable set, or torchvision imported at module import"


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels are compiled, not interpreted")
def test_interpreter_works_when_triton_and_inductor_were_imported_first():
    # TRITON_INTERPRET=1 (as the CLI and conftest.py set it) in a fresh process that imports triton and
    # torch._inductor (as the `compiled` strategy and torch.compile do) before detector.losses.
    script = textwrap.dedent(
        """
        import torch, torch._inductor, triton, triton.language
        from detector.lab.measure.cases import random_case
        from detector.data import make_targets
        from detector.losses import STRATEGIES, giou_loss_reference
        pred, boxes_list = random_case(3, 13, "seed", seed=3)
        targets = make_targets(boxes_list, "padded", 13)
        loss = STRATEGIES["triton"](pred, targets)
        torch.testing.assert_close(loss.double(), giou_loss_reference(pred.double(), targets))
        print("ok")
        """
    )
    done = run_fresh(script, TRITON_INTERPRET="1")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_unavailable_says_why():
    cpu_reason = STRATEGIES["triton"].unavailable(torch.device("cpu"))
    if HAS_CUDA and not jit.INTERPRETED:
        assert "TRITON_INTERPRET" in cpu_reason
    else:
        assert cpu_reason is None


def test_unavailable_without_triton(monkeypatch):
    monkeypatch.setattr(triton_strategy, "triton", None)
    assert "triton is not installed" in STRATEGIES["triton"].unavailable(torch.device("cuda"))


def test_eps_is_the_contracts():
    assert triton_strategy.EPS == EPS


FAKE_DRIVER_SCRIPT = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class Launcher:  # records what a launch would pass to the CUDA launcher
    calls = []
    def __init__(self, src, metadata): pass
    def __call__(self, *launch): Launcher.calls.append(launch)

class Utils:
    def load_binary(self, name, kernel, shared, device): return 1, 2, 32, 0, 1024
    def get_device_properties(self, device): return {"max_shared_mem": 232448, "multiprocessor_count": 132}

class FakeCudaDriver:  # what JITFunction.run and CompiledKernel need; kernels really compile (ptxas)
    utils, launcher_cls = Utils(), Launcher
    def get_current_device(self): return -1
    def get_current_stream(self, device=None): return 7
    def get_current_target(self): return GPUTarget("cuda", 90, 32)

driver.set_active(FakeCudaDriver())
torch.cuda.current_device = lambda: -1  # CPU tensors: get_device() is -1
import detector.kernels.triton_giou as tg
for kernel in (tg._giou_loss_forward_kernel, tg._giou_loss_backward_kernel):  # autotuning runs each config once
    kernel.do_bench = lambda fn, quantiles: (fn(), [1.0, 1.0, 1.0])[1]
B, M = 5, 13
pred, boxes, counts = torch.rand(B, M, 4).bfloat16(), torch.zeros(B, M, 4, dtype=torch.uint8), torch.ones(B).long()
loss, inv_count, work = tg._forward_outputs(pred)
launches = [
    (tg._giou_loss_forward_kernel, tg._forward_grid(B, pred.device), (pred, boxes, counts, work, loss, inv_count)),
    (tg._giou_loss_backward_kernel, tg._backward_grid(B, M), (pred, boxes, counts, torch.ones(()), inv_count, pred)),
]
for kernel, grid, tensors in launches:
    tg._launch(kernel, grid, *tensors, B, M)  # through Triton's launcher: autotunes, compiles
    tg._launch(kernel, grid, *tensors, B, M)  # the cached CompiledKernel
    first, cached = Launcher.calls[-2:]
    # grid, stream, function, kernel metadata; then (launch metadata and hooks differ) every argument
    assert first[:6] == cached[:6], (first[:6], cached[:6])
    assert len(first) == len(cached) and all(a is b or a == b for a, b in zip(first[9:], cached[9:]))
print("ok", len(tg._COMPILED))
"""


@pytest.mark.skipif(HAS_CUDA, reason="the gpu tests launch the real kernels")
def test_cached_launch_passes_what_triton_passes():
    # The eager path's launch of a cached CompiledKernel is only exercised with CUDA. Here Triton compiles
    # for sm_90 under a fake driver whose launcher records its arguments: the cached launch must pass what
    # Triton's own launch (JITFunction.run) passes, in the same order, constexprs included.
    done = run_fresh(FAKE_DRIVER_SCRIPT)
    assert done.returncode == 0 and done.stdout.strip() == "ok 2", done.stderr[-3000:]


# ----------------------------------------------------------------------------- kernel behaviour


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", EDGE_CASES)
def test_edge_cases_match_the_reference(name, path, device):
    skip_if_unavailable(device)
    batch, max_boxes, distribution, pred_dtype, target_dtype = EDGE_CASES[name]
    pred, boxes, counts = case(batch, max_boxes, distribution, pred_dtype, device, batch, target_dtype)
    loss, grad = loss_and_grad(PATHS[path], pred, boxes, counts)
    assert loss.dtype == torch.promote_types(pred_dtype, torch.float32) and grad.dtype == pred_dtype
    assert_matches(loss, grad, *reference(pred, boxes, counts), dtype=pred_dtype)
    assert_padded_slots_zero(grad, counts)
    if distribution == "zero":
        assert loss.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_boxes", [1, 13, 256, 1031])  # 1031: prime, and more than any BLOCK
def test_any_number_of_slots(device, max_boxes):
    skip_if_unavailable(device)
    pred, boxes, counts = case(3, max_boxes, "full" if max_boxes < 256 else "one_full", device=device, seed=max_boxes)
    assert_matches(*loss_and_grad(giou_loss_triton, pred, boxes, counts), *reference(pred, boxes, counts))


def test_autotune_is_keyed_on_slots():
    for kernel in (triton_strategy._giou_loss_forward_kernel, triton_strategy._giou_loss_backward_kernel):
        assert kernel.keys == ["M"]
        assert len(kernel.configs) == (1 if triton_strategy.INTERPRETED else len(triton_strategy._CONFIGS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_counts_outside_the_slots_are_clamped(device, path):
    skip_if_unavailable(device)
    pred, boxes, _ = case(3, 13, "full", device=device, seed=5)
    counts = torch.tensor([-4, 20, 6], device=device)  # read as [0, 13, 6]
    ref_loss, ref_grad = reference(pred, boxes, counts.clamp(0, 13))
    loss, grad = loss_and_grad(PATHS[path], pred, boxes, counts)
    assert_matches(loss, grad, ref_loss, ref_grad)
    assert_padded_slots_zero(grad, counts)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_op_returns_the_inverse_count(device):
    skip_if_unavailable(device)
    pred, boxes, _ = case(3, 13, "full", device=device, seed=5)
    counts = torch.tensor([-4, 20, 6], device=device)  # 0 + 13 + 6 valid boxes
    _, inv_count = torch.ops.detector.giou_loss_triton.default(pred, boxes, counts)
    assert inv_count.item() == pytest.approx(1 / 19, rel=1e-7)
    _, inv_count = torch.ops.detector.giou_loss_triton.default(pred, boxes, torch.zeros_like(counts))
    assert inv_count.item() == 1.0  # 1 / max(n_valid, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("grad_output", [3.5, -0.25, 0.0])
def test_backward_scales_by_grad_output(device, path, grad_output):
    skip_if_unavailable(device)
    pred, boxes, counts = case(7, 13, "seed", device=device, seed=7)
    loss, grad = loss_and_grad(PATHS[path], pred, boxes, counts, torch.tensor(grad_output, device=device))
    assert_matches(loss, grad, *reference(pred, boxes, counts), grad_scale=grad_output)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_backward_through_a_product(device, path):
    # (loss * 3).backward(): grad_output reaches the backward kernel as a device tensor, not a Python 1
    skip_if_unavailable(device)
    pred, boxes, counts = case(7, 13, "seed", torch.bfloat16, device=device, seed=7)
    p = pred.detach().clone().requires_grad_()
    loss = PATHS[path](p, boxes, counts)
    (loss * 3).backward()
    assert_matches(loss.detach(), p.grad, *reference(pred, boxes, counts), grad_scale=3, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_non_contiguous_inputs(device, path):
    skip_if_unavailable(device)
    pred, boxes, counts = case(5, 13, "seed", device=device, seed=13)
    strided = pred.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, 4, M] memory
    assert not strided.is_contiguous()
    loss, grad = loss_and_grad(PATHS[path], strided, boxes[:, :, [0, 1, 2, 3]], counts)
    assert_matches(loss, grad, *reference(pred, boxes, counts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(0, 13), (3, 0)], ids=["B=0", "M=0"])
def test_empty_batch_gives_a_connected_zero(device, path, shape):
    skip_if_unavailable(device)
    pred = torch.zeros(*shape, 4, device=device, requires_grad=True)
    loss = PATHS[path](pred, torch.zeros(*shape, 4, device=device), torch.zeros(shape[0], device=device).long())
    loss.backward()
    assert loss.item() == 0.0 and pred.grad.shape == pred.shape


def test_eager_calls_skip_the_dispatcher():
    pred, boxes, counts = case(2, 8, "seed", device="cuda" if HAS_CUDA else "cpu")
    loss = giou_loss_triton(pred.requires_grad_(), boxes, counts)
    assert type(loss.grad_fn).__name__ == "_GiouLossTritonBackward"


@pytest.mark.parametrize("path", PATHS)
def test_double_backward_is_refused(path):
    pred, boxes, counts = case(2, 8, "seed", device="cuda" if HAS_CUDA else "cpu")
    p = pred.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(PATHS[path](p, boxes, counts), p, create_graph=True)


def test_int32_indexing_limit_names_pred():
    pred = torch.empty(2**29, 1, 4, device="meta")  # 2**31 elements: past the kernels' int32 offsets
    with pytest.raises(ValueError, match="pred has 2147483648 elements"):
        giou_loss_triton(pred, torch.empty(2**29, 1, 4, device="meta"), torch.empty(2**29, device="meta").long())


def test_bad_inputs_name_the_argument():
    # Through the public entry, which checks once; the launcher below it trusts its caller.
    triton_loss = STRATEGIES["triton"]
    pred, boxes, counts = case(2, 8, "seed")
    with pytest.raises(ValueError, match="pred"):
        triton_loss(pred[..., :3], PaddedTargets(boxes, counts))
    with pytest.raises(TypeError, match="pred"):
        triton_loss(pred.int(), PaddedTargets(boxes, counts))
    with pytest.raises(ValueError, match="target boxes"):
        triton_loss(pred, PaddedTargets(boxes[:, :4], counts))
    with pytest.raises(TypeError, match="counts"):
        triton_loss(pred, PaddedTargets(boxes, counts.float()))
    with pytest.raises(ValueError, match="counts"):
        triton_loss(pred, PaddedTargets(boxes, counts[:, None]))
    with pytest.raises(ValueError, match="batch"):
        triton_loss(pred, PaddedTargets(boxes, counts[:1]))
    with pytest.raises(ValueError, match="one device"):
        triton_loss(pred, PaddedTargets(boxes, counts.to("meta")))


# ----------------------------------------------------------------------------- tracing: no host sync


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_opcheck(dynamic):
    # schema, fake tensors (the shapes without running the kernels), autograd registration, AOT tracing
    device = "cuda" if HAS_CUDA else "cpu"
    skip_if_unavailable(device)
    pred, boxes, counts = case(7, 13, "seed", device=device, seed=17)
    pred = torch.nan_to_num(pred).requires_grad_()  # opcheck compares outputs, NaN != NaN elsewhere
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    tests += ("test_aot_dispatch_dynamic",) if dynamic else ("test_aot_dispatch_static",)
    torch.library.opcheck(torch.ops.detector.giou_loss_triton.default, (pred, boxes, counts), test_utils=tests)
    _, inv_count = torch.ops.detector.giou_loss_triton.default(pred, boxes, counts)
    grad_loss = torch.tensor(2.0, device=device)
    backward_args = (grad_loss, pred.detach(), boxes, counts, inv_count.detach())  # first order only
    torch.library.opcheck(torch.ops.detector.giou_loss_triton_backward.default, backward_args, test_utils=tests)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["bf16, uint8 targets", "one box", "fp64"])
def test_compile_fullgraph_matches_eager_and_the_reference(device, name):
    # fullgraph=True: no graph break and no data-dependent Python (.item(), a host-side count)
    skip_if_unavailable(device)
    torch._dynamo.reset()
    batch, max_boxes, distribution, pred_dtype, target_dtype = EDGE_CASES[name]
    pred, boxes, counts = case(batch, max_boxes, distribution, pred_dtype, device, seed=19, target_dtype=target_dtype)
    compiled = torch.compile(giou_loss_triton, fullgraph=True)
    grad_output = torch.tensor(2.0, device=device)
    loss, grad = loss_and_grad(compiled, pred, boxes, counts, grad_output)
    eager_loss, eager_grad = loss_and_grad(giou_loss_triton, pred, boxes, counts, grad_output)
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(grad, eager_grad)
    assert_matches(loss, grad, *reference(pred, boxes, counts), grad_scale=2, dtype=pred_dtype)


@pytest.mark.gpu
@needs_cuda
def test_compile_traces_into_both_kernels_on_cuda():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    pred, boxes, counts = case(64, 256, "seed", device="cuda", seed=23)
    compiled = torch.compile(giou_loss_triton, fullgraph=True)

    def forward_backward(p):
        loss = compiled(p, boxes, counts)
        loss.backward()
        return loss

    p = pred.clone().requires_grad_()
    loss, code = run_and_get_code(forward_backward, p)
    for kernel in ("_giou_loss_forward_kernel", "_giou_loss_backward_kernel"):
        assert any(kernel in c for c in code), f"inductor did not see {kernel}"
    eager_loss, eager_grad = loss_and_grad(giou_loss_triton, pred, boxes, counts)
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(p.grad, eager_grad)


@pytest.mark.gpu
@needs_cuda
def test_no_host_synchronisation_on_cuda():
    pred, boxes, counts = case(64, 256, "tail", torch.bfloat16, device="cuda", seed=29)
    loss_and_grad(giou_loss_triton, pred, boxes, counts)  # autotuning synchronises, once per M
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_and_grad(giou_loss_triton, pred, boxes, counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
def test_autotune_caches_one_config_per_slot_count_on_cuda():
    for max_boxes in (13, 256, 1031):
        pred, boxes, counts = case(4, max_boxes, "seed", device="cuda", seed=max_boxes)
        loss_and_grad(giou_loss_triton, pred, boxes, counts)
    for kernel in (triton_strategy._giou_loss_forward_kernel, triton_strategy._giou_loss_backward_kernel):
        assert {13, 256, 1031} <= {key[0] for key in kernel.cache}


@pytest.mark.gpu
@needs_cuda
def test_eager_launches_reuse_the_compiled_kernel_per_alignment_on_cuda():
    # The second call launches the CompiledKernel kept by the first; a pred that is not 16-byte aligned
    # is another specialisation, so it gets its own entry (and the right answer).
    pred, boxes, counts = case(9, 53, "tail", device="cuda", seed=31)  # no other test uses M = 53: fresh entries
    first = loss_and_grad(giou_loss_triton, pred, boxes, counts)
    entries = len(triton_strategy._COMPILED)
    second = loss_and_grad(giou_loss_triton, pred, boxes, counts)
    assert len(triton_strategy._COMPILED) == entries
    torch.testing.assert_close(first, second, rtol=1e-6, atol=0)  # the loss's atomic sum may differ in last bits
    # the kernel must see this tensor itself: loss_and_grad's clone would be aligned again
    unaligned = torch.empty(pred.numel() + 1, device="cuda")[1:].view_as(pred).copy_(pred).requires_grad_()
    assert unaligned.data_ptr() % 16 and unaligned.is_contiguous()
    loss = giou_loss_triton(unaligned, boxes, counts)
    loss.backward()
    assert len(triton_strategy._COMPILED) > entries
    assert_matches(loss.detach(), unaligned.grad, *reference(pred, boxes, counts))
