"""The three target layouts and make_targets: shapes, dtypes (promotion, never wrapping), bad input."""

import numpy as np
import pytest
import torch

from detector.data.targets import ListTargets, PackedTargets, PaddedTargets, make_targets, to_padded
from detector.losses import STRATEGIES, giou_loss_reference

BOXES = [
    torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8),
    torch.zeros(0, 4, dtype=torch.uint8),
    torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.uint8),
]


def test_make_targets_layouts():
    padded = make_targets(BOXES, "padded", 3)
    assert isinstance(padded, PaddedTargets) and padded.boxes.shape == (3, 3, 4) and padded.boxes.dtype == torch.uint8
    assert padded.counts.tolist() == [1, 0, 2]
    assert torch.equal(padded.boxes[2, :2], BOXES[2]) and torch.all(padded.boxes[1] == 0)
    packed = make_targets(BOXES, "packed", 3)
    assert isinstance(packed, PackedTargets) and packed.boxes.shape == (3, 4) and packed.counts.tolist() == [1, 0, 2]
    listed = make_targets(BOXES, "list", 3)
    assert isinstance(listed, ListTargets) and [len(b) for b in listed.boxes] == [1, 0, 2]
    for targets in (padded, packed, listed):
        assert targets.batch_size == 3
        again = to_padded(targets, 3)
        assert torch.equal(again.boxes, padded.boxes) and torch.equal(again.counts, padded.counts)


def test_make_targets_rejects_bad_input():
    with pytest.raises(ValueError, match=r"image 2 has 2 boxes but there are only max_boxes=1 slots"):
        make_targets(BOXES, "padded", 1)
    with pytest.raises(ValueError, match=r"boxes_list\[0\] must have shape \[n, 4\]"):
        make_targets([torch.zeros(2, 3)], "packed", 4)
    with pytest.raises(ValueError, match="unknown target layout 'ragged'"):
        make_targets(BOXES, "ragged", 4)


# (dtypes and coordinates of two images, the dtype every image must share). The second image's values
# would wrap or round in the first one's dtype, which is what make_targets used to convert to.
PROMOTIONS = [
    ((torch.uint8, [1, 2, 3, 4]), (torch.float32, [0, 0, 300, 300]), torch.float32),  # 300 -> 44 in uint8
    ((torch.int64, [1, 2, 3, 4]), (torch.float32, [0, 0, 1.5, 2]), torch.float32),  # 1.5 -> 1 in int64
    ((torch.uint8, [1, 2, 3, 4]), (torch.int8, [-1, 0, 1, 2]), torch.int16),  # -1 -> 255 in uint8
    ((torch.int16, [1, 2, 3, 4097]), (torch.float16, [0, 0, 1, 2]), torch.float32),  # 4097 rounds in fp16
    ((torch.int64, [1, 2, 3, 2**24 + 1]), (torch.float32, [0, 0, 1, 2]), torch.float64),  # rounds in fp32
]


@pytest.mark.parametrize("layout", ["list", "padded", "packed"])
@pytest.mark.parametrize("first,second,expected", PROMOTIONS, ids=lambda v: str(v).replace("torch.", ""))
def test_make_targets_keeps_every_coordinate(first, second, expected, layout):
    empty = torch.zeros(0, 4)  # an empty image's dtype takes no part
    boxes_list = [torch.tensor([first[1]], dtype=first[0]), empty, torch.tensor([second[1]], dtype=second[0])]
    padded = to_padded(make_targets(boxes_list, layout, 2), 2)
    assert padded.boxes.dtype == expected
    assert padded.boxes[0, 0].double().tolist() == [float(v) for v in first[1]]
    assert padded.boxes[2, 0].double().tolist() == [float(v) for v in second[1]]


def test_mixed_dtype_images_give_the_loss_of_their_values():
    # image 1's target is pred's box exactly (loss 0); converted to image 0's uint8 it wrapped to 44
    boxes_list = [torch.tensor([[0, 0, 10, 10]], dtype=torch.uint8), torch.tensor([[0.0, 0.0, 300.0, 300.0]])]
    pred = torch.tensor([[[0, 0, 10, 10]], [[0, 0, 300, 300]]], dtype=torch.float32)
    for name in ("loop", "concat", "padded"):
        strategy = STRATEGIES[name]
        assert strategy(pred, make_targets(boxes_list, strategy.layout, 1)).item() == pytest.approx(0, abs=1e-6)


