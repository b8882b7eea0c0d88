"""The command line: per-command parsers, one-line errors with exit status 2, the entry points it calls."""

import os
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import ROOT, child_env

from detector.bench import TARGETS as BENCH_TARGETS
from detector.cli import arguments
from detector.cli import main as cli
from detector.config.schema import load_config
from detector.errors import ConfigError, UserError
from detector.losses import STRATEGIES


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
    import detector.lab.compare

    fails_with_one_line(capsys, ["compare", "--dir", str(tmp_path)], "no profile runs", "make profile")  # real
    monkeypatch.setattr(detector.lab.compare, "run_compare", lambda *a: (_ for _ in ()).throw(UserError("bad thing")))
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
    "curves": ["Reads no configuration", "training run folders", "RUN [RUN ...]"],
    "tensorboard": ["Reads no configuration", "--logdir", "--port", "--host", "default: 127.0.0.1"],
    "strategies": ["Reads no configuration", "--names"],
    "config": ["data", "model", "train", "profile", "bench", "report"],
    "report": ["report", "data", "model", "train", "profile", "bench"],
    "shapes": ["data", "bench", "profile", "[SOURCE]", "coco:FILE or widerface:FILE"],
    "export": ["Reads no configuration", "RUN", "--out", "<run>/export/model.pt"],
    "predict": ["Reads no configuration", "RUN", "INDEX", "--images", "--faces", "--out"],
    "scaling": ["report", "data", "model", "train", "--work", "--out", "[run|FOLDER]"],
    "link": ["bench", "data", "model", "--out"],
    "ceiling": ["data", "model", "train", "--out", "--jobs", "--seconds"],
    "triton-host": ["Reads no configuration"],
}


@pytest.mark.parametrize("command", list(arguments.COMMANDS))
def test_help_describes_the_command_and_the_config_it_reads(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m detector {command}" in out and arguments.COMMANDS[command][0] in out
    for part in SECTIONS[command]:
        assert part in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all((command in out) != (command in arguments.HIDDEN) for command in arguments.COMMANDS)
    assert "ceiling" in arguments.HIDDEN  # bench memory's child: it runs, unlisted
    assert all("--experiment" not in arguments.command_parser(c).format_help() for c in arguments.OWN_CONFIG)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ceiling", "--out=r.json"], "python -m detector ceiling: the following arguments are required: --jobs"),
        (["scaling", "runs/x", "device=cpu"], "python -m detector scaling FOLDER takes no options and no key=value"),
        (["scaling", "runs/x", "--out=t.md"], "python -m detector scaling FOLDER takes no options and no key=value"),
        (["link", "--out=l.json", "--processes=2"], "python -m detector link: unrecognized arguments: --processes=2"),
    ],
)
def test_the_benches_commands_refuse_a_wrong_call_in_one_line(capsys, argv, message):
    fails_with_one_line(capsys, argv, message)


def test_strategies_names_prints_names_only(capsys):
    assert cli.main(["strategies", "--names"]) == 0
    assert capsys.readouterr().out.split() == list(STRATEGIES)


class Calls(list):
    def __init__(self, result=None):
        super().__init__()
        self.result = result

    def __call__(self, *args):
        self.append(args)
        return self.result


