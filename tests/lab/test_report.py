"""`make report` (detector/lab/report.py): the standard set run part by part into one document, resumed where it
stopped, written only once every part has run, naming the machine, the commit, the commands and the load it ran
under; a noisy report does not replace the document it would overwrite."""

import json
import re
from pathlib import Path

import pytest
import torch
from lab_helpers import BUSY, MARKUP_NAME, QUIET, SHOWN, edit_summary, make_run, rendered

from detector.cli import main as cli
from detector.config.schema import load_config
from detector.errors import UserError
from detector.lab import report
from detector.lab.record.comparison import ComparisonRecord

# The CPU pinned: the report's parts and their number are the CPU's (a GPU adds the synchronised profile and the
# kernel and step benches), whatever machine runs the tests.
TINY = [
    "device=cpu",
    "preset=cpu",
    "data.batch_size=8",
    "data.image_size=16",
    "data.max_boxes=16",
    "model.hidden=8",
    "profile.wait=1",
    "profile.warmup=1",
    "profile.active=3",
    "profile.timed=3",
    "bench.batch_sizes=[8]",
    "bench.repeats=3",
    "bench.max_seconds=0.2",
    "bench.distributions=[seed]",
    "bench.strategies=[padded,loop]",
    "report.strategies=[padded,loop]",
    "report.train_strategies=[padded,loop]",
    "report.train_steps=11",
]


def make_report(tmp_path, *extra) -> int:
    folders = [f"report.out_dir={tmp_path / 'docs'}", f"report.work_dir={tmp_path / 'work'}"]
    return cli.main(["report", *TINY, *folders, *extra])


