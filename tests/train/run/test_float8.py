"""train.float8: its refusals, its run folder and fingerprint, and torchao's float8 head against the bf16 one."""

import importlib.util
import itertools

import pytest
import torch
from train_helpers import TINY, tiny_cfg

from detector.config.schema import load_config
from detector.data import build_loader
from detector.errors import UserError
from detector.model import BlockedLinear, compile_model
from detector.train.checkpoints.state import RUN_CONTROL, differences, fingerprint
from detector.train.run import speed_options as speed
from detector.train.run.float8 import float8_refusal, to_float8
from detector.train.run.folder import run_name
from detector.train.run.step import TrainStep

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed: pip install torchao")
CUDA = torch.device("cuda")
H100 = (9, 0)


def tiny(*overrides):
    """TINY at sizes float8 can take: 512 head inputs (8 channels x 8 x 8), 32 rows, a batch of 16."""
    return load_config([*TINY, "data.batch_size=16", "autocast=true", *overrides], announce=None)


def head(cfg, blocks=1):
    side = cfg.data.image_size // 2 ** len(cfg.model.channels)
    return BlockedLinear(cfg.model.channels[-1] * side**2, cfg.model.hidden, blocks)


def test_float8_is_off_by_default():
    for preset in ("cpu", "seed_scale"):
        assert load_config([f"preset={preset}"], announce=None).train.float8 is False


@pytest.mark.parametrize(
    "overrides, blocks, world_size, device, capability, installed, reason",
    [
        ([], 1, 1, torch.device("cpu"), None, True, "it needs a CUDA device (float8 tensor cores), this run is on cpu"),
        ([], 1, 1, CUDA, (8, 0), True, "float8 tensor cores (sm89 or later: Ada, Hopper), this one is sm80"),
        ([], 1, 1, CUDA, H100, False, "it needs torchao, which is not installed: pip install torchao"),
        (["autocast=false"], 1, 1, CUDA, H100, True, "bf16 activations of autocast: set autocast=true"),
        (["train.shard_optimizer=fsdp2"], 2, 2, CUDA, H100, True, "not wired for train.shard_optimizer=fsdp2"),
        (["data.batch_size=20"], 1, 1, CUDA, H100, True, "multiples of 16: data.batch_size 20"),
        (["model.hidden=40"], 2, 1, CUDA, H100, True, "(model.hidden / model.head_blocks) 20"),
        (["model.hidden=48"], 3, 1, CUDA, H100, True, None),  # 16 rows per block
        (["train.shard_optimizer=fsdp2"], 1, 1, CUDA, H100, True, None),  # one process: no FSDP2
        ([], 1, 1, CUDA, (8, 9), True, None),
    ],
)
def test_float8_refusal_names_what_is_missing(overrides, blocks, world_size, device, capability, installed, reason):
    cfg = tiny(*overrides)
    found = float8_refusal(cfg, [head(cfg, blocks)], world_size, device, capability, installed)
    if reason is None:
        assert found is None
    else:
        assert reason in found and "\n" not in found


def test_float8_refusal_names_each_uneven_size_once():
    cfg = tiny("model.hidden=50", "data.batch_size=8")  # 3 blocks of 17, 17 and 16 rows
    found = float8_refusal(cfg, [head(cfg, 3)], 1, CUDA, H100, True)
    assert found.endswith(
        "multiples of 16: data.batch_size 8, rows in a head block (model.hidden / model.head_blocks) 17"
    )


