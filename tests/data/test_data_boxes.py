"""Images drawn over the boxes of an annotation file (data.boxes, detector/data/synthetic.py's BoxFileSampler), through
the configuration (detector/config/schema.py reads the file and sets the slots) and the loader, in every layout."""

import os
import shlex
import subprocess

import numpy as np
import pytest
import torch
from annotation_helpers import coco_json, widerface_text, write_coco
from conftest import ROOT
from omegaconf import OmegaConf

from detector.config.schema import DataConfig, load_config
from detector.data import BoxFileSampler, FaceSampler, build_loader, build_sampler
from detector.data.annotations import AnnotationError, fit_boxes, read_annotations
from detector.data.targets import to_padded
from detector.errors import ConfigError

COUNTS = [3, 0, 9, 1, 0, 2, 5, 4]  # two empty images, one over 8 slots


@pytest.fixture
def source(tmp_path) -> str:
    (tmp_path / "gt.txt").write_text(widerface_text(COUNTS, seed=2))
    return f"widerface:{tmp_path / 'gt.txt'}"


def data_cfg(source, **overrides):
    base = {"boxes": source, "image_size": 32, "batch_size": 4, "length": 16, "max_boxes": 8, "num_workers": 0}
    return OmegaConf.merge(OmegaConf.structured(DataConfig), base | overrides)