@pytest.mark.slow
def test_report_runs_the_standard_set_and_writes_one_document(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DETECTOR_COMMIT", "abc1234")
    assert make_report(tmp_path) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[6/6\] bench losses: done in \d+ s", out)
    doc = (tmp_path / "docs" / "cpu.md").read_text()
    assert doc.startswith("# Results on cpu\n") and "commit abc1234 (a copy of its tree)" in doc
    for command in (
        "python -m detector profile profile.strategy=padded",
        "python -m detector compare --dir",
        "python -m detector train train.strategy=loop train.steps=11",
        "python -m detector bench losses",
    ):
        assert command in doc, command
    assert "profile.wait=1 profile.warmup=1 profile.active=3 profile.timed=2" in doc  # loop: the short profile
    assert "#### Verdicts" in doc and "- **loop** — " in doc
    assert "Other processes' load during the profiles: " in doc
    assert re.search(r"\| padded \| [\d.]+ \| [\d.]+ \[", doc)  # the profile against training, row by row
    assert "loop against padded: training's steps give" in doc
    assert "| strategy | batch | boxes |" in doc  # bench losses' table
    charts = sorted(p.name for p in (tmp_path / "docs" / "cpu").iterdir())
    assert charts == ["counts-train.png", "memory-train.png", "ms-per-step-train.png", "timeline-train.png"]
    assert "#### Memory (mode=train): medians per step" in doc  # the profiles' memory, beside the verdicts
    assert all(f"](cpu/{chart})" in doc for chart in charts)
    (finished,) = [p for p in (tmp_path / "work" / "cpu").iterdir()]
    assert re.fullmatch(r"\d{8}-\d{6}", finished.name)  # the runs keep their timestamp; no "current" left


@pytest.mark.slow
def test_a_stopped_report_resumes_and_other_overrides_start_afresh(tmp_path, capsys, monkeypatch):
    calls = []
    real = report.run_part

    def fail_at_training(part, log):
        calls.append(part.title)
        if part.title == "train padded" and calls.count("train padded") == 1:
            raise UserError("stopped")
        real(part, log)

    monkeypatch.setattr(report, "run_part", fail_at_training)
    assert make_report(tmp_path) == 2 and not (tmp_path / "docs").exists()  # nothing written yet
    assert "error: stopped" in capsys.readouterr().err
    assert make_report(tmp_path) == 0
    assert calls.count("profile padded") == 1 and calls.count("train padded") == 2  # resumed, not redone
    assert "resuming the unfinished report" in capsys.readouterr().out

    first = (tmp_path / "docs" / "cpu.md").read_text()

    def broken(part, log):
        raise UserError("broken")

    monkeypatch.setattr(report, "run_part", broken)
    assert make_report(tmp_path) == 2
    assert (tmp_path / "docs" / "cpu.md").read_text() == first  # the last document stays until a new one is made
    assert make_report(tmp_path, "data.seed=1") == 2  # other overrides: the unfinished one is kept aside
    assert "is kept in" in capsys.readouterr().out
    assert [p.name.startswith("unfinished-") for p in (tmp_path / "work" / "cpu").iterdir()].count(True) == 1


def test_a_failing_part_is_one_line_naming_its_command_and_log(tmp_path, capsys):
    assert make_report(tmp_path, "profile.active=0") == 2  # the config refuses it before any part runs
    assert "profile.active=0 is out of range" in capsys.readouterr().err
    part = report.Part("profile nothing", ["profile", "profile.strategy=nothing"], tmp_path / "done")
    (tmp_path / "logs").mkdir()
    with pytest.raises(UserError, match=r"`python -m detector profile profile.strategy=nothing` failed \(exit 2\)"):
        report.run_part(part, tmp_path / "logs" / "01.log")
    assert (
        "unknown strategy" in (tmp_path / "logs" / "01.log").read_text()
        or "out of range" in (tmp_path / "logs" / "01.log").read_text()
    )
    assert not part.done.exists()


def test_the_device_name_becomes_a_file_name():
    assert report.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert report.device_slug("cpu") == "cpu"


def test_the_profile_against_training_table_reads_the_runs(tmp_path):
    compare = {
        "modes": {
            "train": {
                "labels": ["padded", "packed"],
                "baseline": "padded",
                "regions": {
                    "step": {
                        name: {"wall_ms": stats(ms), "device_step_ms": stats(ms * 1.01)}
                        for name, ms in (("padded", 43.0), ("packed", 42.0))
                    }
                },
                "timed": {"padded": stats(43.5), "packed": stats(42.5)},
                "step_verdicts": {"padded": None, "packed": None},
            }
        }
    }
    for name, ms in (("padded", 43.2), ("packed", 42.1)):
        run = tmp_path / "train" / name / "default" / f"{name}+compile"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"step_ms": ms, "history": [[10, 1.0]]}))
    written = ComparisonRecord.parse(compare, "compare.json")  # as written before compare.json had a version
    text = report.profile_vs_training(tmp_path, written, ["padded", "packed"])
    assert "| padded | 43.2 | 43.0 [42.6–43.4] | 0.995 | 43.4 [43.0–43.9] | 1.005 | 43.5 [43.1–43.9] | 1.007 |" in text
    assert "within 1.0 % of training's" in text  # packed's timed step: 42.5 / 42.1
    assert "packed against padded: training's steps give 1.026× (padded's step / packed's); the profile's " in text


COMPARED = {
    "modes": {
        "train": {
            "labels": ["padded", "packed"],
            "baseline": "padded",
            "regions": {"step": {"padded": {"wall_ms": {}}, "packed": {"wall_ms": {}}}},
            "timed": {},
        }
    }
}


def trained(tmp_path, name: str, record) -> Path:
    """A training run's summary.json of the report's ``name``, holding ``record`` (a dict, or the file's text)."""
    run = tmp_path / "train" / name / "default" / name
    run.mkdir(parents=True)
    (run / "summary.json").write_text(record if isinstance(record, str) else json.dumps(record))
    return run / "summary.json"


