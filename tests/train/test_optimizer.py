"""The one-pass optimizer (train.optimizer=one_pass) against torch's clip_grad_norm_ + AdamW, and its bf16 copies."""

import pytest
import torch
from train_helpers import losses, tiny_cfg

from detector.model import low_precision
from detector.train.optimizer import OnePassAdamW, adamw_pass, clip_scale
from detector.train.run.entry import run_training

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled pass and its copies are CUDA's: no GPU")


def params_and_grads(device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (17,), (5, 3, 3, 3), (1,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(device) * 3 for s in shapes] for _ in range(6)]
    return params, grads


def run(optimizer_of, clip: float, device="cpu", skip_at=(), lrs=(1e-2, 3e-2, 5e-3, 1e-2, 2e-2, 1e-3)):
    """Six steps of given gradients (a step in ``skip_at`` has a non-finite loss): the parameters and state."""
    params, grads = params_and_grads(device)
    opt = optimizer_of(params)
    for i, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.param_groups[0]["lr"] = lrs[i]
        skip = torch.tensor(i in skip_at, device=device)
        if isinstance(opt, OnePassAdamW):
            scale = clip_scale([p.grad for p in params], clip) if clip else None
            opt.step(scale=scale, skip=skip)
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            if not skip.item():
                opt.step()
    return params, opt


@pytest.mark.parametrize("clip", [0.0, 1.0, 1e3])
@pytest.mark.parametrize("skip_at", [(), (0, 3)])
def test_one_pass_is_clip_then_adamw(clip, skip_at):
    ours, one = run(lambda p: OnePassAdamW(p, 0.01, weight_decay=0.05), clip, skip_at=skip_at)
    torch_params, adamw = run(lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05), clip, skip_at=skip_at)
    # the same operations in the same order, but torch's CPU AdamW takes the bias corrections in float64 on the
    # host, ours in fp32 on the device (as torch's fused CUDA kernel): each update (~lr = 1e-2) agrees to ~1e-4
    # of itself, so the parameters (~1) to 1e-6, and the moments (no bias correction) to fp32 rounding
    for a, b in zip(ours, torch_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(ours, torch_params, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(one.state[a][key], adamw.state[b][key].float(), rtol=1e-6, atol=1e-9)
    assert one.state[ours[0]]["step"].item() == 6 - len(skip_at)


def test_state_dicts_move_between_the_two_optimizers():
    params, grads = params_and_grads()
    adamw = torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    adamw.step()
    one = OnePassAdamW(params, 0.01, weight_decay=0.05)
    one.load_state_dict(adamw.state_dict())
    one.step()
    adamw.step()  # the same second step from the same state
    for p in params:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(one.state[p][key], adamw.state[p][key].float())
    back = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.01)
    back.load_state_dict(one.state_dict())
    assert back.state_dict()["state"].keys() == one.state_dict()["state"].keys()


def test_copies_are_the_updated_weights_until_something_else_writes_them():
    params, grads = params_and_grads()
    opt = OnePassAdamW(params, 0.01, weight_decay=0.0, low_precision=params[:2])
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    opt.step()
    weight, bias, conv = params[0], params[1], params[2]
    held = low_precision(weight, torch.bfloat16)
    assert held is weight.low_precision[0], "the forward reads the copy the optimizer wrote"
    assert torch.equal(held, weight.detach().to(torch.bfloat16))
    assert torch.equal(low_precision(bias, torch.bfloat16), bias.detach().to(torch.bfloat16))
    assert not hasattr(conv, "low_precision"), "only the parameters named get a copy"
    assert low_precision(weight, torch.float16).dtype == torch.float16, "another dtype: a fresh cast"
    with torch.no_grad():
        weight.add_(1.0)  # a checkpoint load, say
    fresh = low_precision(weight, torch.bfloat16)
    assert fresh is not held and torch.equal(fresh, weight.detach().to(torch.bfloat16)), "a stale copy is never read"


def test_two_hundred_steps_train_like_torchs_optimizer(tmp_path):
    run = ["train.steps=200", "train.checkpoint_every=0", "train.log_every=10", "train.grad_clip=0.5", "train.lr=0.002"]
    one = losses(s.to_json() for s in run_training(tiny_cfg(tmp_path / "one", *run, "train.optimizer=one_pass")))
    ref = losses(s.to_json() for s in run_training(tiny_cfg(tmp_path / "torch", *run, "train.optimizer=torch")))
    assert len(one) == len(ref) == 20
    # Only the bias corrections' rounding differs (float64 on the host in torch's CPU AdamW, fp32 here), and 200
    # steps grow it to at most 6e-5 of the loss; a 1e-4 relative change of the learning rate moves these losses
    # by up to 1e-3, and a missing clip or bias correction by far more. Tolerance: 2e-4.
    torch.testing.assert_close(one, ref, rtol=2e-4, atol=0)


@CUDA
def test_compiled_pass_is_the_eager_pass_on_cuda():
    compiled = lambda p: OnePassAdamW(p, 0.01, 0.05, low_precision=p[:1], compile=True)  # noqa: E731
    eager = lambda p: OnePassAdamW(p, 0.01, 0.05, low_precision=p[:1])  # noqa: E731
    a, opt_a = run(compiled, 1.0, "cuda", skip_at=(2,))
    b, opt_b = run(eager, 1.0, "cuda", skip_at=(2,))
    for x, y in zip(a, b, strict=True):
        # inductor contracts a * b + c into fmas the eager kernels round twice: ~2 ulp of a parameter (~4)
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert torch.equal(a[0].low_precision[0], a[0].detach().to(torch.bfloat16))


@CUDA
def test_no_recompilation_as_the_learning_rate_changes():
    torch._dynamo.reset()
    params, grads = params_and_grads("cuda")
    opt = OnePassAdamW(params, 0.01, 0.05, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g
            opt.param_groups[0]["lr"] = 0.01 * (i + 1)
            opt.step(scale=clip_scale([p.grad for p in params], 1.0))


def test_pass_refuses_mismatched_lists():
    p = [torch.zeros(2)]
    with pytest.raises(ValueError):
        adamw_pass(p, p, p, p, [], [None], 0.1, 1.0, torch.tensor(False), 0.9, 0.999, 1e-8, 0.0)
