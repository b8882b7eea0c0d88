"""`make compare` (detector/lab/compare.py) over profile run folders built from the recorded H200 trace: which
runs it takes, its verdicts and tables (speed-ups only where the interquartile ranges do not overlap), its
outputs and TensorBoard events, and what it says about broken or missing runs."""

import json

import pytest
from lab_helpers import (
    BUSY,
    H100_TRACES,
    MARKUP_NAME,
    SHOWN,
    edit_summary,
    make_run,
    read_events,
    rendered,
    tables_whole,
)

from detector.board.events import text_tab, write_compare_events
from detector.errors import UserError
from detector.lab.compare import auto_line, read_run, run_compare
from detector.lab.present.text import run_card
from detector.lab.record.comparison import read_comparison
from detector.lab.record.run import read_summary
from detector.lab.record.steps import EXTRACT, read_extract, write_extract


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
    comparison = run_compare(profiles["root"], out_dir=tmp_path / "out")
    report = read_comparison(tmp_path / "out")  # compare.json, read back through its record
    assert report == comparison.record
    out, err = capsys.readouterr()

    # the newest run of each strategy and mode; broken and foreign summaries skipped with one line each
    assert report.modes["train"].labels == ["padded", "triton", "cuda_fused"]  # padded, then registry order
    assert report.modes["forward"].labels == ["padded"]
    assert {r.run for r in report.runs if r.strategy == "padded"} == {"20261122-031500", "20261122-040000"}
    warnings = err.strip().splitlines()
    assert len(warnings) == 2 and "Traceback" not in err
    assert any("loop/20261122-050000/summary.json: not JSON" in w for w in warnings)
    assert any("concat/summary.json: no analysis, per_step" in w for w in warnings)

    # speed-ups only where the interquartile ranges do not overlap: cuda_fused is 2x in every region whose
    # steps agree; triton (the same trace) is ≈ everywhere
    mode = report.modes["train"]
    wall, gpu = mode.speedups_vs_padded["wall_ms"], mode.speedups_vs_padded["gpu_ms"]
    assert wall["forward"]["cuda_fused"] == pytest.approx(2.0) and gpu["backward"]["cuda_fused"] == pytest.approx(2.0)
    assert wall["calc loss"]["cuda_fused"] == pytest.approx(2.0)
    assert all(wall[region]["triton"] is None for region in wall)
    assert mode.step_verdicts == {"triton": None, "cuda_fused": pytest.approx(2.0)}
    assert mode.timed_verdicts == {"triton": None, "cuda_fused": pytest.approx(2.0)}
    # the same trace: the same counts, and times the rule cannot tell apart, with both spreads
    assert mode.verdicts[0] == (
        "- **triton** — the same counts in every region. As training runs it: not distinguishable on this machine "
        "(triton 101 [100–101] ms against padded's 101 [100–101])."
    )
    assert mode.verdicts[1] == (
        "- **cuda_fused** — the same counts in every region. As training runs it: 2× faster (cuda_fused 50.5 "
        "[50.2–50.7] ms against padded's 101 [100–101]), most of it in backward (-24.4 ms). Traces tab: align on "
        "*backward*."
    )
    md = (tmp_path / "out" / "compare.md").read_text()
    assert (  # the run auto would train with, were these its candidates (detector/train/choice.py's rule)
        "**train.strategy=auto** would train with cuda_fused of these runs, by its rule over their timed steps and "
        "their step's peak memory rise: cuda_fused — 50.5 [50.2–50.7] ms a step against padded 101 [100–101], triton "
        "101 [100–101]."
    ) in comparison.texts["train"]
    forward_row = next(line for line in md.splitlines() if line.startswith("| forward |"))
    assert forward_row == "| forward | 29.4 [29.3–29.4] | 29.4 [29.3–29.4] · ≈ | 14.7 · 2× |"
    assert "| **step, as training runs it** | 101 [100–101] | 101 [100–101] · ≈ | 50.5 [50.2–50.7] · 2× |" in md
    gpu_table = md.split("### GPU ms per step (device)")[1].split("### Why")[0]
    assert "| data wait |" not in gpu_table  # the loader's copies are not the strategy's work
    # the why table, split by its columns to fit a window: operators .. kernels, then syncs .. CUDA API ms
    assert (
        "| calc loss | padded | 117 | 10 | 0 | 49 | 49 |" in md and "| calc loss | padded | 1 | 0 | 0 | 0.486 |" in md
    )
    assert "need a GPU" not in md and "Noisy runs" not in md
    assert "## mode=forward" in md and md in out  # printed too

    files = {p.name for p in (tmp_path / "out").iterdir()}
    for name in ("compare.md", "compare.json", "ms-per-step-train.png", "counts-train.png", "timeline-train.png"):
        assert name in files
    assert "timeline-forward.png" in files
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["modes"]["train"]["baseline"] == "padded"
    assert mode.baseline == "padded" and mode.timed["cuda_fused"].median == pytest.approx(50.5, abs=0.1)
    write_compare_events(comparison.out, comparison.texts, comparison.images)
    tags = read_events(tmp_path / "out").Tags()
    assert sorted(tags["tensors"]) == ["compare/forward/text_summary", "compare/train/text_summary"]
    for chart in ("1 ms per step", "2 counts", "3 timeline"):
        for mode_name in ("train", "forward"):
            assert f"1 compare/{chart}, {mode_name}" in tags["images"]


