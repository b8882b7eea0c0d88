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
from detector.lab.record.steps import EXTRACT, Extract, read_extract


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


def test_the_runs_times_read_back_and_a_summary_written_before_them_reads_without(run, tmp_path):
    data = json.loads((run / "summary.json").read_text())
    del data["times"]  # written before the runs' parts were timed
    (tmp_path / "summary.json").write_text(json.dumps(data))
    assert read_summary(tmp_path).times is None and read_summary(tmp_path).left_out == []
    seconds = {"model and optimizer": 0.4, "first step": 12.3, "3 more steps": 0.05, "trace written": 2.1}
    data["times"] = {"seconds": seconds, "compile_cache": "compile cache 5 MiB loaded (5 inductor, 9 autotune)"}
    (tmp_path / "summary.json").write_text(json.dumps(data))
    record = read_summary(tmp_path)
    assert record.times.describe() == (
        "model and optimizer 0.4 s, first step 12.3 s (compile cache 5 MiB loaded (5 inductor, 9 autotune)), "
        "3 more steps 50 ms, trace written 2.1 s"
    )
    write_summary(tmp_path, record)
    assert read_summary(tmp_path).times == record.times
    data["times"]["seconds"]["trace written"] = -1
    (tmp_path / "summary.json").write_text(json.dumps(data))
    record = read_summary(tmp_path)
    assert record.times is None and record.left_out == [
        f"{tmp_path / 'summary.json'}: times.seconds.trace written is -1, expected a finite number in [0, 1e15]: "
        "times left out"
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(version=3), "version 3, this detector reads versions 1 and 2"),
        (lambda d: d.pop("per_step"), "no per_step: not written by (this version of) make profile"),
        (lambda d: d["analysis"].update(warnings="none"), "analysis.warnings is str 'none', expected a list"),
        (lambda d: d["analysis"]["regions"]["step"].update(wall_ms=[1]), "regions.step.wall_ms is list [1]"),
        (lambda d: d["timed"].update(wall_ms=3), "timed.wall_ms is int 3, expected a list"),
        (lambda d: d["noise"].update(timed_by=0.5), "noise.timed_by is float 0.5, expected a string"),
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


@pytest.mark.parametrize(
    "change, warning",
    [
        (
            lambda d: d["timed"].update(wall_ms=[1, "x"]),
            "timed.wall_ms[1] is 'x', expected a finite number in [0, 1e15]: timed left out",
        ),
        (
            lambda d: d["noise"].update(load_during=float("nan")),
            "noise.load_during is NaN, expected a finite number in [0, 1e15]: noise left out",
        ),
        (
            lambda d: d["analysis"]["regions"]["forward"]["wall_ms"].update(q3=-1.0),
            "analysis.regions.forward.wall_ms.q3 is -1.0, expected a finite number in [0, 1e15]: "
            "analysis.regions.forward.wall_ms left out",
        ),
        (
            lambda d: d["per_step"][1]["regions"]["calc loss"].update(ops=float("inf")),
            "per_step[1].regions.calc loss.ops is Infinity, expected a finite number in [0, 1e15]: "
            "per_step[1] left out",
        ),
    ],
    ids=["timed", "noise", "spread", "step"],
)
def test_a_damaged_value_leaves_out_the_part_that_holds_it_with_one_warning(run, tmp_path, change, warning):
    data = json.loads((run / "summary.json").read_text())
    change(data)
    (tmp_path / "summary.json").write_text(json.dumps(data))
    record = read_summary(tmp_path)
    assert record.left_out == [f"{tmp_path / 'summary.json'}: {warning}"]
    assert record.stats("step").n == 3 and "left_out" not in record.to_json()  # the rest read; nothing written back
    assert (record.timed is None, record.noise is None) == (warning.startswith("timed"), warning.startswith("noise"))
    assert len(record.per_step) == (2 if warning.startswith("per_step") else 3)


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
        (
            lambda d: [step["regions"]["calc loss"].update(peak_rise_bytes=-1e9) for step in d["per_step"]],
            "per_step has no step whose measures are all usable (per_step[0].regions.calc loss.peak_rise_bytes is "
            "-1000000000.0, expected a finite number in [0, 1e15]: per_step[0] left out; 2 more steps likewise): no "
            "profiled step to time the run by",
        ),
    ],
    ids=["nan", "-1e308", "null", "a-region-inf", "no-wall", "empty", "wrong-type", "every-step-damaged"],
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


def test_an_extract_without_a_steps_measures_is_refused(tmp_path):
    step = {"dur": 1, "regions": [], "calls": [], "threads": [], "streams": []}
    data = {"version": 1, "gpu": True, "representative_step": 1, "steps": {"1": step}, "names": ["k"], "about": {}}
    path = tmp_path / EXTRACT
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(RecordError, match=r"step 1.why is NoneType"):
        read_extract(path)


