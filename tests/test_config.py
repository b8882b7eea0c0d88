"""Configuration: every value checked at load, and every mistake one ConfigError line naming it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env

from detector.config.device import resolve_device
from detector.config.schema import EXPERIMENTS_DIR, Config, load_config
from detector.errors import ConfigError, UserError
from detector.losses import STRATEGIES
from detector.model import build_model
from detector.train.run.speed_options import build_trained_model


def load(*overrides, experiment=None):
    return load_config(list(overrides), experiment, announce=None, strategies=STRATEGIES)


def assert_one_line(err: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(err.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize("experiment", sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")))
def test_every_experiment_loads_and_passes_the_checks(experiment):
    load(experiment=experiment)


# (override, what the one line must say): values that crashed mid-run or after training, or were clamped
OUT_OF_RANGE = [
    ("train.log_every=0", ">= 1"),
    ("train.eval_every=0", ">= 1"),
    ("train.eval_batches=0", ">= 1"),
    ("train.steps=-1", ">= 1"),
    ("data.max_boxes=0", ">= 1"),
    ("data.batch_size=0", ">= 1"),
    ("profile.active=0", ">= 1"),
    ("data.count_std=-0.5", ">= 0"),
    ("data.tail_fraction=1.5", "[0.0, 1.0]"),
    ("data.tail_fraction=-0.1", "[0.0, 1.0]"),
    ("data.num_workers=-2", ">= -1"),
    ("model.channels=[4,0]", ">= 1"),
    ("profile.mode=fwd", "one of train, forward"),
    ("bench.pred_dtype=int8", "one of float32, bfloat16, float16"),
    ("device=gpu", "auto, cpu, cuda or cuda:N"),
    ("device=mps", "auto, cpu, cuda or cuda:N"),  # a device torch names that none of our steps runs on
    ("model.head_blocks=-1", ">= 0"),
]


def test_a_load_leaves_the_next_loads_defaults_as_they_were():
    """Each load merges into a copy of the schema's defaults, built once a process: what one run sets, in its
    overrides or on the config it got, is not the next run's default (neither field is one a preset sets)."""
    defaults = Config().train
    first = load_config(["train.lr=0.5", "train.log_every=7"], announce=None)
    first.train.steps = defaults.steps + 1
    again = load_config([], announce=None)
    assert (first.train.lr, first.train.log_every) == (0.5, 7)
    assert (again.train.lr, again.train.log_every, again.train.steps) == (
        defaults.lr,
        defaults.log_every,
        defaults.steps,
    )


@pytest.mark.parametrize("override,allowed", OUT_OF_RANGE, ids=[o for o, _ in OUT_OF_RANGE])
def test_values_out_of_range_are_refused_at_load(override, allowed):
    field, value = override.split("=")
    with pytest.raises(ConfigError) as err:
        load(override)
    assert_one_line(err, field, value.split(",")[-1].strip("]"), allowed)


def test_an_image_size_the_model_cannot_pool_is_refused_at_load():
    with pytest.raises(ConfigError) as err:
        load("preset=cpu", "data.image_size=7")  # the CPU preset's model: 2 conv blocks
    assert_one_line(err, "data.image_size=7", "multiples of 4", "2 conv blocks (model.channels)")
    with pytest.raises(ConfigError) as err:
        load("preset=seed_scale", "data.image_size=40")
    assert_one_line(err, "data.image_size=40", "multiples of 16")
    assert load("preset=seed_scale", "data.image_size=48").data.image_size == 48


def test_more_head_blocks_than_hidden_units_are_refused():
    with pytest.raises(ConfigError) as err:
        load("model.hidden=8", "model.head_blocks=9")
    assert_one_line(err, "model.head_blocks=9", "1 to model.hidden (8)")
    assert load("model.hidden=8", "model.head_blocks=8").model.head_blocks == 8


def test_values_out_of_range_in_an_experiment_file_are_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  eval_every: 0\n")
    with pytest.raises(ConfigError) as err:
        load(experiment=str(path))
    assert_one_line(err, "train.eval_every=0", ">= 1")