def test_compare_of_cpu_runs_says_once_what_needs_a_gpu(tmp_path):
    root = tmp_path / "profile"
    make_run(root, "padded", "20261122-031500", gpu=False)
    make_run(root, "loop", "20261122-031600", gpu=False, scale=3.0)
    report = run_compare(root, out_dir=tmp_path / "out").record
    md = (tmp_path / "out" / "compare.md").read_text()
    assert md.count("need a GPU") == 1 and "### GPU ms per step" not in md
    why_header = next(line for line in md.splitlines() if line.startswith("| region | strategy |"))
    assert why_header == "| region | strategy | operators | slices | host reads |"
    assert report.modes["train"].step_verdicts["loop"] == pytest.approx(1 / 3)
    assert "As training runs it: 3× slower (loop 303 [301–304] ms" in report.modes["train"].verdicts[0]


def test_compare_named_runs(profiles, tmp_path):
    """Named run folders, not only the latest: two padded runs get their folder in the column label."""
    older = profiles["root"] / "padded" / "20261121-090000"
    runs = [profiles["cuda_fused"], older / "summary.json", profiles["padded"]]
    report = run_compare(profiles["root"], runs=runs, out_dir=tmp_path / "named").record

    labels = report.modes["train"].labels
    assert labels == ["padded 20261121-090000", "padded 20261122-031500", "cuda_fused"]
    assert report.modes["train"].speedups_vs_padded["wall_ms"]["forward"]["cuda_fused"] == pytest.approx(6.0)
    assert list(report.modes) == ["train"]


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
    assert read_run(profiles["root"] / "padded").folder == profiles["padded"]


def test_values_no_measure_can_take_are_left_out_with_one_warning_naming_them(profiles, tmp_path, capsys):
    root = tmp_path / "profile"
    make_run(root, "padded", "20261122-031500")
    bad = make_run(root, "concat", "20261122-031600", scale=2.0)

    def spoil(summary):
        summary["analysis"]["regions"]["forward"]["wall_ms"]["median"] = float("nan")
        summary["analysis"]["regions"]["backward"]["gpu_ms"]["q3"] = -1.0
        summary["timed"]["step_ms"]["max"] = 1e308
        summary["per_step"][0]["regions"]["calc loss"]["ops"] = float("inf")

    edit_summary(bad, spoil)
    report = run_compare(root, out_dir=tmp_path / "out").record
    expected = "expected a finite number in [0, 1e15]"
    warnings = [
        f"{bad / 'summary.json'}: {line}"
        for line in (
            f"analysis.regions.forward.wall_ms.median is NaN, {expected}: analysis.regions.forward.wall_ms left out",
            f"analysis.regions.backward.gpu_ms.q3 is -1.0, {expected}: analysis.regions.backward.gpu_ms left out",
            f"per_step[0].regions.calc loss.ops is Infinity, {expected}: per_step[0] left out",
            f"timed.step_ms.max is 1e+308, {expected}: timed left out",
        )
    ]
    assert capsys.readouterr().err.splitlines() == [f"warning: {w}" for w in warnings]  # each once
    md = (tmp_path / "out" / "compare.md").read_text()
    assert all(f"**warning** (concat): {w}" in md for w in warnings)
    mode = report.modes["train"]
    assert mode.labels == ["padded", "concat"] and mode.timed_verdicts["concat"] is None  # absent, not NaN
    assert (tmp_path / "out" / "ms-per-step-train.png").exists()


