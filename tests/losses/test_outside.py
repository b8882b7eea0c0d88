"""Strategies from outside the package (detector/losses/registry.py): ``my_module:my_loss`` and the entry points of
``detector.strategies``, their errors, the configuration's check, and per_box_loss (detector/losses/per_box.py)."""

import importlib.metadata
import itertools
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, child_env
from lab_helpers import TINY_PROFILE

from detector.cli import main as cli
from detector.config.schema import load_config
from detector.data.targets import make_targets
from detector.lab.compare import run_compare
from detector.lab.measure.cases import random_case
from detector.losses import (
    STRATEGIES,
    KnownStrategies,
    get_strategy,
    giou_loss_reference,
    per_box_loss,
    registry,
)
from detector.losses.geometry import giou_loss_per_box
from detector.losses.registry import OutsideStrategyError

NUMBER = itertools.count()
GIOU_FILE = """
from detector.losses import per_box_loss
from detector.losses.geometry import giou_loss_per_box


def giou(pred, target):
    \"\"\"GIoU, box by box, from a file of the user's\"\"\"
    return giou_loss_per_box(pred, target)


loss = per_box_loss(giou)
raw = lambda pred, targets: loss(pred, targets)
raw.layout = "padded"
no_layout = lambda pred, targets: loss(pred, targets)
number = 3
"""


def user_module(folder, text: str = GIOU_FILE) -> str:
    """A module of the user's, under a name no other test imported."""
    name = f"user_loss_{next(NUMBER)}"
    (folder / f"{name}.py").write_text(textwrap.dedent(text))
    return name


def test_module_attribute_registers_under_that_name_with_its_layout_and_reference(user_dir):
    module = user_module(user_dir)
    strategy = get_strategy(f"{module}:loss")
    assert STRATEGIES[f"{module}:loss"] is strategy and strategy.name == f"{module}:loss"
    assert strategy.layout == "padded" and strategy.description == "GIoU, box by box, from a file of the user's"
    assert strategy.reference is not None and get_strategy(f"{module}:loss") is strategy  # imported once
    pred, boxes = random_case(7, 16, "seed", seed=1)
    targets = make_targets(boxes, "padded", 16)
    torch.testing.assert_close(strategy(pred, targets), giou_loss_reference(pred, targets))
    raw = get_strategy(f"{module}:raw")
    assert raw.layout == "padded" and raw.reference is None  # no reference: the contract's GIoU
    assert raw.description == f"{module}:raw, from outside the package"


def test_a_strategy_object_is_registered_under_the_name_it_was_asked_by(user_dir):
    module = user_module(
        user_dir,
        """
        from detector.losses import STRATEGIES
        mine = STRATEGIES["packed"]
        """,
    )
    strategy = get_strategy(f"{module}:mine")
    assert strategy.name == f"{module}:mine" and strategy.layout == "packed"
    assert strategy.fn.__wrapped__ is STRATEGIES["packed"].fn  # called through the check of a user's loss


@pytest.mark.parametrize(
    "attribute,match",
    [
        ("no_layout", r"<lambda>.layout is None; set it to the targets it takes, one of list, padded, packed"),
        ("number", r"is a int, expected a loss function"),
        ("missing", r"has no 'missing' \(it defines giou, giou_loss_per_box, loss, no_layout, per_box_loss, raw\)"),
    ],
)
def test_what_is_not_a_loss_is_one_line(user_dir, attribute, match):
    module = user_module(user_dir)
    with pytest.raises(OutsideStrategyError, match=match):
        get_strategy(f"{module}:{attribute}")
    assert f"{module}:{attribute}" not in STRATEGIES


def test_a_module_that_cannot_be_imported_says_why_and_where(user_dir):
    with pytest.raises(OutsideStrategyError, match=r"'nowhere_at_all:loss': no module nowhere_at_all \(a nowhere"):
        get_strategy("nowhere_at_all:loss")
    broken = user_module(user_dir, "import math\n\nx = undefined_name + 1\n")
    with pytest.raises(OutsideStrategyError, match=rf"importing {broken} failed: NameError: .*\({broken}.py, line 3\)"):
        get_strategy(f"{broken}:loss")
    missing = user_module(user_dir, "import not_installed_package_xyz\n")
    with pytest.raises(OutsideStrategyError, match="ModuleNotFoundError: No module named 'not_installed_package_xyz'"):
        get_strategy(f"{missing}:loss")
    with pytest.raises(OutsideStrategyError, match=r"name a module and its attribute, my_module:my_loss"):
        get_strategy("some/where/mine.py:loss")


