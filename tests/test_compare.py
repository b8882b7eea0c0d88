"""`make compare` (detector.compare) over profile run folders built from the recorded H200 trace: which
runs it takes, its tables (speed-ups only where the [min–max] ranges do not overlap), its outputs and
TensorBoard events, and what it says about broken or missing runs."""

import json

import pytest
from test_board import make_run, read_events

from detector.compare import read_run, run_compare, speedup
from detector.errors import UserError


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """runs/profile with: padded (an older run 3x slower, and the newest), triton (the same trace as
    padded: ranges overlap), cuda_fused (every time halved: no overlap), padded-forward, a broken loop
    summary and concat's summary in the old layout."""
    root = tmp_path_factory.mktemp("runs") / "profile"
    make_run(root, "padded", "20261121-090000", scale=3.0)
    newest = make_run(root, "padded", "20261122-031500")
    make_run(root, "triton", "20261122-031700")
    fast = make_run(root, "cuda_fused", "20261122-031600", scale=0.5)
    make_run(root, "padded", "20261122-040000", mode="forward")
    (root / "loop" / "20261122-050000").mkdir(parents=True)
    (root / "loop" / "20261122-050000" / "summary.json").write_text('{"strategy": "loop", ')
    (root / "concat").mkdir()
    (root / "concat" / "summary.json").write_text(json.dumps({"strategy": "concat", "mode": "train", "step_ms": 1}))
    return {"root": root, "padded": newest, "cuda_fused": fast}


def test_compare_latest_runs(profiles, tmp_path, capsys):
    report = run_compare(profiles["root"], out_dir=tmp_path / "out")
    out, err = capsys.readouterr()

    # the newest run of each strategy and mode; broken and foreign summaries skipped with one line each
    assert report["modes"]["train"]["labels"] == ["padded", "triton", "cuda_fused"]  # padded, then registry order
    assert report["modes"]["forward"]["labels"] == ["padded"]
    assert {r["run"] for r in report["runs"] if r["strategy"] == "padded"} == {"20261122-031500", "20261122-040000"}
    warnings = err.strip().splitlines()
    assert len(warnings) == 2 and "Traceback" not in err
    assert any("loop/20261122-050000/summary.json: cannot read it" in w for w in warnings)
    assert any("concat/summary.json: no analysis, per_step" in w for w in warnings)

    # speed-ups only where the ranges do not overlap: cuda_fused is 2x in every region whose steps
    # agree; triton (the same trace) and the data wait (one 150 ms step) are ≈
    speedups = report["modes"]["train"]["speedups_vs_padded"]
    assert speedups["forward"]["cuda_fused"] == pytest.approx(2.0)
    assert speedups["calc loss"]["cuda_fused"] == pytest.approx(2.0)
    assert speedups["data wait"]["cuda_fused"] is None
    assert all(speedups[region]["triton"] is None for region in speedups)
    md = (tmp_path / "out" / "compare.md").read_text()
    forward_row = next(line for line in md.splitlines() if line.startswith("| forward |"))
    assert forward_row == "| forward | 29.4 [29.3–29.4] | 29.4 [29.3–29.4] · ≈ | 14.7 · 2× |"
    assert "| calc loss | padded | 49 | 49 | 0 | 0 | 0 B | 0 |" in md  # the why table
    assert "## mode=forward" in md and md in out  # printed too

    files = {p.name for p in (tmp_path / "out").iterdir()}
    for name in ("compare.md", "compare.json", "ms-per-step-train.png", "counts-train.png", "timeline-train.png"):
        assert name in files
    assert "timeline-forward.png" in files and any(name.startswith("events.out.tfevents") for name in files)
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["modes"]["train"]["baseline"] == "padded"
    tags = read_events(tmp_path / "out").Tags()
    assert sorted(tags["tensors"]) == ["compare/forward/text_summary", "compare/train/text_summary"]
    for chart in ("ms_per_step", "counts", "timeline"):
        assert f"{chart}/train" in tags["images"] and f"{chart}/forward" in tags["images"]


def test_compare_named_runs(profiles, tmp_path):
    """Named run folders, not only the latest: two padded runs get their folder in the column label."""
    older = profiles["root"] / "padded" / "20261121-090000"
    runs = [profiles["cuda_fused"], older / "summary.json", profiles["padded"]]
    report = run_compare(profiles["root"], runs=runs, out_dir=tmp_path / "named")

    labels = report["modes"]["train"]["labels"]
    assert labels == ["padded 20261121-090000", "padded 20261122-031500", "cuda_fused"]
    assert report["modes"]["train"]["speedups_vs_padded"]["forward"]["cuda_fused"] == pytest.approx(6.0)
    assert list(report["modes"]) == ["train"]


def test_compare_without_runs(tmp_path, capsys):
    with pytest.raises(UserError, match=r"make profile STRATEGY=<name>"):
        run_compare(tmp_path / "nothing")
    (tmp_path / "runs" / "padded" / "1").mkdir(parents=True)
    (tmp_path / "runs" / "padded" / "1" / "summary.json").write_text("[]")
    with pytest.raises(UserError, match="no profile runs"):
        run_compare(tmp_path / "runs")
    assert "skipped" in capsys.readouterr().err and not (tmp_path / "compare").exists()
    assert read_run(tmp_path / "missing") is None


@pytest.mark.parametrize(
    "other, expected",
    [
        ({"median": 1.0, "min": 0.9, "max": 1.1}, 2.0),  # disjoint, faster
        ({"median": 4.0, "min": 3.5, "max": 4.5}, 0.5),  # disjoint, slower
        ({"median": 1.5, "min": 1.0, "max": 1.95}, None),  # touches padded's min: ≈
        ({"median": 2.0, "min": 2.0, "max": 2.0}, None),  # the same
        (None, None),  # a region the other run does not have
    ],
)
def test_speedup_only_outside_the_spread(other, expected):
    padded = {"median": 2.0, "min": 1.95, "max": 2.2}
    assert speedup(padded, other) == (pytest.approx(expected) if expected else None)