def test_edges_of_the_ranges_are_allowed():
    cfg = load("data.num_workers=-1", "data.tail_fraction=1.0", "data.count_std=0", "train.checkpoint_every=0")
    assert cfg.data.num_workers == -1  # -1 = auto from the core count


@pytest.mark.parametrize(
    "override,parts",
    [
        ("train.strategy=nope", ["train.strategy='nope'", "all", "auto", "padded", "cuda_fused"]),
        ("profile.strategy=all", ["profile.strategy='all'", "one of loop"]),
        ("profile.strategy=auto", ["profile.strategy='auto'", "one of loop"]),  # auto is training's alone
        ("train.auto_candidates=[padded,nope]", ["train.auto_candidates=['padded', 'nope']", "one of loop"]),
        ("train.auto_candidates=[padded,auto]", ["train.auto_candidates=['padded', 'auto']", "one of loop"]),
        ("bench.strategies=[padded,nope]", ["bench.strategies=", "nope", "one of loop"]),
    ],
)
def test_strategy_fields_must_name_a_registered_strategy(override, parts):
    with pytest.raises(ConfigError) as err:
        load(override)
    assert_one_line(err, *parts)
    assert load("train.strategy=all", "profile.strategy=triton").train.strategy == "all"
    auto = load("train.strategy=auto", "train.auto_candidates=[packed,padded]").train
    assert (auto.strategy, list(auto.auto_candidates)) == ("auto", ["packed", "padded"])


def test_profile_lr_is_gone():
    with pytest.raises(ConfigError) as err:
        load("profile.lr=0.1")
    assert_one_line(err, "profile.lr", "ProfileConfig")


@pytest.mark.parametrize(
    "override,parts",
    [
        ("data.nope=1", ["data.nope", "Key 'nope' not in 'DataConfig'", "overrides"]),
        ("data.batch_size=abc", ["data.batch_size", "'abc'", "Integer"]),
        ("train.resume=maybe", ["train.resume", "one of auto, true, false"]),
        ("data=3", ["DataConfig", "overrides"]),
        ("data.batch_size", ["'data.batch_size' has no '='", "key=value"]),
        ("data..x=1", ["'data..x=1'", "not a key"]),
        ("=3", ["'=3'", "not a key"]),
        ("x=[1,2", ["'x=[1,2'", "not a YAML value"]),
    ],
)
def test_malformed_overrides_unknown_keys_and_wrong_types(override, parts):
    with pytest.raises(ConfigError) as err:
        load(override)
    assert_one_line(err, *parts)


def test_words_are_read_as_written_in_overrides_lists_and_files(tmp_path):
    """off, on, yes and no are words where a field takes words (YAML 1.1 read them as booleans, and a text field
    then held 'False'); a boolean field still takes them, and true and false stay booleans."""
    cfg = load("train.shard_optimizer=off", "report.sharding_modes=[off,blocks]", "bench.variants=[on, yes, no]")
    assert (cfg.train.shard_optimizer, list(cfg.report.sharding_modes)) == ("off", ["off", "blocks"])
    assert list(cfg.bench.variants) == ["on", "yes", "no"]
    flags = load("profile.sync_regions=on", "train.cudnn_benchmark=yes", "train.compile=off", "train.float8=no")
    assert (flags.profile.sync_regions, flags.train.cudnn_benchmark, flags.train.compile, flags.train.float8) == (
        True,
        True,
        False,
        False,
    )
    assert load("train.lr=1e-3").train.lr == 0.001  # a number, as OmegaConf reads it
    assert [load(f"train.shard_optimizer={v}").train.shard_optimizer for v in ("true", "false")] == ["blocks", "off"]
    path = tmp_path / "words.yaml"
    path.write_text("train:\n  shard_optimizer: off\n  cudnn_benchmark: no\nreport:\n  sharding_modes: [off, zero]\n")
    cfg = load(experiment=str(path))
    assert (cfg.train.shard_optimizer, cfg.train.cudnn_benchmark) == ("off", False)
    assert [load(f"train.resume={v}").train.resume for v in ("true", "false", "auto")] == ["true", "false", "auto"]
    assert list(cfg.report.sharding_modes) == ["off", "zero"]
    with pytest.raises(ConfigError) as err:
        load("report.sharding_modes=[off,nope]")
    assert_one_line(err, "report.sharding_modes=['off', 'nope']", "one of off, blocks, fsdp2, zero")