def test_train_step_refuses_float8_on_the_cpu_in_one_line():
    with pytest.raises(UserError) as err:
        TrainStep(tiny("train.float8=true"), torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("train.float8=true cannot run here: it needs a CUDA device") and "\n" not in message
    assert message.endswith("; set train.float8=false")


def test_a_float8_run_has_its_own_folder_and_its_own_fingerprint(tmp_path):
    bf16, float8 = tiny_cfg(tmp_path), tiny_cfg(tmp_path, "train.float8=true")
    assert run_name(bf16.train) == "padded" and run_name(float8.train) == "padded+float8"
    assert run_name(tiny_cfg(tmp_path, "train.compile=true", "train.float8=true").train) == "padded+compile+float8"
    # float8 products change the losses: a checkpoint resumes only under the setting it was written with
    assert "float8" not in RUN_CONTROL
    assert differences(fingerprint(bf16, 1), fingerprint(float8, 1)) == [
        "train.float8: False in the checkpoint, True now"
    ]


def test_bench_step_times_float8_beside_the_config_or_says_why_it_cannot():
    from detector.bench.step import VARIANTS, tables
    from detector.lab.measure.timing import Stats

    assert VARIANTS["+float8"] == ["train.float8=true"]  # the configured step, its head in float8
    assert all("train.float8=false" in overrides for name, overrides in VARIANTS.items() if name != "+float8")
    results = {
        "steps": {"config": {"step": Stats(50.0, 49.0, 51.0, 10)}},
        "unavailable": {"+float8": "train.float8=true cannot run here: it needs torchao"},
        "floor": None,
        "data_images_per_s": 1e5,
    }
    rows = tables(results, batch=1024, header="bench step").splitlines()
    assert "| +float8 | step | unavailable here: train.float8=true cannot run here: it needs torchao | — | — |" in rows


# ----------------------------------------------------------------------------- torchao's Float8Linear on the CPU


@needs_torchao
def test_conversion_keeps_the_parameters_and_the_state_dict():
    from torchao.float8.float8_linear import Float8Linear

    cfg = tiny("model.hidden=64")
    layer = head(cfg, blocks=2)
    before = {name: (p, p.data_ptr()) for name, p in layer.named_parameters()}
    keys = list(layer.state_dict())
    to_float8([layer], compile=False)
    assert layer.float8 and all(isinstance(block, Float8Linear) for block in layer.blocks)
    assert list(layer.state_dict()) == keys
    assert {name: (p, p.data_ptr()) for name, p in layer.named_parameters()} == before  # the same Parameters
    weight, bias = layer.rows(0, 2)  # the blocks' parameters still lie in one tensor
    assert weight.shape == (64, 512) and bias.shape == (64,)


def outputs_and_gradients(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return y.detach(), x.grad, layer.blocks[0].weight.grad


@needs_torchao
def test_float8_blocks_compute_the_linear_within_float8_rounding():
    torch.manual_seed(0)
    cfg = tiny("model.hidden=64")
    plain, converted = head(cfg, blocks=2), head(cfg, blocks=2)
    converted.load_state_dict(plain.state_dict())
    to_float8([converted], compile=False)
    x = torch.randn(16, 512)
    expected, got = outputs_and_gradients(plain, x), outputs_and_gradients(converted, x)
    # e4m3 (input, weight) keeps 3 mantissa bits: each operand rounds by up to 2^-4, ~3.6 % rms; e5m2 (the output's
    # gradient) keeps 2, ~7 % rms. A product's relative error is about both operands' together: ~5 % for the output,
    # ~8 % for the gradients. Above 0.1 %: the products did go through float8 (fp32 ones agree to ~1e-6).
    most = {"output": 0.08, "input gradient": 0.15, "weight gradient": 0.15}
    for (name, bound), want, have in zip(most.items(), expected, got, strict=True):
        error = ((have - want).norm() / want.norm()).item()
        assert 1e-3 < error < bound, f"{name}: relative error {error:.4f}"


@needs_torchao
def test_compiled_float8_blocks_compile_inside_the_models_graph_one_autograd_node_each():
    """train.compile: BlockedLinear.forward stays out of the model's graph, each block's forward is compiled on its
    own (Inductor fuses the float8 casts) and stays its own autograd node (its gradient is ready before the next's)."""
    torch.manual_seed(0)
    cfg = tiny("model.hidden=64")
    plain, converted = head(cfg, blocks=2), head(cfg, blocks=2)
    converted.load_state_dict(plain.state_dict())
    to_float8([converted], compile=True)
    model = compile_model(converted)  # as train.compile compiles the model around the head
    x = torch.randn(16, 512)
    y = model(x)
    assert [type(node).__name__ for node, _ in y.grad_fn.next_functions] == ["CompiledFunctionBackward"] * 2
    want = plain(x)
    assert 1e-3 < ((y - want).norm() / want.norm()).item() < 0.08  # float8's rounding, as eager (above)


@needs_torchao
def test_a_float8_train_step_learns_like_the_plain_one(monkeypatch):
    """The whole step with float8 blocks (the CPU's torch._scaled_mm, the refusal bypassed), against the plain step."""

    def losses(*overrides):
        cfg = tiny("autocast=false", "model.hidden=64", *overrides)
        step = TrainStep(cfg, torch.device("cpu"))
        return step, [step(batch).item() for batch in batches_of(cfg)]

    monkeypatch.setattr(speed, "float8_unavailable", lambda *args: None)
    plain_step, plain = losses()
    float8_step, float8 = losses("train.float8=true")
    assert float8_step.model.head[1].float8 and not plain_step.model.head[1].float8
    assert list(float8_step.model.state_dict()) == list(plain_step.model.state_dict())
    # six steps from the same initial model on the same batches: the losses move apart by float8's rounding only
    assert float8 == pytest.approx(plain, rel=0.02) and float8 != plain


def batches_of(cfg, steps=6):
    return list(itertools.islice(build_loader(cfg.data, "padded", torch.device("cpu")), steps))


# ----------------------------------------------------------------------------- CUDA


@needs_torchao
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="float8 tensor cores: needs a CUDA GPU of sm89 or later",
)
@pytest.mark.parametrize("compile", [False, True])
def test_float8_step_on_a_gpu_writes_no_bf16_copies_and_keeps_the_losses_close(compile):
    def run(*overrides):
        cfg = tiny(
            "model.channels=[4,16,16]", "data.image_size=64", "model.hidden=64", f"train.compile={compile}", *overrides
        )
        step = TrainStep(cfg, CUDA)
        return step, [step(batch).item() for batch in batches_of(cfg)]

    bf16_step, bf16 = run()
    float8_step, float8 = run("train.float8=true")
    assert bf16_step.optimizer.copy_ids and not float8_step.optimizer.copy_ids  # the one pass writes no bf16 head
    assert float8 == pytest.approx(bf16, rel=0.02)
