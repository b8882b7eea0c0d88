"""End to end: `make profile` on a tiny config and `compare`; the presets."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from omegaconf import OmegaConf

from detector.cli import main as cli
from detector.config.schema import load_config
from detector.lab.compare import latest_runs
from detector.lab.record.comparison import read_comparison
from detector.lab.record.run import ProfileRecord

TINY = "data.batch_size=4 data.image_size=32 model.hidden=16 profile.wait=1 profile.warmup=1 profile.active=2"


def make_profile(strategy: str, mode: str, out_dir: Path) -> ProfileRecord:
    args = f"{TINY} profile.out_dir={out_dir}"
    cmd = ["make", "-s", "profile", f"PY={sys.executable}", f"STRATEGY={strategy}", f"MODE={mode}", f"ARGS={args}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "preset: cpu" in result.stdout or "preset: seed_scale" in result.stdout
    (run,) = [r for r in latest_runs(out_dir) if (r.strategy, r.mode) == (strategy, mode)]
    return run


@pytest.mark.slow
def test_make_profile_sets_itself_up_and_writes_a_run(tmp_path):
    summary = make_profile("padded", "train", tmp_path)
    assert summary.strategy == "padded" and (summary.folder / summary.trace).exists()


@pytest.mark.slow
def test_make_profile_then_compare_explains_the_difference(tmp_path, capsys):
    make_profile("padded", "forward", tmp_path)
    make_profile("concat", "forward", tmp_path)
    assert cli.main(["compare", "--dir", str(tmp_path), "--out", str(tmp_path / "compare")]) == 0
    table = (tmp_path / "compare" / "compare.md").read_text()
    assert "padded" in table and "concat" in table and "| calc loss |" in table
    result = read_comparison(tmp_path / "compare")
    assert [run.strategy for run in result.runs][:2] == ["padded", "concat"]  # the baseline first
    assert list((tmp_path / "compare").glob("events.out.tfevents.*"))


def test_unknown_preset_and_experiment_list_the_known_ones():
    with pytest.raises(FileNotFoundError, match="known presets: auto, cpu, seed_scale"):
        load_config(["preset=huge"], announce=None)
    with pytest.raises(FileNotFoundError, match="known experiments"):
        load_config([], experiment="no_such_experiment", announce=None)


def test_cpu_preset_differs_only_where_its_yaml_says():
    cpu = load_config(["preset=cpu"], announce=None)
    seed = load_config(["preset=seed_scale"], announce=None)
    assert (cpu.data.image_size, seed.data.image_size) == (16, 256)
    assert (cpu.data.max_boxes, seed.data.max_boxes) == (64, 256)
    assert OmegaConf.to_container(cpu.profile) == OmegaConf.to_container(seed.profile)
