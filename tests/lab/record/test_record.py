"""The profile run's record (detector/lab/record/run.py, steps.py): written and read back the same, an older version
converted, a file of the wrong shape or size refused in one line naming the file and the field; the machine's noise
(detector/lab/record/noise.py) judged."""

import gzip
import json

import pytest
from lab_helpers import BUSY, QUIET, make_run

from detector.checked import RecordError
from detector.lab.record.noise import Noise
from detector.lab.record.run import read_summary, write_summary
from detector.lab.record.steps import EXTRACT, read_extract


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs") / "profile", "padded", "20261122-031500")


def test_a_record_reads_back_as_it_was_written(run, tmp_path):
    record = read_summary(run)
    assert record.version == 2 and record.folder == run and record.left_out == []
    assert record.stats("step").n == 3 and record.stats("forward", "launches").median == 49
    assert record.stats("nowhere") is None and record.median("nowhere") == 0.0
    assert record.timed_step().n == 5 and record.noise == QUIET
    copy = tmp_path / "copy"
    copy.mkdir()
    write_summary(copy, record)
    assert read_summary(copy).to_json() == record.to_json()


def test_a_version_1_summary_is_converted_with_its_noise_unknown(run, tmp_path):
    data = json.loads((run / "summary.json").read_text())
    del data["version"], data["noise"]
    (tmp_path / "summary.json").write_text(json.dumps(data))
    record = read_summary(tmp_path)
    assert record.noise is None and record.stats("step").median == read_summary(run).stats("step").median


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(version=3), "version 3, this detector reads versions 1 and 2"),
        (lambda d: d.pop("per_step"), "no per_step: not written by (this version of) make profile"),
        (lambda d: d["analysis"].update(warnings="none"), "analysis.warnings is str 'none', expected a list"),
        (lambda d: d["analysis"]["regions"]["step"].update(wall_ms=[1]), "regions.step.wall_ms is list [1]"),
        (lambda d: d["timed"].update(wall_ms=[1, "x"]), "timed.wall_ms is str 'x', expected a number"),
        (lambda d: d["noise"].update(load_during="high"), "noise.load_during is str 'high', expected a number"),
        (lambda d: d.update(trace=7), "trace is int 7, expected a string"),
    ],
)
def test_a_summary_of_the_wrong_shape_is_one_line_naming_the_field(run, tmp_path, change, message):
    data = json.loads((run / "summary.json").read_text())
    change(data)
    (tmp_path / "summary.json").write_text(json.dumps(data))
    with pytest.raises(RecordError, match="summary.json") as err:
        read_summary(tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def set_walls(value):
    """A change of a summary: every profiled step's wall time set to ``value``."""
    return lambda d: [step["regions"]["step"].update(wall_ms=value) for step in d["per_step"]]


@pytest.mark.parametrize(
    "change, message",
    [
        (set_walls(float("nan")), "per_step[0].regions.step.wall_ms is NaN: not a step's time in ms"),
        (set_walls(-1e308), "per_step[0].regions.step.wall_ms is -1e+308: not a step's time in ms"),
        (set_walls(None), "per_step[0].regions.step.wall_ms is null: not a step's time in ms"),
        (lambda d: d["per_step"][1]["regions"]["forward"].update(wall_ms=float("inf")), "per_step[1].regions.forward"),
        (lambda d: d["per_step"][2]["regions"]["step"].pop("wall_ms"), "per_step[2].regions.step has no wall_ms"),
        (lambda d: d.update(per_step=[]), "per_step is empty: no profiled step to time the run by"),
        (lambda d: d["per_step"][0].update(regions=[]), "per_step[0].regions is list [], expected an object"),
    ],
    ids=["nan", "-1e308", "null", "a-region-inf", "no-wall", "empty", "wrong-type"],
)
def test_a_summary_whose_steps_cannot_time_the_run_is_refused_naming_the_file_and_the_field(
    run, tmp_path, change, message
):
    """Compare, report and the Traces tab leave such a run out with this line, where compare met a TypeError."""
    data = json.loads((run / "summary.json").read_text())
    change(data)
    (tmp_path / "summary.json").write_text(json.dumps(data))
    with pytest.raises(RecordError) as err:
        read_summary(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'summary.json'}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_extract_that_would_decompress_past_its_cap_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    """A small gzip of a huge JSON (a zip bomb): refused once its cap is read, in one line."""
    monkeypatch.setattr("detector.lab.record.steps.EXTRACT_BYTES", 2**20)
    path = tmp_path / EXTRACT
    path.write_bytes(gzip.compress(b"[" + b"0," * (4 * 2**20) + b"0]", compresslevel=9))
    assert path.stat().st_size < 50_000
    with pytest.raises(RecordError, match=r"larger than 1 MiB decompressed: not a record this lab writes"):
        read_extract(path)


def test_an_extract_of_an_earlier_run_is_read_as_typed_steps(tmp_path):
    """An extract written before ranks were aligned (no ``start``) and before memory was recorded (no ``memory``): its
    steps read with neither, and are written back as they were."""
    step = {
        "dur": 10.0,
        "regions": [["forward", 0.0, 4.0]],
        "threads": [{"tid": 7, "ops": [[0.0, 4.0, 0]]}],
        "calls": [[1.0, 0.5, 0, 0, 0, 1]],
        "streams": [{"stream": "7", "events": [[2.0, 3.0, 0, 0, 0]]}],
        "why": {"forward": {"launches": 1}},
    }
    data = {"version": 1, "gpu": True, "representative_step": 1, "steps": {"1": step}, "names": ["k"], "about": {}}
    path = tmp_path / EXTRACT
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    found = read_extract(path).steps["1"]
    assert (found.start, found.memory, found.threads[0].tid, found.streams[0].events) == (
        None,
        None,
        7,
        [[2, 3, 0, 0, 0]],
    )
    assert found.to_json() == step


@pytest.mark.parametrize(
    "step, message",
    [
        ({"dur": 1, "regions": [["forward", 0]], "calls": [], "threads": [], "streams": [], "why": {}}, "a row"),
        ({"dur": "1", "regions": [], "calls": [], "threads": [], "streams": [], "why": {}}, r"step 1.dur is str '1'"),
        ({"dur": 1, "regions": [], "calls": [], "threads": [], "streams": []}, r"step 1.why is NoneType"),
        ({"dur": 1, "regions": [], "calls": [[0, 1, 0, 99, 0, 1]], "threads": [], "streams": [], "why": {}}, "calls"),
        (
            {"dur": 1, "regions": [], "calls": [], "threads": [], "why": {}}
            | {"streams": [{"stream": "7", "events": [[0, 1, 0, 0, 5]]}]},
            "not launched by one of its calls",
        ),
    ],
)
def test_an_extract_of_the_wrong_shape_is_refused(tmp_path, step, message):
    data = {"version": 1, "gpu": True, "representative_step": 1, "steps": {"1": step}, "names": ["k"], "about": {}}
    path = tmp_path / EXTRACT
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(RecordError, match=message):
        read_extract(path)


# ----------------------------------------------------------------------------- noise


def test_noise_reasons_name_the_load_and_the_spread():
    assert QUIET.reasons() == []
    assert BUSY.reasons() == [
        "other processes kept 1.9 of 2 cores busy during it",
        "its timed steps spread ±15 % around their median",
    ]
    assert Noise(cores=4).reasons() == [] and "unknown" in Noise(cores=4).describe()


def test_others_load_is_noise_where_it_leaves_the_run_no_idle_core():
    """On 2 cores a third of one beside a run of 1.5 competes with it; on a 32-core GPU host 1.5 cores beside a run
    of 3 do not (such a run's timed steps spread under 1 %); without the run's own load, a quarter core is noise."""
    assert Noise(cores=2, load_during=0.3, load_own=1.5).reasons() == [
        "other processes kept 0.3 of 2 cores busy during it"
    ]
    assert Noise(cores=32, load_during=1.5, load_own=3.0, timed_spread=0.004).reasons() == []
    assert Noise(cores=32, load_during=29.0, load_own=3.0).reasons()  # the host full: it competes again
    assert Noise(cores=32, load_during=1.5).reasons()  # an older record: the run's own load unknown
    assert Noise(cores=2, load_during=0.2, load_own=1.9).reasons() == []  # under a quarter core: quiet


def test_a_spread_is_noise_beyond_what_a_quiet_machine_of_its_clock_shows():
    """Timed by CUDA events a GPU's steps spread under 1 % when quiet: 14 % is noise. The CPU's wall times spread up
    to ~18 % on 2 quiet cores: 12 % is not, 60 % (two busy loops beside) is."""
    assert Noise(cores=32, timed_spread=0.28, timed_by="device").reasons() == [
        "its timed steps spread ±14 % around their median"
    ]
    assert Noise(cores=32, timed_spread=0.003, timed_by="device").reasons() == []
    assert Noise(cores=2, timed_spread=0.12).reasons() == [] and Noise(cores=2, timed_spread=0.6).reasons()
    # a GPU step that the host paces is held to the host's spread, whatever clock timed it
    assert Noise(cores=16, timed_spread=0.2, timed_by="device").reasons(paced_by="host") == []
