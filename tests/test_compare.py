"""`make compare` (detector.compare) over profile run folders built from the recorded H200 trace: which
runs it takes, its tables (speed-ups only where the [min–max] ranges do not overlap), its outputs and
TensorBoard events, and what it says about broken or missing runs."""

import json

import pytest
from test_board import make_run, read_events

from detector.compare import explain, read_run, run_compare, verdicts
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

    # speed-ups only where the interquartile ranges do not overlap: cuda_fused is 2x in every region whose
    # steps agree; triton (the same trace) is ≈ everywhere
    mode = report["modes"]["train"]
    wall, gpu = mode["speedups_vs_padded"]["wall_ms"], mode["speedups_vs_padded"]["gpu_ms"]
    assert wall["forward"]["cuda_fused"] == pytest.approx(2.0) and gpu["backward"]["cuda_fused"] == pytest.approx(2.0)
    assert wall["calc loss"]["cuda_fused"] == pytest.approx(2.0)
    assert all(wall[region]["triton"] is None for region in wall)
    assert mode["step_verdicts"] == {"padded": None, "triton": None, "cuda_fused": pytest.approx(2.0)}
    assert mode["timed_verdicts"] == {"padded": None, "triton": None, "cuda_fused": pytest.approx(2.0)}
    assert mode["verdicts"][0].startswith("- **triton**: ≈ padded as training runs it; profiled ≈ padded.")
    assert mode["verdicts"][1].startswith("- **cuda_fused**: 2× faster than padded as training runs it; profiled 2×")
    assert "Most of it in backward (-24.4 ms)." in mode["verdicts"][1]  # the same counts: no why to give
    md = (tmp_path / "out" / "compare.md").read_text()
    forward_row = next(line for line in md.splitlines() if line.startswith("| forward |"))
    assert forward_row == "| forward | 29.4 [29.3–29.4] | 29.4 [29.3–29.4] · ≈ | 14.7 · 2× |"
    assert "| **step, as training runs it** | 102 [101–103] | 102 [101–103] · ≈ | 51 [50.5–51.5] · 2× |" in md
    assert "### GPU ms per step (device)" in md
    assert "| calc loss | padded | 117 | 10 | 0 | 49 | 49 | 1 | 0 | 0 | 0.486 |" in md  # the why table
    assert "need a GPU" not in md
    assert "## mode=forward" in md and md in out  # printed too

    files = {p.name for p in (tmp_path / "out").iterdir()}
    for name in ("compare.md", "compare.json", "ms-per-step-train.png", "counts-train.png", "timeline-train.png"):
        assert name in files
    assert "timeline-forward.png" in files and any(name.startswith("events.out.tfevents") for name in files)
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["modes"]["train"]["baseline"] == "padded"
    tags = read_events(tmp_path / "out").Tags()
    assert sorted(tags["tensors"]) == ["compare/forward/text_summary", "compare/train/text_summary"]
    for chart in ("1 ms per step", "2 counts", "3 timeline"):
        for mode_name in ("train", "forward"):
            assert f"1 compare/{chart}, {mode_name}" in tags["images"]


def test_compare_of_cpu_runs_says_once_what_needs_a_gpu(tmp_path):
    root = tmp_path / "profile"
    make_run(root, "padded", "20261122-031500", gpu=False)
    make_run(root, "loop", "20261122-031600", gpu=False, scale=3.0)
    report = run_compare(root, out_dir=tmp_path / "out")
    md = (tmp_path / "out" / "compare.md").read_text()
    assert md.count("need a GPU") == 1 and "### GPU ms per step" not in md
    why_header = next(line for line in md.splitlines() if line.startswith("| region | strategy |"))
    assert why_header == "| region | strategy | operators | slices | host reads |"
    assert report["modes"]["train"]["step_verdicts"]["loop"] == pytest.approx(1 / 3)
    assert "loop**: 3× slower than padded as training runs it" in report["modes"]["train"]["verdicts"][0]


def test_compare_named_runs(profiles, tmp_path):
    """Named run folders, not only the latest: two padded runs get their folder in the column label."""
    older = profiles["root"] / "padded" / "20261121-090000"
    runs = [profiles["cuda_fused"], older / "summary.json", profiles["padded"]]
    report = run_compare(profiles["root"], runs=runs, out_dir=tmp_path / "named")

    labels = report["modes"]["train"]["labels"]
    assert labels == ["padded 20261121-090000", "padded 20261122-031500", "cuda_fused"]
    assert report["modes"]["train"]["speedups_vs_padded"]["wall_ms"]["forward"]["cuda_fused"] == pytest.approx(6.0)
    assert list(report["modes"]) == ["train"]


def test_compare_without_runs(tmp_path, capsys):
    with pytest.raises(UserError, match=r"make profile STRATEGY=<name>"):
        run_compare(tmp_path / "nothing")
    (tmp_path / "runs" / "padded" / "1").mkdir(parents=True)
    (tmp_path / "runs" / "padded" / "1" / "summary.json").write_text("[]")
    with pytest.raises(UserError, match="no profile runs"):
        run_compare(tmp_path / "runs")
    assert "skipped" in capsys.readouterr().err and not (tmp_path / "compare").exists()