GOOD_STEP = {
    "dur": 10.0,
    "start": 4.4e12,
    "regions": [["forward", 0.0, 4.0]],
    "threads": [{"tid": 7, "ops": [[-2.0, 4.0, 0]]}],  # an operator begun before the step: a negative start
    "calls": [[1.0, 0.5, 0, 0, 0, 1]],
    "streams": [{"stream": "7", "events": [[2.0, 3.0, 0, 0, 0]]}],
    "why": {"forward": {"launches": 1, "gpu_idle_share": 0.5}},
    "memory": {"device": "cuda:0", "start": 1000, "events": 2, "rows": [[1.0, 1100, 100, 0], [2.0, 1000, -100, -1]]},
}


@pytest.mark.parametrize(
    "damage, warning",
    [
        (
            lambda s: s.update(dur=float("nan")),
            "step 2.dur is NaN, expected a finite number in [0, 1e15]: step 2 left out",
        ),
        (lambda s: s.update(dur="1"), "step 2.dur is '1', expected a finite number in [0, 1e15]: step 2 left out"),
        (lambda s: s.update(start=float("inf")), "step 2.start is Infinity, expected a finite number in [0, 1e18]"),
        (
            lambda s: s["regions"].append(["forward", 0]),
            'step 2.regions[1] is ["forward", 0], expected [name, start, duration]',
        ),
        (
            lambda s: s["regions"][0].__setitem__(2, -4.0),
            "step 2.regions[0].duration is -4.0, expected a finite number",
        ),
        (lambda s: s["calls"][0].__setitem__(3, 99), "step 2.calls[0].name is 99, expected an integer in [0, 0]"),
        (
            lambda s: s["calls"][0].__setitem__(0, 1e300),
            "step 2.calls[0].start is 1e+300, expected a finite number in [-1e15, 1e15]",
        ),
        (
            lambda s: s["streams"][0]["events"][0].__setitem__(4, 5),
            "step 2.streams[0].events[0].call is 5, expected an integer in [0, 0]",
        ),
        (
            lambda s: s["threads"][0]["ops"][0].__setitem__(1, float("-inf")),
            "step 2.threads[0].ops[0].duration is -Infinity",
        ),
        (
            lambda s: s["why"]["forward"].update(launches=-1),
            "step 2.why.forward.launches is -1, expected a finite number in [0, 1e15]",
        ),
    ],
    ids=[
        "nan-dur",
        "str-dur",
        "inf-start",
        "short-row",
        "negative-region",
        "name-past-table",
        "start-1e300",
        "no-call",
        "op-inf",
        "negative-why",
    ],
)
def test_a_damaged_step_of_an_extract_is_left_out_and_the_others_kept(tmp_path, damage, warning):
    """The Traces tab and compare's timeline draw the others, never a NaN or a step of -1e300 µs."""
    steps = {"1": json.loads(json.dumps(GOOD_STEP)), "2": json.loads(json.dumps(GOOD_STEP))}
    damage(steps["2"])
    data = {"version": 1, "gpu": True, "representative_step": 1, "steps": steps, "names": ["k"], "about": {}}
    path = tmp_path / EXTRACT
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    found = read_extract(path)
    assert list(found.steps) == ["1"] and found.steps["1"].to_json() == GOOD_STEP
    (line,) = found.left_out
    assert line.startswith(f"{path}: {warning}") and line.endswith(": step 2 left out")


@pytest.mark.parametrize(
    "row, warning",
    [
        ([1.0, -(10**12), 0, -1], "rows[0].allocated is -1000000000000, expected an integer in [0, 1e15]"),
        ([float("nan"), 1100, 100, 0], "rows[0].start is NaN, expected a finite number in [-1e15, 1e15]"),
        ([1.0, 1100, 1e300, 0], "rows[0].bytes is 1e+300, expected an integer in [-1e15, 1e15]"),
        ([1.0, 1100, 100, 7], "rows[0].operator is 7, expected an integer in [-1, 0]"),
    ],
)
def test_a_damaged_memory_row_leaves_the_steps_memory_out_and_the_step_in(tmp_path, row, warning):
    """A free's bytes are negative; the bytes allocated never are: a memory lane of -1e12 bytes is damage."""
    step = json.loads(json.dumps(GOOD_STEP))
    step["memory"]["rows"][0] = row
    data = {"version": 1, "gpu": True, "representative_step": 1, "steps": {"1": step}, "names": ["k"], "about": {}}
    found = Extract.parse(data, "extract.json.gz")
    assert found.steps["1"].memory is None and found.steps["1"].dur == 10.0
    assert found.left_out == [f"extract.json.gz: step 1.memory.{warning}: step 1.memory left out"]
    assert "left_out" not in found.to_json() and found.to_json()["version"] == 1


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