BROKEN_FILE = """
import sys

import torch

from detector.losses import giou_loss_reference


def raises(pred, targets):
    return pred.view(-1, 3).sum()


def per_image(pred, targets):
    return giou_loss_reference(pred, targets) + pred.nan_to_num().sum(dim=(1, 2)) * 0


def detached(pred, targets):
    return giou_loss_reference(pred.detach(), targets)


def nothing(pred, targets):
    giou_loss_reference(pred, targets)


def number(pred, targets):
    return giou_loss_reference(pred, targets).item()


def counts(pred, targets):
    return targets.counts.sum()


def exits(pred, targets):
    sys.exit("giving up")


def one_argument(pred):
    return pred.sum()


for fn in (raises, per_image, detached, nothing, number, counts, exits, one_argument):
    fn.layout = "padded"
"""


@pytest.mark.parametrize(
    "attribute,match",
    [
        ("raises", r"raised RuntimeError: shape '\[-1, 3\]' is invalid .*\({module}.py, line 10\)$"),  # not torch's
        ("per_image", r"returned a tensor of shape \[7\], expected a 0-dim loss"),
        ("detached", r"returned a loss without a gradient \(requires_grad=False\) though pred requires one: does"),
        ("nothing", r"returned None, expected a 0-dim tensor: the loss"),
        ("number", r"returned a float \(\d+\.\d+\), expected a 0-dim tensor"),
        ("counts", r"returned a tensor of dtype torch.int64, expected a floating loss"),
        ("exits", r"called sys.exit\('giving up'\) \({module}.py, line 34\)"),
    ],
)
def test_a_loss_that_fails_when_called_is_one_line_naming_it_and_what_it_returned(user_dir, attribute, match):
    module = user_module(user_dir, BROKEN_FILE)
    strategy = get_strategy(f"{module}:{attribute}")
    pred, boxes = random_case(7, 16, "seed", seed=1)
    with pytest.raises(OutsideStrategyError, match=rf"^strategy '{module}:{attribute}' " + match.format(module=module)):
        strategy(pred.requires_grad_(), make_targets(boxes, "padded", 16))


def test_a_loss_that_takes_other_arguments_is_refused_when_named(user_dir):
    module = user_module(user_dir, BROKEN_FILE)
    with pytest.raises(
        OutsideStrategyError, match=r"one_argument\(pred\) cannot take a loss's arguments \(pred, targets\): too many"
    ):
        get_strategy(f"{module}:one_argument")


def test_a_module_that_exits_when_imported_is_said_to(user_dir):
    module = user_module(user_dir, "import sys\n\nsys.exit(3)\n")
    with pytest.raises(OutsideStrategyError, match=rf"importing {module} called sys.exit\(3\) \({module}.py, line 3\)"):
        get_strategy(f"{module}:loss")


