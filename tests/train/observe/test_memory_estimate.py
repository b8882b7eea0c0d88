"""What cannot fit (detector/train/observe/memory_estimate.py): train, profile and bench step refuse in one line,
before anything is allocated, a size that cannot fit host or device memory, with each part's figure and a margin
below what is available; the loader refuses a ring that cannot fit, and a batch larger than the data is one line."""

import re
import time

import pytest
import torch
from conftest import fails_after
from fault_helpers import one_error_line

from detector import data
from detector.cli import main as cli
from detector.config.schema import load_config
from detector.data.host_memory import GIB, MemoryRefusal
from detector.train.observe.memory_estimate import check_command_memory, check_run_memory, run_memory


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test after 120 s instead of blocking the suite."""
    with fails_after(120):
        yield


# ----------------------------------------------------------------------------- sizes that cannot fit


def test_a_batch_that_cannot_fit_is_refused_before_anything_is_allocated(capsys):
    start = time.monotonic()
    assert cli.main(["train", "--experiment", "cpu_smoke", "data.batch_size=100000000", "train.steps=2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert time.monotonic() - start < 30
    assert "this run needs at least" in line and "GiB available (MemAvailable)" in line
    assert "the loader's ring of batch slots" in line and "lower data.batch_size" in line


def test_the_estimate_names_each_part_and_the_memory_available(monkeypatch):
    cfg = load_config(["preset=cpu", "data.batch_size=2000000", "data.image_size=64", "data.num_workers=1"])
    need = run_memory(cfg, 1, torch.device("cpu"))
    assert need["the loader's ring of batch slots"] == 4 * 2_000_000 * 64 * 64  # 2 slots a worker, 2 more
    assert need["the held-out images"] == 4 * 2_000_000 * 64 * 64  # train.eval_batches batches
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 23 * GIB)
    with pytest.raises(MemoryRefusal) as err:
        check_run_memory(cfg, 1, torch.device("cpu"))
    message = str(err.value)
    assert f"needs at least {sum(need.values()) / GIB:.1f} GiB of memory" in message
    assert "the loader's ring of batch slots 30.5 GiB" in message and "has 23.0 GiB available" in message
    assert "of which a command may take 2/3, 15.3 GiB" in message
    small = load_config(["preset=cpu"])
    check_run_memory(small, 1, torch.device("cpu"))  # the CPU preset fits


def test_the_loader_refuses_a_ring_that_cannot_fit(monkeypatch):
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: GIB)
    cfg = load_config(["preset=cpu", "data.batch_size=1000000", "data.image_size=64", "data.num_workers=0"])
    # 7.6 GiB of images and 0.5 of target areas (64 slots of 4 uint8 coordinates an image)
    with pytest.raises(
        MemoryRefusal, match=r"of 2 slots for batches of \[1000000, 1, 64, 64\] uint8 and their targets needs 8.1"
    ):
        next(iter(data.build_loader(cfg.data, "padded", "cpu")))


def test_on_a_gpu_the_model_is_checked_against_its_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * GIB, 80 * GIB))  # no GPU here: mocked
    cfg = load_config(["preset=seed_scale"])  # the ~1.1 B-parameter detector: 17.5 GB of state
    with pytest.raises(MemoryRefusal, match=r"needs at least \d+\.\d GiB on cuda:0 .* but it has 4.0 GiB free"):
        check_run_memory(cfg, 1, torch.device("cuda:0"))


def test_a_margin_is_kept_below_the_memory_available(monkeypatch):
    """16 GiB asked with 22 GiB available heads for the out-of-memory killer: refused; with 25 GiB it fits."""
    cfg = load_config(["preset=cpu", "data.image_size=64", "data.num_workers=0", "data.batch_size=70000"])
    need = sum(run_memory(cfg, 1, torch.device("cpu")).values())
    assert 15 * GIB < need < 16.5 * GIB  # about 16 GiB, most of it the activations
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 22 * GIB)
    with pytest.raises(MemoryRefusal, match=r"this run needs at least 1\d\.\d GiB .* has 22\.0 GiB available"):
        check_run_memory(cfg, 1, torch.device("cpu"))
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 25 * GIB)
    check_run_memory(cfg, 1, torch.device("cpu"))


@pytest.mark.parametrize(
    "command", [["profile", "profile.timed=0"], ["bench", "step"], ["train", "train.steps=2", "train.eval_batches=1"]]
)
def test_each_command_refuses_what_cannot_fit_in_one_line_before_allocating_it(command, tmp_path, monkeypatch, capsys):
    """16 GiB of activations with 12 GiB available: refused with the figures by profile, bench step and train alike,
    before a model is built or a folder written."""
    monkeypatch.setattr("detector.data.host_memory.available_memory", lambda: 12 * GIB)
    where = {"profile": "profile.out_dir", "bench": "bench.out", "train": "train.out_dir"}[command[0]]
    start = time.monotonic()
    size = ["device=cpu", "preset=cpu", "data.image_size=64", "data.batch_size=80000", "data.length=100000000"]
    assert cli.main([*command, *size, f"{where}={tmp_path / 'out'}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert time.monotonic() - start < 60 and not (tmp_path / "out").exists()
    subject = {"profile": "this profile", "bench": "bench step", "train": "this run"}[command[0]]
    assert re.match(rf"error: {subject} needs at least \d+\.\d GiB of memory \(", line), line
    assert re.search(r"the activations of a batch 1\d\.\d GiB.* has 12\.0 GiB available \(MemAvailable\)", line), line
    assert "lower data.batch_size" in line


@pytest.mark.parametrize("command", [["profile"], ["bench", "step"]])
def test_a_batch_larger_than_the_data_is_one_line(command, tmp_path, capsys):
    where = {"profile": "profile.out_dir", "bench": "bench.out"}[command[0]]
    out = f"{where}={tmp_path / 'out'}"
    assert cli.main([*command, "preset=cpu", "data.batch_size=2000000", "data.image_size=64", out]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "error: data.batch_size=2000000 is larger than data.length=1000000: not one batch can be drawn; lower "
        "data.batch_size or raise data.length"
    )
    if command == ["profile"]:  # 5 + 5 + 10 + 10 batches of the profiler's schedule and the timed steps
        assert cli.main(["profile", "preset=cpu", "data.batch_size=10", "data.length=100", out]) == 2
        assert one_error_line(capsys.readouterr().err) == (
            "error: this profile reads 30 batches of data.batch_size=10 images (300), more than data.length=100: "
            "raise data.length"
        )
    assert not (tmp_path / "out").exists()


def test_on_a_gpu_a_profile_is_checked_against_its_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * GIB, 80 * GIB))  # no GPU here: mocked
    cfg = load_config(["preset=seed_scale"])  # 17.5 GB of weights, gradients and AdamW's moments
    with pytest.raises(MemoryRefusal, match=r"this profile needs at least \d+\.\d GiB on cuda:0 \(the model with"):
        check_command_memory(cfg, torch.device("cuda:0"), "profile", batches=30)
    forward = load_config(["preset=seed_scale", "profile.mode=forward", "data.batch_size=64"])  # weights only
    check_command_memory(forward, torch.device("cuda:0"), "profile", batches=30)
