"""``detector.bench.run(cfg, target)`` on the CPU: the losses target, GPU-only targets, unknown targets."""

import json

import pytest
import torch

from detector import bench
from detector.config import load_config
from detector.losses import STRATEGIES


def bench_config(tmp_path, *overrides):
    base = ["device=cpu", "data.max_boxes=16", "bench.warmup=1", "bench.repeats=3", f"bench.out={tmp_path}/bench.json"]
    return load_config(base + list(overrides), announce=None)


def test_losses_writes_medians_with_spreads(tmp_path, capsys):
    cfg = bench_config(
        tmp_path, "bench.batch_sizes=[8]", "bench.distributions=[seed]", "bench.strategies=[padded,concat]"
    )
    records = bench.run(cfg, "losses")
    assert [r["strategy"] for r in records] == ["padded", "concat"]
    saved = json.loads((tmp_path / "losses.json").read_text())
    assert saved["device"] == "cpu" and saved["torch"] == torch.__version__ and saved["target"] == "losses"
    assert saved["config"]["strategies"] == ["padded", "concat"] and saved["config"]["repeats"] == 3
    for r in saved["results"]:
        for key in ("forward_ms", "forward_backward_ms"):
            t = r[key]
            assert 0 < t["low"] <= t["median"] <= t["high"] and t["n"] == 3
        assert r["graph_forward_backward_ms"] is None  # no CUDA graphs on the CPU
    out = capsys.readouterr().out
    assert "| strategy | batch | boxes | valid | fwd ms |" in out and "| padded | 8 | seed |" in out
    assert "[" in out.split("| padded | 8 | seed |")[1].splitlines()[0]  # a spread beside the median


def test_losses_times_every_registered_strategy(tmp_path):
    cfg = bench_config(tmp_path, "bench.batch_sizes=[3]", "bench.distributions=[seed,zero]")
    records = bench.run(cfg, "losses")
    runnable = {name for name, s in STRATEGIES.items() if not s.unavailable(torch.device("cpu"))}
    assert {r["strategy"] for r in records} == runnable
    assert all(r["forward_ms"].median > 0 and r["forward_backward_ms"].median > 0 for r in records)
    assert len(json.loads((tmp_path / "losses.json").read_text())["results"]) == len(records)


@pytest.mark.parametrize("target", ["kernels", "layers"])
def test_gpu_only_targets_say_so_in_one_line_on_the_cpu(tmp_path, capsys, target):
    assert bench.run(bench_config(tmp_path), target) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"bench {target}: needs a CUDA device" in out
    assert not list(tmp_path.iterdir())


def test_unknown_target_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown bench target 'kernel'; valid targets: losses, kernels, layers"):
        bench.run(bench_config(tmp_path), "kernel")
    assert issubclass(bench.UnknownTargetError, ValueError)


def test_step_times_the_configs_training_step_and_the_data_pipeline(tmp_path, capsys):
    tiny = ["data.batch_size=4", "data.image_size=32", "model.channels=[4,8]", "model.hidden=16"]
    results = bench.run(bench_config(tmp_path, *tiny, "bench.max_seconds=1"), "step")
    assert list(results["steps"]) == ["config"]  # the speed-option variants and the floor are a GPU's
    pieces = results["steps"]["config"]
    assert list(pieces) == ["step", "forward", "forward+backward", "optimizer"]
    assert all(s.median > 0 for s in pieces.values()) and results["floor"] is None
    assert results["data_images_per_s"] > 0 and results["sampler_images_per_s"] > 0
    out = capsys.readouterr().out
    assert "| config | step |" in out and "images/s drawn" in out
    assert json.loads((tmp_path / "step.json").read_text())["target"] == "step"