@pytest.mark.parametrize("value", [None, float("nan"), -124.922, float("inf"), "fast"])
def test_a_training_run_without_a_usable_step_time_is_a_row_without_ratios(tmp_path, value):
    """A run that timed no step (null) or whose step time is damaged: its row shows what there is, the other rows
    their ratios, and a damaged value is one warning naming the file and the field; never "nan %" or -124.922."""
    compare = json.loads(json.dumps(COMPARED))
    for name, ms in (("padded", 43.0), ("packed", 42.0)):
        compare["modes"]["train"]["regions"]["step"][name]["wall_ms"] = stats(ms)
    written = ComparisonRecord.parse(compare, "compare.json")
    trained(tmp_path, "padded", {"step_ms": 43.2, "history": [[10, 1.0]]})
    packed = trained(tmp_path, "packed", {"step_ms": value, "history": [[10, 1.0]]})
    text = report.profile_vs_training(tmp_path, written, ["padded", "packed"])
    assert "| padded | 43.2 | 43.0 [42.6–43.4] | 0.995 | — | — | — | — |" in text
    assert "| packed | — | 42.0 [41.6–42.4] | — | — | — | — | — |" in text
    assert "within 0.5 % of training's" in text and "packed against padded" not in text
    shown = "\n".join(line for line in text.splitlines() if not line.startswith("**warning**")).lower()
    assert "nan" not in shown and "infinity" not in shown and "-124" not in shown
    warnings = [line for line in text.splitlines() if line.startswith("**warning**")]
    if value is None:  # not measured: nothing to warn of
        assert warnings == []
    else:
        value = repr(value) if isinstance(value, str) else json.dumps(value)
        assert warnings == [
            f"**warning**: {packed}: step_ms is {value}, expected a finite number in [0, 1e15]: left out"
        ]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{", "not JSON (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 co)"),
        ('{"version": 9, "history": []}', "version 9, this detector reads versions 1 and 2"),
        ('{"history": [], "strategy": 3}', "summary.json.strategy is int 3, expected a string"),
    ],
)
def test_a_training_summary_that_cannot_be_read_is_one_line_and_the_others_are_shown(tmp_path, text, reason):
    compare = json.loads(json.dumps(COMPARED))
    compare["modes"]["train"]["regions"]["step"]["padded"]["wall_ms"] = stats(43.0)
    written = ComparisonRecord.parse(compare, "compare.json")
    trained(tmp_path, "padded", {"step_ms": 43.2, "history": [[10, 1.0]]})
    packed = trained(tmp_path, "packed", text)
    shown = report.profile_vs_training(tmp_path, written, ["padded", "packed"])
    assert "| padded | 43.2 | 43.0 [42.6–43.4] | 0.995 |" in shown and "| packed |" not in shown
    (warning,) = [line for line in shown.splitlines() if line.startswith("**warning**")]
    assert warning.startswith(f"**warning**: {packed}") and reason in warning


def stats(median: float) -> dict:
    return {
        "median": median,
        "q1": median * 0.99,
        "q3": median * 1.01,
        "min": median * 0.98,
        "max": median * 1.02,
        "n": 5,
    }


@pytest.mark.parametrize("noise, force, replaced", [(QUIET, False, True), (BUSY, False, False), (BUSY, True, True)])
def test_a_noisy_report_does_not_replace_the_document_unless_told_to(tmp_path, capsys, noise, force, replaced):
    """A finished report's parts are in its run folder; the document it would replace stays where the noise check
    flags a profile, and the new one is written into the run folder."""
    docs, work = tmp_path / "docs", tmp_path / "work" / "cpu" / "current"
    docs.mkdir()
    (docs / "cpu.md").write_text("# the committed report\n")
    make_run(work / "profile", "padded", "20261122-031500", gpu=False, noise=noise)
    (work / "compare").mkdir()
    (work / "compare" / "compare.json").write_text(json.dumps({"modes": {}}))
    (work / "compare" / "compare.md").write_text("# compared\n\n## mode=train\n\nverdicts\n")
    (work / "bench").mkdir()
    (work / "bench" / "losses.md").write_text("### Which strategy should I use?\n\n| a table |\n")
    folders = [f"report.out_dir={docs}", f"report.work_dir={tmp_path / 'work'}", f"report.force={force}"]
    cfg = load_config(["device=cpu", "preset=cpu", *folders], announce=None)
    path = report.finish(cfg, torch.device("cpu"), work, [], {}, [])
    out = capsys.readouterr().out
    assert (path == docs / "cpu.md") == replaced
    kept = (docs / "cpu.md").read_text() == "# the committed report\n"
    assert kept == (not replaced)
    assert "Other processes' load during the profiles: at most" in path.read_text()
    if not replaced:
        assert path.parent.parent == tmp_path / "work" / "cpu" and path.name == "cpu.md"
        assert "the noise check flags 1 of its profiles (padded: other processes kept 1.9 of 2 cores busy" in out
        assert "make report ARGS=report.force=true" in out