@pytest.mark.parametrize(
    "summary, reason",
    [
        (
            {"strategy": None, "mode": "train", "analysis": {}, "per_step": []},
            "strategy is NoneType null, expected a string",
        ),
        ({"strategy": "x", "mode": "train", "analysis": {}, "per_step": []}, "analysis.regions is NoneType"),
        ({"strategy": "x", "mode": "sideways", "analysis": {}, "per_step": []}, "mode 'sideways' is none of train"),
        ({"strategy": "x", "mode": "train", "analysis": {}, "per_step": [], "version": 9}, "version 9, this detector"),
    ]
    + [
        (
            {"strategy": "x", "mode": "train", "per_step": []}
            | {
                "analysis": {
                    "regions": {"step": {"wall_ms": {"median": value, "n": 3}}},
                    "representative_step": 1,
                    "steps": 3,
                }
            },
            "its step wall time is not usable",
        )
        for value in (float("nan"), float("inf"), -1.0, 0.0, 1e308)
    ],
)
def test_a_summary_that_cannot_be_compared_is_refused_in_one_line(tmp_path, capsys, summary, reason):
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert read_run(tmp_path) is None
    err = capsys.readouterr().err
    assert reason in err and len(err.strip().splitlines()) == 1


# a strategy's run whose summary holds a value of the wrong type: key, value, the reason it is skipped with
WRONG_TYPES = {
    "concat": ("timed", "fast", "timed is str 'fast', expected an object"),
    "loop": ("per_step", 3, "per_step is int 3, expected a list"),
    "packed": ("noise", [1], "noise is list [1], expected an object"),
    "nested": ("batch_size", "1024", "batch_size is str '1024', expected an integer"),
}


def test_a_summary_of_wrong_types_is_skipped_with_its_reason_and_the_rest_compared(tmp_path, capsys):
    """Each of the four summaries beside padded's (one compare for them all: its charts are the slow part) is skipped
    with one warning naming its folder and its reason; padded alone is compared."""
    root = tmp_path / "profile"
    make_run(root, "padded", "20261122-031500")
    bad = {}
    for i, (strategy, (key, value, _)) in enumerate(WRONG_TYPES.items()):
        bad[strategy] = make_run(root, strategy, f"20261122-03160{i}")
        edit_summary(bad[strategy], lambda summary, key=key, value=value: summary.update({key: value}))
    report = run_compare(root, out_dir=tmp_path / "out").record
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == len(WRONG_TYPES), warnings
    for strategy, (_, _, reason) in WRONG_TYPES.items():
        (warning,) = [w for w in warnings if str(bad[strategy]) in w]
        assert reason in warning and str(bad[strategy]) in warning
    assert report.modes["train"].labels == ["padded"]


def test_runs_that_share_a_name_get_distinct_labels_everywhere(tmp_path, capsys):
    """Two copies of runs of one strategy and run name, in two parent folders (`make compare RUNS="a/... b/..."`):
    each its own column, verdict and chart entry, named by the folder that tells them apart."""
    first = make_run(tmp_path / "a" / "profile", "padded", "20261122-031500")
    second = make_run(tmp_path / "b" / "profile", "padded", "20261122-031500", scale=0.5)
    comparison = run_compare(runs=[first, second], out_dir=tmp_path / "out")
    labels = ["padded 20261122-031500 (a)", "padded 20261122-031500 (b)"]
    mode = read_comparison(tmp_path / "out").modes["train"]
    assert mode.labels == labels and [r.label for r in comparison.record.runs] == labels
    assert set(mode.regions["step"]) == set(labels) and mode.baseline == labels[0]
    assert list(mode.step_verdicts) == [labels[1]] and mode.step_verdicts[labels[1]] == pytest.approx(2.0)
    md = (tmp_path / "out" / "compare.md").read_text()
    assert f"- **{labels[1]}** — " in md and f"| {labels[0]} | {labels[1]} |" in md
    (verdict,) = [line for line in md.splitlines() if line.startswith(f"- **{labels[1]}** — ")]
    assert f"against {labels[0]}'s " in verdict and "against padded's" not in verdict, verdict  # which padded
    again = run_compare(runs=[first, first], out_dir=tmp_path / "again")  # one folder named twice
    assert again.record.modes["train"].labels == ["padded 20261122-031500 #1", "padded 20261122-031500 #2"]


def test_a_damaged_extract_step_is_one_warning_and_the_timeline_still_drawn(tmp_path, capsys):
    root = tmp_path / "profile"
    make_run(root, "padded", "20261122-031500")
    bad = make_run(root, "concat", "20261122-031600", scale=2.0)
    found = read_extract(bad / EXTRACT)
    for number, step in found.steps.items():
        if number != str(found.representative_step):
            step.dur = float("nan")
    write_extract(bad, found)
    run_compare(root, out_dir=tmp_path / "out")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "extract" in line]
    others = [n for n in found.steps if n != str(found.representative_step)]
    assert warnings == [
        f"warning: {bad / EXTRACT}: step {n}.dur is NaN, expected a finite number in [0, 1e15]: step {n} left out"
        for n in others
    ]
    assert (tmp_path / "out" / "timeline-train.png").exists()


