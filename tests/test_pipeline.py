"""End to end: `make profile` on a tiny config, `compare`, and the TensorBoard plugin patch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from detector.compare import run_compare
from detector.config import load_config
from detector.runs import latest_run

ROOT = Path(__file__).resolve().parent.parent
TINY = "data.batch_size=4 data.image_size=32 model.hidden=16 profile.wait=1 profile.warmup=1 profile.active=2"


def make_profile(strategy: str, mode: str, out_dir: Path) -> dict:
    args = f"{TINY} profile.out_dir={out_dir}"
    cmd = ["make", "-s", "profile", f"PY={sys.executable}", f"STRATEGY={strategy}", f"MODE={mode}", f"ARGS={args}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "preset: cpu" in result.stdout or "preset: seed_scale" in result.stdout
    folder = latest_run(out_dir / (strategy if mode == "train" else f"{strategy}-forward"))
    return json.loads((folder / "summary.json").read_text()) | {"folder": folder}


@pytest.mark.slow
def test_make_profile_sets_itself_up_and_writes_a_run(tmp_path):
    summary = make_profile("padded", "train", tmp_path)
    assert summary["strategy"] == "padded" and (summary["folder"] / summary["trace"]).exists()


@pytest.mark.slow
def test_compare_prints_a_table_and_writes_a_png(tmp_path, capsys):
    make_profile("padded", "forward", tmp_path)
    make_profile("concat", "forward", tmp_path)
    table = run_compare(tmp_path, tmp_path / "chart.png")
    assert "| calc loss |" in table and "padded" in table and "concat" in table and "(1.00x)" in table
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_without_runs_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="make profile"):
        run_compare(tmp_path)


def test_unknown_preset_and_experiment_list_the_known_ones():
    with pytest.raises(FileNotFoundError, match="known presets: auto, cpu, seed_scale"):
        load_config(["preset=huge"], announce=None)
    with pytest.raises(FileNotFoundError, match="known experiments"):
        load_config([], experiment="no_such_experiment", announce=None)


def test_cpu_preset_differs_only_where_its_yaml_says():
    cpu = load_config(["preset=cpu"], announce=None)
    seed = load_config(["preset=seed_scale"], announce=None)
    assert (cpu.data.image_size, seed.data.image_size) == (64, 256)
    assert cpu.data.max_boxes == seed.data.max_boxes == 256
    assert OmegaConf.to_container(cpu.profile) == OmegaConf.to_container(seed.profile)


def test_tensorboard_launcher_maps_new_runtime_categories():
    from torch_tb_profiler.profiler import trace

    from detector.board import patch_profiler_plugin

    patch_profiler_plugin()
    for category in ("cuda_runtime", "cuda_driver"):
        event = {"ph": "X", "cat": category, "name": "cudaLaunchKernel", "ts": 1, "dur": 2, "pid": 1, "tid": 1}
        parsed = trace.create_event(event, False)
        assert parsed is not None and parsed.type == trace.EventTypes.RUNTIME