def test_names_holding_markup_come_out_escaped_in_the_document(tmp_path, monkeypatch):
    """A noisy profile's strategy, a strategy not profiled, the overrides and the commit named with a tag and pipes:
    the document shows each as written, as text."""
    monkeypatch.setenv("DETECTOR_COMMIT", MARKUP_NAME)
    docs, work = tmp_path / "docs", tmp_path / "work" / "cpu" / "current"
    run = make_run(work / "profile", "padded", "20261122-031500", gpu=False, noise=BUSY)
    edit_summary(run, lambda summary: summary.update(strategy=MARKUP_NAME))
    (work / "compare").mkdir()
    (work / "compare" / "compare.json").write_text(json.dumps({"modes": {}}))
    (work / "compare" / "compare.md").write_text("# compared\n\n## mode=train\n\nverdicts\n")
    (work / "bench").mkdir()
    (work / "bench" / "losses.md").write_text("### Which strategy should I use?\n\n| a table |\n")
    overrides = [f"data.boxes={MARKUP_NAME}"]
    cfg = load_config(["device=cpu", "preset=cpu", f"report.out_dir={docs}", f"report.work_dir={tmp_path / 'work'}"])
    path = report.finish(cfg, torch.device("cpu"), work, [], {MARKUP_NAME: f"not here: {MARKUP_NAME}"}, overrides)
    page = rendered(path.read_text())
    assert "<script" not in page and page.count(SHOWN) == 5  # the commit, the overrides, the noisy run, the skipped
    assert f"the noise check flags {SHOWN} (each run" in page and f"<li>{SHOWN}: not here: {SHOWN}</li>" in page


@pytest.mark.parametrize(
    "compare, reason",
    [
        ("{", "compare.json: not JSON (JSONDecodeError"),
        ('{"version": 9, "modes": {}}', "compare.json: version 9, this detector reads versions 1 and 2"),
        ('{"modes": []}', "compare.json.modes is list [], expected an object"),
        (
            json.dumps(
                {"modes": {"train": {"labels": [], "regions": {"step": {"padded": {"wall_ms": {"median": -1}}}}}}}
            ),
            "compare.json: modes.train.regions.step.padded.wall_ms.median is -1, expected a finite number in [0, 1e15]",
        ),
    ],
    ids=["not-json", "version", "wrong-type", "negative"],
)
def test_a_compare_json_that_cannot_be_read_is_a_warning_in_the_document_not_a_traceback(tmp_path, compare, reason):
    docs, work = tmp_path / "docs", tmp_path / "work" / "cpu" / "current"
    make_run(work / "profile", "padded", "20261122-031500", gpu=False)
    (work / "compare").mkdir()
    (work / "compare" / "compare.json").write_text(compare)
    (work / "compare" / "compare.md").write_text("# compared\n\n## mode=train\n\nverdicts\n")
    (work / "bench").mkdir()
    (work / "bench" / "losses.md").write_text("### Which strategy should I use?\n\n| a table |\n")
    trained(work, "padded", {"step_ms": None, "history": [[10, 1.0]]})  # a run that timed no step
    folders = [f"report.out_dir={docs}", f"report.work_dir={tmp_path / 'work'}", "report.train_strategies=[padded]"]
    cfg = load_config(["device=cpu", "preset=cpu", *folders], announce=None)
    doc = report.finish(cfg, torch.device("cpu"), work, [], {}, []).read_text()
    (warning,) = [line for line in doc.splitlines() if line.startswith("**warning**")]
    assert warning.startswith(f"**warning**: {work / 'compare' / 'compare.json'}") and reason in warning
    assert "| a table |" in doc and "verdicts" in doc  # the rest of the document
    assert "(no strategy both trained and profiled)" in doc


def test_a_synchronised_profile_that_cannot_be_read_is_one_line(tmp_path):
    synced = make_run(tmp_path / "synced", "padded", "20261122-031500", gpu=False)
    (synced / "summary.json").write_text('{"version": 9}')
    compare = json.loads(json.dumps(COMPARED))
    compare["modes"]["train"]["regions"]["step"]["padded"]["wall_ms"] = stats(43.0)
    text = report.synced_section(tmp_path, ComparisonRecord.parse(compare, "compare.json"))
    why = "version 9, this detector reads versions 1 and 2"
    assert text == f"(no synchronised profile: {synced / 'summary.json'}: {why})"