def test_commands_call_the_entry_points_as_the_makefile_does(monkeypatch, tmp_path):
    import detector.bench
    import detector.board.events
    import detector.board.launcher
    import detector.lab.compare
    import detector.lab.profile
    import detector.lab.shapes
    import detector.train.run.entry
    from detector.lab.compare import Comparison
    from detector.lab.record.comparison import ComparisonRecord
    from detector.lab.record.run import RunTimes

    calls = {}
    record = SimpleNamespace(times=RunTimes({"first step": 1.0}))  # what the command's last line reads of the record
    for module, name, result in [
        (detector.lab.profile, "run_profile", detector.lab.profile.Profiled(tmp_path, record, None, "card")),
        (detector.board.events, "write_profile_events", None),
        (detector.train.run.entry, "run_training", None),
        (detector.bench, "run", None),
        (detector.lab.compare, "run_compare", Comparison(ComparisonRecord("", ""), tmp_path / "compare" / "1")),
        (detector.board.events, "write_compare_events", None),
        (detector.board.launcher, "main", None),
    ]:
        monkeypatch.setattr(module, name, calls.setdefault(name, Calls(result)))

    assert cli.main(["profile", "profile.strategy=concat", "profile.mode=forward", "data.batch_size=2"]) == 0
    (cfg,) = calls["run_profile"][0]
    assert (cfg.profile.strategy, cfg.profile.mode, cfg.data.batch_size) == ("concat", "forward", 2)
    # the run's TensorBoard events, after it, with the card it printed
    assert calls["write_profile_events"] == [(tmp_path, record, None, "card")]

    assert cli.main(["train", "--experiment", "cpu_smoke", "train.steps=3"]) == 0
    # and the checks it continues (none here), train.strategy=auto's ranking (none: not auto), the CUDA context
    # (none: no GPU)
    cfg, experiment, _, rank, _ = calls["run_training"][0]
    assert experiment == "cpu_smoke" and cfg.train.steps == 3 and cfg.train.eval_every == 250 and rank is None
    assert cli.main(["train", "--experiment", "cpu_smoke", "train.strategy=auto"]) == 0
    assert calls["run_training"][1][3] is detector.lab.shapes.auto_ranking  # make shapes' prediction ranks for it

    assert cli.main(["bench", "bench.repeats=2"]) == 0
    assert cli.main(["bench", "kernels", "bench.repeats=3"]) == 0
    assert [(cfg.bench.repeats, target) for cfg, target in calls["run"]] == [(2, "losses"), (3, "kernels")]

    assert cli.main(["compare", "--dir", "d", "--out", "o"]) == 0
    assert cli.main(["compare", "runs/profile/padded/1", "runs/profile/loop/2"]) == 0
    assert calls["run_compare"] == [
        ("d", None, "o"),
        ("runs/profile", ["runs/profile/padded/1", "runs/profile/loop/2"], None),
    ]
    assert len(calls["write_compare_events"]) == 2
    assert cli.main(["tensorboard", "--logdir", "logs", "--port", "7000"]) == 0
    assert cli.main(["tensorboard", "--port", "7001", "--host", "0.0.0.0"]) == 0
    assert calls["main"] == [("logs", 7000, "127.0.0.1"), ("runs", 7001, "0.0.0.0")]  # loopback unless told


def run_module(*argv):
    env = child_env(CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "detector", *argv], capture_output=True, text=True, env=env, cwd=ROOT)