def test_a_mistyped_run_path_is_named_as_such(profiles, tmp_path):
    with pytest.raises(
        UserError, match=r"no run folder \S+/profile/nope: mistyped\? \S+/profile holds concat, cuda_fused"
    ):
        run_compare(profiles["root"], runs=[profiles["padded"], profiles["root"] / "nope"], out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_strategy_folder_named_is_its_newest_run(profiles):
    assert read_run(profiles["root"] / "padded")["dir"] == profiles["padded"]


def test_values_no_measure_can_take_are_left_out_with_one_warning_naming_them(profiles, tmp_path, capsys):
    root = tmp_path / "profile"
    make_run(root, "padded", "20261122-031500")
    bad = make_run(root, "concat", "20261122-031600", scale=2.0)
    summary = json.loads((bad / "summary.json").read_text())
    summary["analysis"]["regions"]["forward"]["wall_ms"]["median"] = float("nan")
    summary["analysis"]["regions"]["backward"]["gpu_ms"]["q3"] = -1.0
    summary["timed"]["step_ms"]["max"] = 1e308
    summary["per_step"][0]["regions"]["calc loss"]["ops"] = float("inf")
    (bad / "summary.json").write_text(json.dumps(summary))
    report = run_compare(root, out_dir=tmp_path / "out")
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(
        f"warning: {bad / 'summary.json'}: left out analysis.regions.forward.wall_ms.median (nan)"
    )
    assert "analysis.regions.backward.gpu_ms.q3 (-1.0)" in warning and "timed.step_ms.max (1e+308)" in warning
    assert "and 1 more: not finite, negative or beyond 10^15" in warning
    mode = report["modes"]["train"]
    assert mode["labels"] == ["padded", "concat"] and mode["timed_verdicts"]["concat"] is None  # absent, not NaN
    assert (tmp_path / "out" / "ms-per-step-train.png").exists()


@pytest.mark.parametrize(
    "summary, reason",
    [
        ({"strategy": None, "mode": "train", "analysis": {}, "per_step": []}, "is not a name"),
        ({"strategy": "x", "mode": "train", "analysis": {}, "per_step": []}, "no step wall time"),
    ]
    + [
        (
            {"strategy": "x", "mode": "train", "per_step": []}
            | {"analysis": {"regions": {"step": {"wall_ms": {"median": value}, "gpu_ms": {}}}}},
            "is not a duration",
        )
        for value in (float("nan"), float("inf"), -1.0, 0.0, 1e308)
    ],
)
def test_a_summary_that_cannot_be_compared_is_refused_in_one_line(tmp_path, capsys, summary, reason):
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert read_run(tmp_path) is None
    err = capsys.readouterr().err
    assert reason in err and len(err.strip().splitlines()) == 1


def _spread(median):
    return {"n": 10, "median": median, "q1": median * 0.99, "q3": median * 1.01}


def _run(label, idle, wall, gpu, timed_ms):
    """A run's summary: ``wall`` and ``gpu`` map regions to their medians (ms); ``idle`` the step's GPU idle share."""
    regions = {r: {"wall_ms": _spread(wall[r]), "gpu_ms": _spread(gpu[r])} for r in wall}
    regions["step"] = {
        "wall_ms": _spread(sum(wall.values())),
        "device_step_ms": _spread(sum(gpu.values())),
        "gpu_idle_share": _spread(idle),
    }
    summary = {"analysis": {"regions": regions}, "timed": {"step_ms": _spread(timed_ms)}}
    return {"label": label, "strategy": label, "summary": summary}


def test_a_busy_device_is_explained_by_its_gpu_time_in_the_verdicts_direction():
    """Both steps keep the device busy: the host waited on a full launch queue in the backward (its wall time
    there doubled) while the loss's kernels got faster. The verdict is faster, so the explanation names the
    region that gained, by GPU ms, not the one whose host wall time grew."""
    base = _run("padded", 0.01, {"calc loss": 2.0, "backward": 7.0}, {"calc loss": 0.12, "backward": 11.2}, 29.4)
    run = _run("packed", 0.01, {"calc loss": 0.25, "backward": 13.5}, {"calc loss": 0.013, "backward": 11.0}, 29.0)
    assert explain(base, run, faster=True) == "Most of it in backward (-0.2 ms)."
    assert explain(base, run, faster=False) == ""  # no region lost GPU time: nothing to blame
    # a host-bound run (the device idles a fifth of its step): its wall time counts, and the loss region lost most
    host = _run("torchvision", 0.2, {"calc loss": 8.6, "backward": 7.5}, {"calc loss": 0.17, "backward": 11.3}, 34.3)
    assert explain(base, host, faster=False) == "Most of it in calc loss (+6.6 ms)."


def test_a_verdict_the_profile_contradicts_is_not_explained(monkeypatch):
    base = _run("padded", 0.01, {"calc loss": 2.0}, {"calc loss": 0.12}, 29.4)
    run = _run("triton", 0.01, {"calc loss": 1.0}, {"calc loss": 0.06}, 19.6)  # training: 1.5x faster
    import detector.compare as compare

    monkeypatch.setattr(compare, "step_verdict", lambda b, r: (1.5, ""))  # the profile: faster too
    assert verdicts([base, run])[0].endswith("Most of it in calc loss (-0.06 ms).")
    monkeypatch.setattr(compare, "step_verdict", lambda b, r: (0.5, ""))  # the profile: slower, training: faster
    line = verdicts([base, run])[0]
    assert "1.5× faster than padded as training runs it; profiled 2× slower" in line and "Most of it" not in line
