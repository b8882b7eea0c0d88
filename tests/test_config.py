"""Configuration: every value checked at load, and every mistake one ConfigError line naming it."""

from pathlib import Path

import pytest

from detector.config import EXPERIMENTS_DIR, ConfigError, load_config
from detector.errors import UserError
from detector.losses import STRATEGIES


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
    ("model.head_blocks=-1", ">= 0"),
]


@pytest.mark.parametrize("override,allowed", OUT_OF_RANGE, ids=[o for o, _ in OUT_OF_RANGE])
def test_values_out_of_range_are_refused_at_load(override, allowed):
    field, value = override.split("=")
    with pytest.raises(ConfigError) as err:
        load(override)
    assert_one_line(err, field, value.split(",")[-1].strip("]"), allowed)


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
        ("train.strategy=nope", ["train.strategy='nope'", "all", "padded", "cuda_fused"]),
        ("profile.strategy=all", ["profile.strategy='all'", "one of loop"]),
        ("bench.strategies=[padded,nope]", ["bench.strategies=", "nope", "one of loop"]),
    ],
)
def test_strategy_fields_must_name_a_registered_strategy(override, parts):
    with pytest.raises(ConfigError) as err:
        load(override)
    assert_one_line(err, *parts)
    assert load("train.strategy=all", "profile.strategy=triton").train.strategy == "all"


def test_profile_lr_is_gone():
    with pytest.raises(ConfigError) as err:
        load("profile.lr=0.1")
    assert_one_line(err, "profile.lr", "ProfileConfig")


@pytest.mark.parametrize(
    "override,parts",
    [
        ("data.nope=1", ["data.nope", "Key 'nope' not in 'DataConfig'", "overrides"]),
        ("data.batch_size=abc", ["data.batch_size", "'abc'", "Integer"]),
        ("train.resume=maybe", ["train.resume", "bool"]),
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


def test_missing_experiment_and_preset(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(experiment="no_such_experiment")
    assert_one_line(err, "no experiment 'no_such_experiment'", "known experiments: baseline")
    assert isinstance(err.value, FileNotFoundError)  # callers that caught FileNotFoundError still do
    with pytest.raises(ConfigError) as err:
        load("preset=huge")
    assert_one_line(err, "no preset 'huge'", "known presets: auto, cpu, seed_scale")


@pytest.mark.parametrize(
    "text,parts",
    [
        ("train: {steps: [1,\n", ["not valid YAML", "line 2"]),
        ("- 1\n- 2\n", ["must hold a mapping"]),
        ("train:\n  stepz: 3\n", ["train.stepz", "Key 'stepz' not in 'TrainConfig'", "bad.yaml"]),
    ],
    ids=["yaml", "list", "unknown key"],
)
def test_broken_experiment_files(tmp_path, text, parts):
    path = Path(tmp_path / "bad.yaml")
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(experiment=str(path))
    assert_one_line(err, *parts)


def test_config_error_is_a_user_error_and_a_value_error():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)
