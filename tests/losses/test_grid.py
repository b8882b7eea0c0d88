"""The contract grid (tests/losses/test_strategies.py) fails a wrong loss: one that writes to its inputs, and ones
a little off the contract (1 % everywhere, in the gradient only, in fp32 only, a mean per image). The losses are
built here from the padded and concat strategies; the grid's rows run in-process, on the CPU."""

import pytest
import torch
from test_strategies import ROWS, check_against_reference

from detector.data.targets import PaddedTargets
from detector.lab.measure.cases import random_case
from detector.losses import STRATEGIES, Strategy

padded, concat = STRATEGIES["padded"].fn, STRATEGIES["concat"].fn


def grid(strategy: Strategy) -> list[str]:
    """What the grid says of ``strategy``: ``row: the first line of its failure`` for each row it fails."""
    failed = []
    for pred_dtype, target_dtype, batch, distribution, max_boxes, seed in ROWS:
        pred, boxes = random_case(batch, max_boxes, distribution, pred_dtype, target_dtype, seed=seed)
        try:
            check_against_reference(strategy, pred, boxes, max_boxes, "cpu")
        except AssertionError as err:
            row = f"{str(pred_dtype)[6:]}-{str(target_dtype)[6:]}-{batch}-{distribution}-{max_boxes}"
            failed.append(f"{row}: {str(err).splitlines()[0]}")
    return failed


def scales_targets(pred, targets):
    """The list targets' boxes scaled by 1.01 in place, then an exact GIoU of the scaled boxes."""
    for boxes in targets.boxes:
        boxes.copy_((boxes * 1.01).to(boxes.dtype))
    return concat(pred, targets)


def moves_pred(pred, targets):
    """pred moved by a pixel where autograd does not see it, then an exact GIoU of the moved boxes."""
    pred.data += 1
    return padded(pred, targets)


def caps_the_counts(pred, targets):
    """The counts cut to one box an image in place, then an exact GIoU of the boxes left."""
    targets.counts.clamp_(max=1)
    return padded(pred, targets)


def uniform(pred, targets):
    return padded(pred, targets) * 1.01


def gradient_only(pred, targets):
    loss = padded(pred, targets)
    return loss + 0.01 * (loss - loss.detach())  # the value exact, the gradient 1.01 times


def fp32_only(pred, targets):
    return padded(pred, targets) * (1.01 if pred.dtype == torch.float32 else 1.0)


def per_image_mean(pred, targets):
    """Each image's mean GIoU loss, then their mean: images with few boxes weigh more than the contract's."""
    boxes, counts = targets
    return torch.stack(
        [padded(pred[b : b + 1], PaddedTargets(boxes[b : b + 1], counts[b : b + 1])) for b in range(len(counts))]
    ).mean()


@pytest.mark.parametrize(
    "fn, layout, tensor",
    [
        (scales_targets, "list", "targets.boxes["),
        (moves_pred, "padded", "pred"),
        (caps_the_counts, "padded", "targets.counts"),
    ],
    ids=["targets.boxes", "pred", "targets.counts"],
)
def test_a_loss_that_writes_to_its_inputs_fails_naming_the_tensor(fn, layout, tensor):
    failed = grid(Strategy(fn.__name__, layout, fn, fn.__doc__))
    assert failed, "the grid passed a loss that writes to its inputs"
    assert all(f"wrote to its input {tensor}" in line for line in failed), "\n".join(failed)


@pytest.mark.parametrize("fn", [uniform, gradient_only, fp32_only, per_image_mean], ids=lambda fn: fn.__name__)
def test_a_loss_a_little_off_the_contract_fails(fn):
    assert grid(Strategy(fn.__name__, "padded", fn, "wrong on purpose")), f"the grid passed {fn.__name__}"


def test_the_exact_losses_these_are_built_from_pass_every_row():
    """The failures above are the losses', not the harness's."""
    for name, layout in (("padded", "padded"), ("concat", "list")):
        assert grid(Strategy(name, layout, STRATEGIES[name].fn, name)) == []