def test_each_sample_shows_one_of_the_files_images_with_its_boxes(source):
    sampler = build_sampler(data_cfg(source))
    assert isinstance(sampler, BoxFileSampler) and sorted(sampler.order.tolist()) == list(range(len(COUNTS)))
    fitted = fit_boxes(read_annotations(source), 32, 8)
    shown = [sampler.image_of(i) for i in range(16)]
    assert shown[:8] == sampler.order.tolist() and shown[8:] == shown[:8]  # through the file once every 8 samples
    for i in range(16):
        image, boxes = sampler(i)
        assert image.shape == (1, 32, 32) and image.dtype == torch.uint8 and boxes.dtype == torch.uint8
        assert torch.equal(boxes, torch.from_numpy(fitted.of(shown[i])))
        for x1, y1, x2, y2 in boxes.long().tolist():  # a face's centre pixel is drawn bright (>= 170)
            assert image[0, (y1 + y2) // 2, (x1 + x2) // 2] >= 170
        again, _ = sampler(i)
        assert torch.equal(image, again)  # a pure function of (seed, i)
    assert not torch.equal(sampler(0)[0], sampler(8)[0])  # the same boxes, another background and levels


@pytest.mark.parametrize("layout", ["list", "padded", "packed"])
def test_the_loader_batches_the_files_boxes_cut_to_the_slots(source, layout):
    cfg = data_cfg(source, num_workers=2)
    sampler, fitted = build_sampler(cfg), fit_boxes(read_annotations(source), 32, 8)
    batches = list(build_loader(cfg, layout, torch.device("cpu")))
    assert len(batches) == 4
    for b, (images, targets) in enumerate(batches):
        padded = to_padded(targets, 8)
        expected = [fitted.of(sampler.image_of(4 * b + k)) for k in range(4)]
        assert padded.counts.tolist() == [len(e) for e in expected] and max(padded.counts.tolist()) <= 8
        for k, e in enumerate(expected):
            assert torch.equal(padded.boxes[k, : len(e)], torch.from_numpy(e))
            assert torch.equal(images[k], sampler(4 * b + k)[0])  # the workers draw what the sampler draws
    seen = torch.cat([to_padded(t, 8).counts for _, t in batches])
    assert (seen == 0).sum() == 4  # the empty images, twice each


def test_coco_images_are_drawn_too(tmp_path):
    path = write_coco(tmp_path / "c.json", coco_json([2, 0, 4]))
    images, targets = next(iter(build_loader(data_cfg(f"coco:{path}", batch_size=3), "packed", "cpu")))
    assert images.shape == (3, 1, 32, 32) and sorted(targets.counts.tolist()) == [0, 2, 4]


def test_the_configuration_reads_the_file_and_sets_the_slots(source):
    lines = []
    cfg = load_config(["preset=cpu", f"data.boxes={source}", "data.max_boxes=8"], announce=lines.append)
    assert cfg.data.max_boxes == 8
    assert lines[1] == (
        f"data.boxes={source}: 8 images, 24 boxes (0–9 an image, 3.0 on average, 2 images without any); 1 image "
        "over data.max_boxes=8: 1 box dropped, the smallest of each (data.over_max_boxes=truncate; =fit sets "
        "max_boxes from the data)"
    )
    fit = load_config(["preset=cpu", f"data.boxes={source}", "data.over_max_boxes=fit"], announce=None)
    assert fit.data.max_boxes == 9
    _, targets = next(iter(build_loader(fit.data, "padded", "cpu")))
    assert targets.boxes.shape[1] == 9
    with pytest.raises(AnnotationError, match=r"1 image over data.max_boxes=8 \(the most: 9, "):
        load_config(["preset=cpu", f"data.boxes={source}", "data.max_boxes=8", "data.over_max_boxes=refuse"])


def test_a_sampler_whose_slots_were_not_set_from_the_data_refuses_instead_of_cutting(source):
    with pytest.raises(AnnotationError, match="data.max_boxes=8"):
        build_sampler(data_cfg(source, over_max_boxes="fit"))  # fit, but max_boxes never set from the data


@pytest.mark.parametrize(
    "override,match",
    [
        ("data.boxes=voc:x.xml", r"data.boxes='voc:x.xml' is out of range: allowed synthetic, coco:"),
        ("data.over_max_boxes=drop", r"data.over_max_boxes='drop' is out of range: allowed one of truncate, fit"),
    ],
)
def test_bad_data_values_are_one_config_line(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(["preset=cpu", override], announce=None)


def test_a_path_is_taken_as_written_hash_spaces_and_all(tmp_path):
    """As YAML, ``ann #1.json`` would be ``ann`` and a comment: both files exist here, and hold different images."""
    write_coco(tmp_path / "ann", coco_json([0] * 5))
    named = write_coco(tmp_path / "ann #1.json", coco_json([2]))
    overrides = [f"data.boxes=coco:{named}", f"profile.out_dir={tmp_path}/runs #2/${{x}}", "train.out_dir='my runs'"]
    cfg = load_config(["preset=cpu", *overrides], announce=None)
    assert cfg.data.boxes == f"coco:{named}" and read_annotations(cfg.data.boxes).counts.tolist() == [2]
    assert cfg.profile.out_dir == f"{tmp_path}/runs #2/${{x}}" and cfg.train.out_dir == "my runs"
    assert load_config(["preset=cpu", "data.batch_size=3 # a comment"], announce=None).data.batch_size == 3  # YAML
    with pytest.raises(ConfigError, match=r"'train.out_dir=': train.out_dir names a file or folder, and the name is e"):
        load_config(["preset=cpu", "train.out_dir="], announce=None)
    with pytest.raises(AnnotationError, match=r"^data.boxes=coco:\S+/nope #1.json: cannot read \S+/nope #1.json \("):
        load_config(["preset=cpu", f"data.boxes=coco:{tmp_path}/nope #1.json"], announce=None)


def test_synthetic_boxes_stay_the_default_and_bit_identical():
    cfg = load_config(["preset=cpu"], announce=None)
    assert cfg.data.boxes == "synthetic" and cfg.data.over_max_boxes == "truncate"
    sampler = build_sampler(cfg.data)
    assert isinstance(sampler, FaceSampler)
    image, boxes = sampler(5)
    again = FaceSampler(cfg.data.image_size, cfg.data.max_boxes, 0, 3.0, cfg.data.tail_fraction, 32)(5)
    assert torch.equal(image, again[0]) and torch.equal(boxes, again[1])
    assert np.array_equal(sampler.draw(5, np.empty((16, 16), np.uint8)), boxes.numpy())


def test_make_passes_a_boxes_path_with_spaces_and_a_hash_whole():
    """`make profile BOXES="coco:my data/ann #1.json"`: one argument, as written (make -n prints the command)."""
    printed = subprocess.run(
        ["make", "-n", "profile", "PY=python3", "BOXES=coco:my data/ann #1.json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")},
    ).stdout
    assert shlex.split(printed.splitlines()[0])[-1] == "data.boxes=coco:my data/ann #1.json"
