"""The README's worked example of a strategy of your own, exactly as written: its CIoU file, written to a folder of
its own, through profile, compare, bench, report's plan, the Traces tab and the contract grid (pytest --strategy)."""

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, child_env
from lab_helpers import TINY_PROFILE
from tensorboard.plugins.base_plugin import TBContext
from werkzeug.test import Client

from detector.board.plugin import TracesPlugin
from detector.cli import arguments
from detector.cli import main as cli
from detector.config.schema import load_config
from detector.lab import report
from detector.losses import KnownStrategies

NAME = "my_ciou:ciou_loss"
TINY = TINY_PROFILE + ["profile.timed=2"]


def readme_example() -> str:
    """The python block after "A strategy of your own" in README.md, as written there."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**A strategy of your own.**") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def example_dir(user_dir):
    """The user's folder with the README's example in it, as my_ciou.py."""
    (user_dir / "my_ciou.py").write_text(readme_example())
    return user_dir


def test_the_example_is_under_20_lines_of_code():
    code = [line for line in readme_example().splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) < 20, code


def test_the_readme_example_through_profile_compare_bench_report_and_the_traces_tab(example_dir):
    user_dir = example_dir
    runs = user_dir / "runs" / "profile"
    for strategy in (NAME, "padded"):
        assert cli.main(["profile", *TINY, f"profile.strategy={strategy}", f"profile.out_dir={runs}"]) == 0
    (run,) = (runs / NAME).iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == NAME and summary["config"]["train"]["strategy"] == NAME

    assert cli.main(["compare", "--dir", str(runs), "--out", str(user_dir / "compared")]) == 0
    compared = (user_dir / "compared" / "compare.md").read_text()
    assert f"- **{NAME}** — " in compared  # its verdict against padded
    assert json.loads((user_dir / "compared" / "compare.json").read_text())["modes"]["train"]["labels"] == [
        "padded",
        NAME,
    ]

    bench = ["bench", "losses", f"bench.strategies=[padded,{NAME}]", "bench.batch_sizes=[8]", "bench.repeats=2"]
    bench += ["bench.warmup=1", "bench.distributions=[seed]", f"bench.out={user_dir / 'bench' / 'bench.json'}"]
    assert cli.main([*bench, "preset=cpu"]) == 0
    timed = json.loads((user_dir / "bench" / "losses.json").read_text())["results"]
    assert [r["strategy"] for r in timed] == ["padded", NAME] and timed[1]["forward_backward_ms"]["median"] > 0

    cfg = load_config(["preset=cpu", f"report.strategies=[{NAME}]"], announce=None, strategies=KnownStrategies())
    names, skipped = report.runnable(cfg, torch.device("cpu"))
    parts = report.plan(cfg, torch.device("cpu"), user_dir / "report", names, [], dict.fromkeys(arguments.COMMANDS, []))
    assert names == [NAME] and not skipped and parts[0].args[1] == f"profile.strategy={NAME}"

    plugin = TracesPlugin(TBContext(logdir=str(user_dir / "runs")))
    listed = {r["strategy"]: r for r in plugin.scan(fresh=True)["runs"]}
    assert set(listed) == {NAME, "padded"}
    apps = plugin.get_plugin_apps()
    client = Client(lambda environ, start: apps[environ["PATH_INFO"]](environ, start))
    step = listed[NAME]["steps"][0]
    response = client.get("/step", query_string={"run": listed[NAME]["run"], "step": str(step)})
    assert response.status_code == 200 and response.json["step"] == step


def test_the_readme_example_passes_the_contract_grid(tmp_path):
    """The README's command, run where the user's file is: every row of the grid on their CIoU, against its
    float64 reference."""
    (tmp_path / "my_ciou.py").write_text(readme_example())
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning"]
    command += [str(ROOT / "tests/losses/test_strategies.py"), "--strategy", NAME]
    result = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    passed = int(re.search(r"(\d+) passed", result.stdout).group(1))
    assert passed >= 40 and "failed" not in result.stdout  # 36 grid rows, 5 weird ones, the rejections