@pytest.mark.parametrize(
    "argv",
    [
        ["profile", "profile.strategy={}", *TINY_PROFILE],
        ["train", "train.strategy={}", "train.steps=2", "train.compile=false", *TINY_PROFILE[:6]],
        ["bench", "bench.strategies=[{}]", "bench.batch_sizes=[4]", "bench.repeats=1", "bench.warmup=0", "preset=cpu"],
    ],
    ids=lambda argv: argv[0],
)
def test_profile_train_and_bench_say_it_in_one_line_and_exit_2(user_dir, capsys, monkeypatch, argv):
    module = user_module(user_dir, BROKEN_FILE)
    monkeypatch.delenv("DETECTOR_DEBUG", raising=False)
    argv = [arg.format(f"{module}:per_image") for arg in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    expected = f"error: strategy '{module}:per_image' returned a tensor of shape [4], expected a 0-dim loss"
    assert err == f"{expected} (the mean over the batch's boxes)"
    with pytest.raises(OutsideStrategyError):  # --debug: the traceback
        cli.main(["--debug", *argv])


def test_a_profile_of_a_loss_that_is_not_finite_says_so_on_its_card_and_in_compare(user_dir, capsys):
    module = user_module(
        user_dir,
        """
        from detector.losses import giou_loss_reference


        def nan_after_two(pred, targets):
            nan_after_two.calls += 1
            return giou_loss_reference(pred, targets) * (float("nan") if nan_after_two.calls > 2 else 1.0)


        nan_after_two.calls = 0
        nan_after_two.layout = "padded"
        """,
    )
    assert cli.main(["profile", f"profile.strategy={module}:nan_after_two", *TINY_PROFILE]) == 0
    warning = "the loss is not finite at 2 of the 4 profiled steps (step 3: nan): the times are those of a loss that"
    assert f"**warning**: {warning}" in capsys.readouterr().out  # wait 1, warmup 1, active 2: steps 3 and 4
    run_compare(user_dir / "runs" / "profile", out_dir=user_dir / "compare")
    assert f"**warning** ({module}:nan_after_two): {warning}" in capsys.readouterr().out


BACKWARD_FILE = """
import torch

from detector.losses import giou_loss_reference


class Broken(torch.autograd.Function):
    \"\"\"The reference's loss, with a backward of the user's making.\"\"\"

    @staticmethod
    def forward(ctx, pred, targets, how):
        ctx.how = how
        ctx.save_for_backward(pred)
        return giou_loss_reference(pred.detach(), targets)  # NaN once a NaN gradient has reached the weights

    @staticmethod
    def backward(ctx, grad):
        (pred,) = ctx.saved_tensors
        if ctx.how == "raises":
            raise ValueError("my backward is broken")
        if ctx.how == "shape":
            return grad.expand(3), None, None
        if ctx.how == "none":
            return None, None, None
        return torch.full_like(pred, float("nan")), None, None


def make(how):
    def loss(pred, targets):
        return Broken.apply(pred, targets, how)

    loss.layout = "padded"
    return loss


raises, shape, none, nan = (make(how) for how in ("raises", "shape", "none", "nan"))
"""


@pytest.mark.parametrize(
    "attribute,match",
    [
        ("raises", r": its backward raised ValueError: my backward is broken \({module}.py, line 20\)$"),
        (
            "shape",
            r": its backward raised RuntimeError: Function BrokenBackward returned an invalid gradient at index 0 - "
            r"got \[3\] but expected shape compatible with \[4, 8, 4\]$",  # no line of torch's graph.py
        ),
        ("none", r": its backward gave pred no gradient \(None\): the model would learn nothing from it"),
    ],
)
def test_a_backward_that_fails_is_one_line_naming_the_strategy(user_dir, attribute, match):
    module = user_module(user_dir, BACKWARD_FILE)
    strategy = get_strategy(f"{module}:{attribute}")
    pred, boxes = random_case(4, 8, "seed", seed=1)
    pred.requires_grad_()
    loss = strategy(pred, make_targets(boxes, "padded", 8))
    with pytest.raises(OutsideStrategyError, match=rf"^strategy '{module}:{attribute}'" + match.format(module=module)):
        strategy.backward(loss * 2)  # the step's scaling of the loss lies between: still the user's backward


def test_a_backward_of_nan_is_said_where_the_host_reads_it_and_a_sound_one_passes(user_dir):
    module = user_module(user_dir, BACKWARD_FILE + GIOU_FILE)
    nan, sound = get_strategy(f"{module}:nan"), get_strategy(f"{module}:loss")
    pred, boxes = random_case(4, 8, "seed", seed=1)
    targets = make_targets(boxes, "padded", 8)
    nan.backward(nan(pred.clone().requires_grad_(), targets))  # no host wait in the step itself
    with pytest.raises(
        OutsideStrategyError, match=r": its backward gave pred a non-finite gradient \(NaN or infinity\) where the loss"
    ):
        nan.nonfinite_gradient()
    nan.nonfinite_gradient()  # read and cleared
    leaf = pred.clone().requires_grad_()
    sound.backward(sound(leaf, targets))
    sound.nonfinite_gradient()
    expected = pred.clone().requires_grad_()
    giou_loss_reference(expected, targets).backward()
    torch.testing.assert_close(leaf.grad, expected.grad)  # the watch changes no gradient


@pytest.mark.parametrize(
    "argv",
    [
        ["profile", "profile.strategy={}", "device=cpu", *TINY_PROFILE],
        ["train", "train.strategy={}", "train.steps=20", "device=cpu", *TINY_PROFILE[:6]],  # log_every: 10
        ["bench", "bench.strategies=[{}]", "bench.batch_sizes=[4]", "bench.repeats=1", "bench.warmup=0", "preset=cpu"],
    ],
    ids=lambda argv: argv[0],
)
@pytest.mark.parametrize("attribute", ["raises", "none", "nan"])
def test_profile_train_and_bench_say_a_broken_backward_in_one_line_and_exit_2(
    user_dir, capfd, monkeypatch, argv, attribute
):
    module = user_module(user_dir, BACKWARD_FILE)
    monkeypatch.delenv("DETECTOR_DEBUG", raising=False)
    assert cli.main([arg.format(f"{module}:{attribute}") for arg in argv]) == 2
    err = capfd.readouterr().err.strip()  # the process's stderr: torch's own C++ warnings land there too
    assert err.startswith(f"error: strategy '{module}:{attribute}': its backward ") and "\n" not in err, err


def test_an_unknown_name_mentions_a_loss_of_ones_own():
    with pytest.raises(KeyError, match=r"valid strategies: loop, .* or my_module:my_loss"):
        get_strategy("ciou")


def test_entry_points_of_installed_packages_register_under_their_names(user_dir, monkeypatch):
    module = user_module(user_dir)
    points = [
        importlib.metadata.EntryPoint("ciou_like", f"{module}:loss", registry.ENTRY_POINTS),
        importlib.metadata.EntryPoint("broken", f"{module}:missing", registry.ENTRY_POINTS),
    ]
    found = lambda group: points if group == "detector.strategies" else []  # noqa: E731
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", found)
    assert get_strategy("ciou_like").name == "ciou_like" and "ciou_like" in STRATEGIES
    with pytest.raises(OutsideStrategyError, match=rf"'broken' \({module}:missing, entry point of detector.strateg"):
        get_strategy("broken")
    points.pop()
    assert "ciou_like" in list(KnownStrategies()) and len(KnownStrategies()) == len(STRATEGIES)


def test_the_configuration_takes_a_strategy_from_outside_and_refuses_a_broken_one(user_dir):
    module = user_module(user_dir)
    cfg = load_config(["preset=cpu", f"profile.strategy={module}:loss"], announce=None, strategies=KnownStrategies())
    assert cfg.profile.strategy == f"{module}:loss" and f"{module}:loss" in STRATEGIES
    with pytest.raises(OutsideStrategyError, match="has no 'lost'"):
        load_config(["preset=cpu", f"bench.strategies=[padded,{module}:lost]"], strategies=KnownStrategies())
    with pytest.raises(ValueError, match="profile.strategy='ciou' is out of range: allowed one of loop, concat"):
        load_config(["preset=cpu", "profile.strategy=ciou"], announce=None, strategies=KnownStrategies())


# ----------------------------------------------------------------------------- per_box_loss


def test_per_box_loss_keeps_the_contract_around_any_term():
    loss = per_box_loss(lambda p, t: giou_loss_per_box(p, t) + 1 / (p[..., 2] - p[..., 0]))  # infinite at zero width
    assert loss.layout == "padded" and loss.description.startswith("the mean of <lambda>")
    pred, boxes = random_case(5, 12, "seed", torch.bfloat16, seed=4)  # padded slots NaN
    targets = make_targets(boxes, "padded", 12)
    p = pred.clone().requires_grad_()
    value = loss(p, targets)
    value.backward()
    assert value.dtype == torch.float32 and p.grad.dtype == torch.bfloat16
    valid = torch.arange(12) < targets.counts[:, None]
    assert torch.isfinite(value) and torch.all(p.grad[~valid] == 0) and torch.isfinite(p.grad).all()
    empty = make_targets([torch.zeros(0, 4)] * 5, "padded", 12)
    zero = loss(p, empty)
    zero.backward()
    assert zero.item() == 0.0 and zero.requires_grad
    assert loss.reference(pred.double(), targets).dtype == torch.float64


def test_the_contract_grid_fails_a_loss_that_lets_padding_in_and_one_that_scales_its_targets(user_dir):
    """The documented entry (pytest --strategy) on a loss that multiplies by the mask instead of selecting (the NaN
    of padded slots reaches the loss), and on one that scales the caller's list targets in place before an exact
    GIoU (the targets it is handed are the boxes the reference would read): the grid fails both, naming why."""
    module = user_module(
        user_dir,
        """
        from detector.losses import STRATEGIES
        from detector.losses.geometry import giou_loss_per_box


        def leaky(pred, targets):
            boxes, counts = targets
            valid = (torch.arange(pred.shape[1]) < counts[:, None]).float()
            return (giou_loss_per_box(pred, boxes) * valid).sum() / valid.sum().clamp(min=1)


        def scaled(pred, targets):
            for boxes in targets.boxes:
                boxes.copy_((boxes * 1.01).to(boxes.dtype))
            return STRATEGIES["concat"].fn(pred, targets)


        import torch
        leaky.layout = "padded"
        scaled.layout = "list"
        """,
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "float32-uint8-7-seed"]
    command += [str(ROOT / "tests/losses/test_strategies.py"), "--strategy", f"{module}:leaky"]
    command += ["--strategy", f"{module}:scaled"]
    result = subprocess.run(command, cwd=user_dir, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:]
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert any(f"[{module}:leaky-" in line for line in failed) and any(f"[{module}:scaled-" in line for line in failed)
    assert f"{module}:scaled wrote to its input targets.boxes[" in result.stdout
    command[-1] = "nowhere_at_all:loss"
    unknown = subprocess.run(command, cwd=user_dir, env=child_env(), capture_output=True, text=True)
    assert unknown.returncode == 4 and "--strategy nowhere_at_all:loss: strategy 'nowhere_at_all:loss': no module" in (
        unknown.stderr
    )
