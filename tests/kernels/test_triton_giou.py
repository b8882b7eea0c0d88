"""What the strategy grid (tests/test_strategies.py) does not cover for the ``triton`` strategy.

On a machine without CUDA the kernel runs through the Triton interpreter (set up by
detector.kernels.triton_giou); the CUDA rows and the ``gpu`` tests run where a GPU is present.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import detector.kernels.triton_giou as triton_strategy
from detector.bench.cases import random_case
from detector.data import make_targets
from detector.kernels.triton_giou import giou_loss_triton
from detector.losses import STRATEGIES, giou_loss_reference
from detector.targets import PaddedTargets

pytestmark = pytest.mark.skipif(triton_strategy.triton is None, reason="triton is not installed")

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
# Gradient tolerances of fp32 compute against the fp64 reference (the grid's fp32 row).
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5


def skip_if_unavailable(device):
    reason = STRATEGIES["triton"].unavailable(torch.device(device))
    if reason:
        pytest.skip(f"triton on {device}: {reason}")


def case(batch, max_boxes, distribution, pred_dtype=torch.float32, device="cpu", seed=0):
    """pred [B, M, 4] on ``device`` and padded (boxes, counts) there."""
    pred, boxes_list = random_case(batch, max_boxes, distribution, pred_dtype, torch.uint8, seed=seed)
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


def assert_matches(loss, grad, ref_loss, ref_grad, scale=1.0):
    torch.testing.assert_close(loss.double().cpu(), ref_loss * scale, rtol=1e-5, atol=1e-6)
    bound = ref_grad.abs().max().item() * abs(scale)
    torch.testing.assert_close(grad.double().cpu(), ref_grad * scale, rtol=GRAD_RTOL, atol=GRAD_ATOL * bound + 1e-12)


# ----------------------------------------------------------------------------- interpreter set-up


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels are compiled, not interpreted")
def test_interpreter_is_set_up_without_cuda():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert triton_strategy.INTERPRETED
    assert STRATEGIES["triton"].unavailable(torch.device("cpu")) is None


def run_fresh(script: str, **env_changes) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter with this checkout importable and the environment changed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_importing_the_losses_sets_no_environment_variable():
    script = "import os; before = dict(os.environ); import detector.losses; print(dict(os.environ) == before)"
    done = run_fresh(script)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-3000:]


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels are compiled, not interpreted")
def test_interpreter_works_when_triton_and_inductor_were_imported_first():
    # TRITON_INTERPRET=1 (as the CLI and conftest.py set it) in a fresh process that imports triton and
    # torch._inductor (as the `compiled` strategy and torch.compile do) before detector.losses.
    script = textwrap.dedent(
        """
        import torch, torch._inductor, triton, triton.language
        from detector.bench.cases import random_case
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
    if HAS_CUDA and not triton_strategy.INTERPRETED:
        assert "TRITON_INTERPRET" in cpu_reason
    else:
        assert cpu_reason is None


def test_unavailable_without_triton(monkeypatch):
    monkeypatch.setattr(triton_strategy, "triton", None)
    assert "triton is not installed" in STRATEGIES["triton"].unavailable(torch.device("cuda"))


# ----------------------------------------------------------------------------- kernel behaviour


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_boxes", [1, 13, 256, 1031])  # 1031: prime, and more than any BLOCK
def test_any_number_of_slots(device, max_boxes):
    skip_if_unavailable(device)
    pred, boxes, counts = case(3, max_boxes, "full" if max_boxes < 256 else "one_full", device=device, seed=max_boxes)
    assert_matches(*loss_and_grad(giou_loss_triton, pred, boxes, counts), *reference(pred, boxes, counts))


def test_autotune_is_keyed_on_slots():
    kernel = triton_strategy._giou_loss_fwd_bwd_kernel
    assert kernel.keys == ["M"]
    assert len(kernel.configs) == (1 if triton_strategy.INTERPRETED else len(triton_strategy._CONFIGS))