def test_names_from_summaries_come_out_escaped_in_compare_and_the_cards(tmp_path):
    """A strategy, run, preset and emulation note named with a tag and pipes (a noisy run: its label is among the
    verdict's reasons), and a device so named (no padded run on it: not judged): compare.md, the Text tab's tables and
    the runs' cards show each as written, as text, and every table keeps its columns."""
    root = tmp_path / "profile"
    make_run(root, "padded", "20261122-031500")
    named = make_run(root, "fast", "20261122-031600", scale=0.5, noise=BUSY)
    edit_summary(named, lambda s: s.update(strategy=MARKUP_NAME, run=MARKUP_NAME, preset=MARKUP_NAME))
    edit_summary(named, lambda s: s.update(emulated=f"emulated {MARKUP_NAME}"))
    elsewhere = make_run(root, "packed", "20261122-031700")
    edit_summary(elsewhere, lambda s: s.update(device=f"NVIDIA H200 {MARKUP_NAME}"))
    comparison = run_compare(root, out_dir=tmp_path / "compare")
    verdicts = comparison.record.modes["train"].verdicts
    assert len(verdicts) == 1 and "not judged" in verdicts[0] and "'s run: other processes" in verdicts[0]
    documents = {
        "compare.md": (tmp_path / "compare" / "compare.md").read_text(),
        "the Text tab's comparison": text_tab(comparison.texts["train"]),
        "compare.json's verdicts": "\n".join(verdicts),
        "the named run's card": run_card(read_summary(named)),
        "the card of the run elsewhere": run_card(read_summary(elsewhere)),
    }
    for name, document in documents.items():
        page = rendered(document)
        assert "<script" not in page and tables_whole(page), name
        assert SHOWN in page, name  # as written
    compared = rendered(documents["compare.md"])
    assert f"{SHOWN}'s run: other processes" in compared and f"emulated {SHOWN} here" in compared
    assert f"on NVIDIA H200 {SHOWN}: not judged" in compared


def test_where_the_device_paced_both_steps_the_device_time_leads_and_the_host_time_has_no_speed_up(tmp_path):
    """padded and packed as recorded on an H100 (seed scale, the host steps ahead of the device, its launches waiting
    for room in the full launch queue): the first table is the GPU time each region launched, with speed-ups; the host's
    table follows as the time to launch each region, with its wait for the queue and no speed-up; the chart's left bar
    is the device's; compare.json has no host speed-up; each run says what paced it."""
    root = tmp_path / "profile"
    for name, stamp in (("padded", "20261122-031500"), ("packed", "20261122-031600")):
        make_run(root, name, stamp, recorded=H100_TRACES[name], device="NVIDIA H100 80GB HBM3")
    comparison = run_compare(root, out_dir=tmp_path / "out")
    md = (tmp_path / "out" / "compare.md").read_text()
    tables = md.split("### Verdicts")[1]
    assert tables.index("### GPU ms per step (device)") < tables.index("### Host ms per step: the time to launch")
    host = tables.split("### Host ms per step")[1].split("###")[0]
    rows = [line for line in host.splitlines() if line.startswith("| ") and not line.startswith("| region")]
    assert rows and not any("×" in row or "≈" in row or "not judged" in row for row in rows)
    assert any(row.startswith("| of the step: waiting for room in the launch queue |") for row in rows)
    assert "**step, as training runs it**" not in host  # the device's table, the verdict's, holds it
    device = tables.split("### GPU ms per step (device)")[1].split("###")[0]
    loss = next(line for line in device.splitlines() if line.startswith("| calc loss |"))
    assert "× |" in loss  # packed's loss launches 9x less GPU time: a speed-up on the device's time
    assert "| **step, as training runs it** |" in device
    assert "packed: paced by the device (GPU idle 1% of the step; the host waited 20 ms a step for room in the" in md
    wall = comparison.record.modes["train"].speedups_vs_padded["wall_ms"]
    assert all(by_label["packed"] is None for by_label in wall.values())
    assert comparison.record.modes["train"].speedups_vs_padded["gpu_ms"]["calc loss"]["packed"] > 5


def test_which_run_auto_would_train_with_where_the_times_cannot_tell_them_apart(tmp_path):
    root = tmp_path / "profile"
    runs = [("padded", read_run(make_run(root, "padded", "20261122-031500")))]
    runs.append(("triton", read_run(make_run(root, "triton", "20261122-031700"))))  # the same trace and times
    line = auto_line(runs, runs[0][1])
    assert line == (  # the recorded trace holds no memory events
        "**train.strategy=auto** would train with padded of these runs, by its rule over their timed steps and their "
        "step's peak memory rise: padded — 101 [100–101] ms a step, not distinguishable from triton 101 [100–101] "
        "(the [q1–q3] overlap): the faster median, as memory was not measured."
    )
    assert auto_line(runs[:1], runs[0][1]) is None  # one run: nothing to choose