def test_missing_experiment_and_preset(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(experiment="no_such_experiment")
    assert_one_line(err, "no experiment 'no_such_experiment'", "known experiments: baseline")
    assert isinstance(err.value, FileNotFoundError)  # callers that caught FileNotFoundError still do
    with pytest.raises(ConfigError) as err:
        load("preset=huge")
    assert_one_line(err, "no preset 'huge'", "known presets: auto, cpu, seed_scale")


def test_an_experiment_given_as_a_path_is_that_file(tmp_path, monkeypatch):
    path = tmp_path / "some" / "dir" / "x.yaml"
    with pytest.raises(ConfigError) as err:
        load(experiment=str(path))
    assert_one_line(err, f"no experiment file {path}", f"looked for {path},")
    assert ".yaml.yaml" not in str(err.value)
    path.parent.mkdir(parents=True)
    path.write_text("train:\n  steps: 7\n")
    assert load(experiment=str(path)).train.steps == 7
    monkeypatch.chdir(tmp_path)
    assert load(experiment="some/dir/x.yaml").train.steps == 7  # relative to the working folder
    assert load(experiment="cpu_smoke.yaml").train.steps == load(experiment="cpu_smoke").train.steps  # experiments/


PARAMETERS = re.compile(r"(\d+(?:\.\d+)?) ([MB])-parameter")


@pytest.mark.parametrize("path", sorted(EXPERIMENTS_DIR.rglob("*.yaml")), ids=lambda p: p.name)
def test_the_parameter_counts_in_the_experiments_comments_are_true(path):
    """A figure in a comment is the model's: `1.47 M-parameter` rounds the count of the model the file builds."""
    comments = "".join(line.partition("#")[2] for line in path.read_text().splitlines())
    preset = [f"preset={path.stem}"] if path.parent.name == "presets" else []
    cfg = load(*preset, experiment=None if preset else path.stem)
    with torch.device("meta"):
        count = sum(p.numel() for p in build_model(cfg.model, cfg.data).parameters())
    for figure, unit in PARAMETERS.findall(comments):
        decimals = len(figure.partition(".")[2])
        assert round(count / {"M": 1e6, "B": 1e9}[unit], decimals) == float(figure), f"{figure} {unit}: {count:,}"


@pytest.mark.parametrize(
    "text,parts",
    [
        ("train: {steps: [1,\n", ["not valid YAML", "line 2"]),
        ("train:\n  steps: 3\n  steps: 4\n", ["not valid YAML", "duplicate key steps"]),
        ("- 1\n- 2\n", ["must hold a mapping"]),
        ("train:\n  stepz: 3\n", ["train.stepz", "Key 'stepz' not in 'TrainConfig'", "bad.yaml"]),
    ],
    ids=["yaml", "duplicate", "list", "unknown key"],
)
def test_broken_experiment_files(tmp_path, text, parts):
    path = Path(tmp_path / "bad.yaml")
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(experiment=str(path))
    assert_one_line(err, *parts)


def test_config_error_is_a_user_error_and_a_value_error():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)