@pytest.mark.parametrize("device", DEVICES)
def test_counts_outside_the_slots_are_clamped(device):
    skip_if_unavailable(device)
    pred, boxes, _ = case(3, 13, "full", device=device, seed=5)
    counts = torch.tensor([-4, 20, 6], device=device)  # read as [0, 13, 6]
    ref_loss, ref_grad = reference(pred, boxes, counts.clamp(0, 13))
    assert_matches(*loss_and_grad(giou_loss_triton, pred, boxes, counts), ref_loss, ref_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_output", [3.5, -0.25, 0.0])
def test_backward_scales_by_grad_output(device, grad_output):
    skip_if_unavailable(device)
    pred, boxes, counts = case(7, 13, "seed", device=device, seed=7)
    loss, grad = loss_and_grad(giou_loss_triton, pred, boxes, counts, torch.tensor(grad_output, device=device))
    ref_loss, ref_grad = reference(pred, boxes, counts)
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_matches(loss * grad_output, grad, ref_loss, ref_grad, scale=grad_output)


@pytest.mark.parametrize("device", DEVICES)
def test_fp64_predictions_compute_in_fp64(device):
    skip_if_unavailable(device)
    pred, boxes, counts = case(7, 13, "seed", torch.float64, device=device, seed=11)
    loss, grad = loss_and_grad(giou_loss_triton, pred, boxes, counts)
    ref_loss, ref_grad = reference(pred, boxes, counts)
    assert loss.dtype == grad.dtype == torch.float64
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad.cpu(), ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    skip_if_unavailable(device)
    pred, boxes, counts = case(5, 13, "seed", device=device, seed=13)
    strided = pred.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, 4, M] memory
    assert not strided.is_contiguous()
    loss, grad = loss_and_grad(giou_loss_triton, strided, boxes[:, :, [0, 1, 2, 3]], counts)
    assert_matches(loss, grad, *reference(pred, boxes, counts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 13), (3, 0)])
def test_empty_batch_gives_a_connected_zero(device, shape):
    skip_if_unavailable(device)
    pred = torch.zeros(*shape, 4, device=device, requires_grad=True)
    loss = giou_loss_triton(pred, torch.zeros(*shape, 4, device=device), torch.zeros(shape[0], device=device).long())
    loss.backward()
    assert loss.item() == 0.0 and pred.grad.shape == pred.shape


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
    # schema, fake tensors (the shapes without running the kernel), autograd registration, AOT tracing
    device = "cuda" if HAS_CUDA else "cpu"
    skip_if_unavailable(device)
    pred, boxes, counts = case(7, 13, "seed", device=device, seed=17)
    pred = torch.nan_to_num(pred).requires_grad_()  # opcheck compares outputs, NaN != NaN elsewhere
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    tests += ("test_aot_dispatch_dynamic",) if dynamic else ("test_aot_dispatch_static",)
    torch.library.opcheck(torch.ops.detector.giou_loss_triton.default, (pred, boxes, counts), test_utils=tests)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_equals_eager(device):
    # fullgraph=True: no graph break and no data-dependent Python (.item(), a host-side count)
    skip_if_unavailable(device)
    torch._dynamo.reset()
    pred, boxes, counts = case(7, 256, "one_full", torch.bfloat16, device=device, seed=19)
    compiled = torch.compile(giou_loss_triton, fullgraph=True)
    loss, grad = loss_and_grad(compiled, pred, boxes, counts, torch.tensor(2.0, device=device))
    eager_loss, eager_grad = loss_and_grad(giou_loss_triton, pred, boxes, counts, torch.tensor(2.0, device=device))
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(grad, eager_grad)


@pytest.mark.gpu
@needs_cuda
def test_compile_traces_into_the_kernel_on_cuda():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    pred, boxes, counts = case(64, 256, "seed", device="cuda", seed=23)
    compiled = torch.compile(giou_loss_triton, fullgraph=True)
    loss, code = run_and_get_code(compiled, pred, boxes, counts)
    assert any("_giou_loss_fwd_bwd_kernel" in c for c in code), "inductor did not see the Triton kernel"
    torch.testing.assert_close(loss, giou_loss_triton(pred, boxes, counts))


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
    kernel = triton_strategy._giou_loss_fwd_bwd_kernel
    for max_boxes in (13, 256, 1031):
        pred, boxes, counts = case(4, max_boxes, "seed", device="cuda", seed=max_boxes)
        giou_loss_triton(pred, boxes, counts)
    tuned = {key[0] for key in kernel.cache}
    assert {13, 256, 1031} <= tuned