def test_integers_beyond_float64_next_to_floats_are_refused_naming_the_image():
    boxes_list = [torch.tensor([[0.5, 0, 1, 1]]), torch.tensor([[0, 0, 1, 2**60 + 1]])]
    with pytest.raises(ValueError, match=r"boxes_list\[1\] \(torch.int64\)"):
        make_targets(boxes_list, "padded", 1)


def test_make_targets_accepts_numpy_arrays_and_nested_lists():
    boxes_list = [np.array([[1, 2, 3, 4]], dtype=np.int16), [[5, 6, 7, 8.5], [1, 1, 2, 2]], []]
    padded = make_targets(boxes_list, "padded", 2)
    assert padded.boxes.dtype == torch.float32 and padded.counts.tolist() == [1, 2, 0]
    assert padded.boxes[1, 0].tolist() == [5, 6, 7, 8.5] and padded.boxes[0, 0].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "bad,error,message",
    [
        (object(), TypeError, r"boxes_list\[1\] must be a tensor, numpy array or nested list"),
        ([1, 2, 3, 4], ValueError, r"boxes_list\[1\] must have shape \[n, 4\]"),
        ([[1, 2, 3]], ValueError, r"boxes_list\[1\] must have shape \[n, 4\]"),
        (torch.zeros(2, 4, dtype=torch.bool), TypeError, r"boxes_list\[1\] must hold integer or floating"),
    ],
    ids=["object", "flat list", "three coordinates", "bool"],
)
def test_make_targets_names_the_bad_image(bad, error, message):
    with pytest.raises(error, match=message):
        make_targets([torch.zeros(1, 4), bad], "padded", 4)


def test_reference_and_loop_agree_on_hand_built_mixed_dtype_targets():
    # to_padded (inside the reference) goes through make_targets: it must not round 1.5 to image 0's int64
    targets = ListTargets([torch.tensor([[0, 0, 2, 2]]), torch.tensor([[0.0, 0.0, 1.5, 2.0]])])
    pred = torch.tensor([[[0, 0, 2, 2]], [[0, 0, 1.5, 2]]], dtype=torch.float64)
    assert giou_loss_reference(pred, targets).item() == pytest.approx(0.0, abs=1e-6)  # eps / area
    assert giou_loss_reference(pred, targets).item() == pytest.approx(STRATEGIES["loop"](pred, targets).item())


@pytest.mark.parametrize("layout", ["list", "padded", "packed"])
def test_every_layout_is_built_on_the_boxes_device(layout):
    """The "meta" device stands in for a GPU here: shapes and devices without data."""
    meta = [b.to("meta") for b in BOXES]
    meta[1] = torch.zeros(0, 4, dtype=torch.uint8)  # an empty image may be anywhere: it holds no data
    targets = make_targets(meta, layout, 3)
    tensors = targets.boxes if layout == "list" else list(targets)
    assert all(t.device.type == "meta" for t in tensors)
    shapes = {"list": [(1, 4), (0, 4), (2, 4)], "padded": [(3, 3, 4), (3,)], "packed": [(3, 4), (3,)]}[layout]
    assert [tuple(t.shape) for t in tensors] == shapes


def test_boxes_on_two_devices_are_refused_naming_two_images():
    boxes = [BOXES[0], BOXES[1], BOXES[2].to("meta")]
    with pytest.raises(ValueError, match=r"^boxes_list\[0\] is on cpu but boxes_list\[2\] is on meta: put every"):
        make_targets(boxes, "padded", 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["list", "padded", "packed"])
def test_cuda_boxes_give_cuda_targets_equal_to_the_cpu_ones(layout):
    on_gpu = make_targets([b.cuda() for b in BOXES], layout, 3)
    on_cpu = make_targets(BOXES, layout, 3)
    assert torch.equal(to_padded(on_gpu, 3).boxes.cpu(), to_padded(on_cpu, 3).boxes)
    assert all(t.is_cuda for t in (on_gpu.boxes if layout == "list" else on_gpu))
