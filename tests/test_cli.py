"""The command line: per-command parsers, one-line errors with exit status 2, the entry points it calls."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from detector import cli
from detector.config import ConfigError
from detector.errors import UserError
from detector.losses import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent


def fails_with_one_line(capsys, argv, *parts):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"


@pytest.mark.parametrize(
    "argv,parts",
    [
        ([], ["<command>"]),
        (["nope"], ["invalid choice: 'nope'", "profile", "tensorboard"]),
        (["compare", "--experiment", "x"], ["compare", "unrecognized arguments: --experiment"]),
        (["strategies", "data.batch_size=1"], ["strategies", "unrecognized arguments: data.batch_size=1"]),
        (["tensorboard", "--names"], ["tensorboard", "--names"]),
        (["bench", "profile.active=3"], ["bench does not read 'profile.active=3'", "bench, data"]),
        (["strategies", "--port", "1"], ["--port"]),
    ],
    ids=[
        "no command",
        "unknown command",
        "compare --experiment",
        "strategies override",
        "tensorboard --names",
        "bench train.*",
        "strategies --port",
    ],
)
def test_arguments_that_do_not_apply_are_refused(capsys, argv, parts):
    fails_with_one_line(capsys, argv, *parts)


CONFIG_MISTAKES = [
    (["config", "data.batch_size=0"], ["data.batch_size=0", ">= 1"]),
    (["profile", "train.log_every=0"], ["train.log_every=0", ">= 1"]),
    (["config", "data.tail_fraction=2"], ["data.tail_fraction=2", "[0.0, 1.0]"]),
    (["config", "data.batch_size"], ["'data.batch_size' has no '='"]),
    (["config", "data..x=1"], ["'data..x=1'"]),
    (["config", "x=[1,2"], ["'x=[1,2'"]),
    (["config", "data.nope=1"], ["data.nope"]),
    (["config", "data.batch_size=abc"], ["data.batch_size", "'abc'"]),
    (["config", "preset=huge"], ["no preset 'huge'"]),
    (["train", "--experiment", "no_such"], ["no experiment 'no_such'", "cpu_smoke"]),
    (["profile", "profile.strategy=nope"], ["profile.strategy='nope'", "padded"]),
    (["train", "train.strategy=nope"], ["train.strategy='nope'", "all"]),
    (["bench", "bench.strategies=[nope]"], ["bench.strategies=['nope']"]),
]


@pytest.mark.parametrize("argv,parts", CONFIG_MISTAKES, ids=[" ".join(argv) for argv, _ in CONFIG_MISTAKES])
def test_config_mistakes_are_one_line(capsys, argv, parts):
    fails_with_one_line(capsys, argv, *parts)


def test_user_errors_raised_by_a_command_are_one_line(capsys, monkeypatch, tmp_path):
    import detector.compare

    fails_with_one_line(capsys, ["compare", "--dir", str(tmp_path)], "no profile runs", "make profile")  # real
    monkeypatch.setattr(detector.compare, "run_compare", lambda *a: (_ for _ in ()).throw(UserError("bad thing")))
    fails_with_one_line(capsys, ["compare"], "error: bad thing")


def test_debug_shows_the_traceback(monkeypatch):
    with pytest.raises(ConfigError):
        cli.main(["--debug", "config", "data.batch_size=0"])
    with pytest.raises(ConfigError):
        cli.main(["config", "--debug", "data.batch_size=0"])
    monkeypatch.setenv("DETECTOR_DEBUG", "1")
    with pytest.raises(UserError):
        cli.main(["nope"])


SECTIONS = {
    "profile": ["data", "model", "train", "profile"],
    "train": ["data", "model", "train"],
    "bench": ["bench", "data", "losses|kernels|layers|step"],
    "compare": ["Reads no configuration", "--dir", "--out", "RUN"],
    "tensorboard": ["Reads no configuration", "--logdir", "--port"],
    "strategies": ["Reads no configuration", "--names"],
    "config": ["data", "model", "train", "profile", "bench", "report"],
    "report": ["report", "data", "model", "train", "profile", "bench"],
}


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_describes_the_command_and_the_config_it_reads(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m detector {command}" in out and cli.COMMANDS[command][0] in out
    for part in SECTIONS[command]:
        assert part in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(command in out for command in cli.COMMANDS)


def test_strategies_names_prints_names_only(capsys):
    assert cli.main(["strategies", "--names"]) == 0
    assert capsys.readouterr().out.split() == list(STRATEGIES)


class Calls(list):
    def __call__(self, *args):
        self.append(args)


def test_commands_call_the_entry_points_as_the_makefile_does(monkeypatch):
    import detector.board
    import detector.compare
    import detector.profiling
    import detector.train.loop

    calls = {}
    for module, name in [
        (detector.profiling, "run_profile"),
        (detector.train.loop, "run_training"),
        (detector.bench, "run"),
        (detector.compare, "run_compare"),
        (detector.board, "main"),
    ]:
        monkeypatch.setattr(module, name, calls.setdefault(name, Calls()))

    assert cli.main(["profile", "profile.strategy=concat", "profile.mode=forward", "data.batch_size=2"]) == 0
    (cfg,) = calls["run_profile"][0]
    assert (cfg.profile.strategy, cfg.profile.mode, cfg.data.batch_size) == ("concat", "forward", 2)

    assert cli.main(["train", "--experiment", "cpu_smoke", "train.steps=3"]) == 0
    cfg, experiment = calls["run_training"][0]
    assert experiment == "cpu_smoke" and cfg.train.steps == 3 and cfg.train.eval_every == 250

    assert cli.main(["bench", "bench.repeats=2"]) == 0
    assert cli.main(["bench", "kernels", "bench.repeats=3"]) == 0
    assert [(cfg.bench.repeats, target) for cfg, target in calls["run"]] == [(2, "losses"), (3, "kernels")]

    assert cli.main(["compare", "--dir", "d", "--out", "o"]) == 0
    assert cli.main(["compare", "runs/profile/padded/1", "runs/profile/loop/2"]) == 0
    assert calls["run_compare"] == [
        ("d", None, "o"),
        ("runs/profile", ["runs/profile/padded/1", "runs/profile/loop/2"], None),
    ]
    assert cli.main(["tensorboard", "--logdir", "logs", "--port", "7000"]) == 0
    assert calls["main"] == [("logs", 7000)]


def run_module(*argv):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "detector", *argv], capture_output=True, text=True, env=env, cwd=ROOT)


def test_python_m_detector_end_to_end():
    result = run_module("config", "data.batch_size=0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "note: no CUDA device, Triton kernels run in the interpreter (TRITON_INTERPRET=1)",
        "error: data.batch_size=0 is out of range: allowed >= 1",
    ]
    result = run_module("strategies", "--names")
    assert result.returncode == 0 and result.stdout.split() == list(STRATEGIES)  # the note goes to stderr