def test_python_m_detector_end_to_end():
    result = run_module("config", "data.batch_size=0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ["error: data.batch_size=0 is out of range: allowed >= 1"]  # nothing else
    result = run_module("strategies", "--names")
    assert result.returncode == 0 and result.stdout.split() == list(STRATEGIES) and not result.stderr


def test_config_prints_pure_yaml_and_announces_on_stderr():
    result = run_module("config", "--experiment", "cpu_smoke", "train.steps=7")
    assert result.returncode == 0 and result.stderr == "preset: cpu (no GPU found), experiment: cpu_smoke\n"
    printed = yaml.safe_load(result.stdout)  # `config > my.yaml` is a configuration
    assert printed["preset"] == "cpu" and printed["train"]["steps"] == 7 and printed["data"]["image_size"] == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note is about running without a CUDA device")
def test_the_interpreter_note_comes_only_where_an_emulated_strategy_runs(capsys):
    cfg = load_config(["preset=cpu", "train.strategy=all"], announce=None)
    assert cli.run_strategies("config", cfg, "losses", STRATEGIES) == []
    assert cli.run_strategies("profile", cfg, "losses", STRATEGIES) == ["padded"]
    assert cli.run_strategies("train", cfg, "losses", STRATEGIES) == list(STRATEGIES)
    assert cli.run_strategies("bench", cfg, "kernels", STRATEGIES) == []
    cli.emulation_note(STRATEGIES, ["padded", "concat"])
    assert capsys.readouterr().err == ""
    cli.emulation_note(STRATEGIES, list(STRATEGIES))
    assert capsys.readouterr().err == (
        "note: triton: Triton's interpreter runs its kernels here (no CUDA device: TRITON_INTERPRET=1)\n"
    )


def test_bench_lists_its_targets_in_its_help_and_its_errors(capsys):
    assert set(arguments.BENCH_HELP) == set(BENCH_TARGETS)
    fails_with_one_line(
        capsys, ["bench", "nope"], "unknown bench target 'nope'", "losses, kernels, layers, step, blocks"
    )
    fails_with_one_line(capsys, ["bench", "nope", "bench.repeats=2"], "unknown bench target 'nope'")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for target, why in arguments.BENCH_HELP.items():
        assert f"  {target}" in out and why in out


def test_a_busy_port_is_refused_in_one_line_before_tensorboard_starts(capsys, monkeypatch):
    import detector.board.launcher

    started = Calls()
    monkeypatch.setattr(detector.board.launcher, "main", started)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        fails_with_one_line(capsys, ["tensorboard", "--port", str(port)], f"port {port} is already in use", "--port")
    assert capsys.readouterr().out == "" and not started
    fails_with_one_line(capsys, ["tensorboard", "--port", "70000"], "'70000' is not a port number (1-65535)")


def make_dry_run(*args) -> str:
    # the Makefile's own defaults: a make that runs pytest (make gpu-check PY=python3) exports its command line's
    # variables, and MAKEFLAGS, to this one
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    result = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_set_up_says_what_it_builds_and_installs_numpy_before_torch(tmp_path):
    out = make_dry_run("setup", f"VENV={tmp_path / 'venv'}")
    assert out.index("pip install -q  numpy") < out.index("import torch")  # torch without numpy warns
    build = next(line for line in out.splitlines() if "building its detector._C extension" in line)
    assert "minutes" in build and "pip is silent meanwhile" in build
    assert "detector._C built and the project installed in" in out
    assert "tensorboard --port 7000" in make_dry_run("tensorboard", "PY=python3", "ARGS=--port 7000")


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "train.steps=1", "train.out_dir={file}"],
        ["train", "train.steps=1", "train.out_dir={file}/runs"],
        ["profile", "profile.out_dir={file}/runs"],
    ],
)
def test_an_output_folder_where_a_file_stands_is_one_line(tmp_path, capsys, argv):
    """A file where a folder was asked for (train.out_dir=notes.txt) is the user's, said in one line naming it."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert cli.main([a.format(file=notes) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "notes.txt" in err, err
    assert notes.read_text() == "mine"


HELP = """
import sys
from detector.cli.main import main
from detector.cli.arguments import COMMANDS
for argv in [["--help"], *([name, "--help"] for name in COMMANDS)]:
    try:
        main(argv)
    except SystemExit as done:
        assert done.code == 0, (argv, done.code)
    else:
        raise AssertionError(f"{argv} did not end in argparse's exit")
print(sorted(name for name in ("torch", "omegaconf", "numpy", "matplotlib") if name in sys.modules))
"""


def test_every_help_is_the_grammar_alone_and_imports_no_torch():
    """`python -m detector --help` and each command's --help answer at once: the grammar (detector/cli/arguments.py) and
    the command line import neither torch nor the configuration's library (torch alone takes seconds to import)."""
    done = subprocess.run([sys.executable, "-c", HELP], capture_output=True, text=True, env=child_env(), timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]
    assert "usage: python -m detector train" in done.stdout