def test_a_speed_default_that_cannot_run_for_the_model_steps_aside_in_one_line(monkeypatch):
    # the seed-scale defaults with a model whose second block (4 -> 8) the fused kernel does not take: on a GPU, and
    # in the Triton interpreter on the CPU, the first block still fuses
    said = []
    cfg = load_config(["preset=seed_scale", "model.channels=[4,8]", "model.hidden=16"], announce=said.append)
    assert cfg.train.fused_blocks == 1
    (line,) = [s for s in said if s.startswith("train.fused_blocks")]
    assert line.startswith("train.fused_blocks=1 here, not the default 2: a 4 -> 8 block")
    # where the kernels cannot run at all, both kernel options step aside to the layers
    monkeypatch.setattr("detector.model.stem_kernel.triton", None)
    said.clear()
    cfg = load_config(["preset=seed_scale", "model.channels=[4,8]", "model.hidden=16"], announce=said.append)
    assert (cfg.train.fused_blocks, cfg.train.fused_pool) == (0, False)
    assert said[1:] == [
        "train.fused_blocks=0 here, not the default 2: triton is not installed",
        "train.fused_pool=false here, not the default true: triton is not installed",
    ]


def test_a_speed_option_the_user_gave_is_kept_and_refused_where_the_model_is_built(tmp_path):
    said = []
    small = ["preset=seed_scale", "model.channels=[4,8]", "model.hidden=16", "data.image_size=32"]
    cfg = load_config([*small, "train.fused_blocks=2"], announce=said.append)
    assert cfg.train.fused_blocks == 2 and not any("fused_blocks" in s for s in said)
    experiment = tmp_path / "mine.yaml"
    experiment.write_text("preset: seed_scale\nmodel: {channels: [4, 8]}\ntrain: {fused_blocks: 2}\n")
    assert load_config(experiment=str(experiment), announce=None).train.fused_blocks == 2
    with pytest.raises(UserError, match=r"^train.fused_blocks=2 cannot run here: a 4 -> 8 block"):
        build_trained_model(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"), 1)


def test_preset_auto_is_the_cpus_for_a_run_on_the_cpu_and_says_why(monkeypatch):
    # device=cpu on a machine with a GPU: the CPU's preset (seed scale would compile 1024-image steps on the CPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said = []
    cfg = load_config(["device=cpu"], announce=said.append)
    assert cfg.preset == "cpu" and not cfg.train.compile and said[0] == "preset: cpu (device=cpu)"
    assert load_config(["device=cuda"], announce=None).preset == "seed_scale"
    assert load_config(["device=cpu", "preset=seed_scale"], announce=None).preset == "seed_scale"  # asked: kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said.clear()
    assert load_config([], announce=said.append).preset == "cpu" and said[0] == "preset: cpu (no GPU found)"


# Each command as `python -m detector` runs it (its exit status: main's), one after the other in one process: its
# exit status and what it said on stderr, one JSON list a command.
EVERY_COMMAND = """
import contextlib, io, json, sys
from detector.cli import main as cli
said = []
for command in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(command)
    said.append([status, err.getvalue()])
print(json.dumps(said))
"""


def test_a_gpu_this_machine_lacks_is_refused_in_one_line_by_every_command(monkeypatch):
    # the commands in a process of their own, the GPU hidden: in this one the CLI would set TRITON_INTERPRET=1 for
    # the tests after it (the kernels then run in the interpreter on a GPU machine); one process for all of them,
    # which imports torch once
    commands = (["train", "train.steps=1"], ["profile"], ["bench", "losses"])
    argv = json.dumps([[*command, "device=cuda"] for command in commands])
    env = child_env(CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", EVERY_COMMAND, argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    for command, (status, stderr) in zip(commands, said, strict=True):
        err = stderr.strip().splitlines()
        assert status == 2 and "Traceback" not in "\n".join(err), (command, err)
        assert err[-1].startswith("error: device=cuda: no CUDA device is available here"), (command, err)
        assert err[-1].endswith("; use device=cpu or auto"), (command, err)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(load_config(["device=cuda:1"], announce=None)) == torch.device("cuda", 1)
    with pytest.raises(
        ConfigError, match=r"^device=cuda:2: no such GPU here \(this machine has 2: cuda:0 to cuda:1\)$"
    ):
        resolve_device(load_config(["device=cuda:2"], announce=None))
