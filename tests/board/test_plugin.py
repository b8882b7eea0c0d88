"""The per-step extract (detector/lab/extract.py) and the Traces tab's routes (detector/board/plugin.py), without a
browser (tests/board/test_browser.py drives the tab itself)."""

import gzip
import json

import pytest
from lab_helpers import GPU_TRACE, make_run
from tensorboard.plugins.base_plugin import TBContext
from trace_helpers import AUTOGRAD, MAIN, synthetic_events
from werkzeug.test import Client

from detector.board.plugin import TracesPlugin
from detector.lab import extract
from detector.lab.analysis import measure_steps
from detector.lab.record import EXTRACT, EXTRACT_VERSION, RecordError, read_summary

# ----------------------------------------------------------------------------- the extract


def test_extract_of_the_hand_written_trace():
    found = extract.build(synthetic_events(), about={"strategy": "padded"})
    assert found.version == EXTRACT_VERSION and found.about == {"strategy": "padded"} and found.gpu
    assert list(found.steps) == ["5", "6"] and found.representative_step in (5, 6)
    names = found.names
    step = found.steps["5"]
    assert step["dur"] == 1000
    assert [r[0] for r in step["regions"]] == ["data wait", "copy data", "forward", "calc loss", "backward"]
    assert step["regions"][2] == ["forward", 200, 200]
    # threads: the main one first, then the autograd thread (found by its process, not its name)
    assert [t["tid"] for t in step["threads"]] == [MAIN, AUTOGRAD]
    main_ops = [names[op[2]] for op in step["threads"][0]["ops"]]
    assert main_ops[:2] == ["aten::linear", "aten::relu"]  # aten::addmm runs inside aten::linear: not top level
    # calls: launches (flag 1) and syncs (flag 2) and those that launched copies; the lab's syncs are not syncs
    calls = {names[c[3]]: c for c in step["calls"]}
    assert calls["cudaGraphLaunch"][5] == extract.LAUNCH and calls["cudaEventSynchronize"][5] == extract.SYNC
    assert calls["cudaMemsetAsync"][5] == 0  # it launched a memset: kept, neither launch nor sync
    assert sum(1 for c in step["calls"] if names[c[3]] == "cudaDeviceSynchronize" and c[5]) == 1  # the bare one
    region = {c[0]: c[4] for c in step["calls"]}
    assert region[210] == 2 and region[900] == -1  # forward's launch; the .item() after the regions: "other"
    # GPU work by launch, whenever it ran: forward's late kernel runs at 1200 µs, in step 6's time
    stream7 = next(s for s in step["streams"] if s["stream"] == "7")
    late = next(e for e in stream7["events"] if names[e[3]] == "late")
    assert late[:2] == [1200, 100] and names[step["calls"][late[4]][3]] == "cudaLaunchKernel"
    assert not any(names[e[3]] == "late" for s in found.steps["6"]["streams"] for e in s["events"])
    assert step["why"]["forward"]["launches"] == 5 and "gpu_idle_share" not in step["why"]["forward"]


def test_extract_is_written_once_and_converted_for_older_runs(tmp_path):
    run = make_run(tmp_path / "profile", "padded", "20261122-031500")
    record = read_summary(run)
    (run / EXTRACT).unlink()  # an older run: converted from its trace on first read, and kept
    found = extract.load(run, record)
    assert (run / EXTRACT).is_file() and list(found.steps) == ["10", "11", "12"]
    assert found.about["strategy"] == "padded"
    assert extract.load(run, record) == found
    (run / EXTRACT).write_bytes(b"not gzip")
    with pytest.raises(RecordError, match="extract.json.gz: not JSON"):
        extract.load(run, record)
    (run / EXTRACT).unlink()
    (run / record.trace).unlink()
    with pytest.raises(RecordError, match="no extract.json.gz and no trace to build one from"):
        extract.load(run, record)


def test_the_extract_stays_small():
    """A seed-scale GPU step is tens of kilobytes: the tab reads it, not the trace."""
    found = extract.build(GPU_TRACE, measure_steps(GPU_TRACE))
    per_step = len(gzip.compress(json.dumps(found.to_json()).encode())) / len(found.steps)
    assert per_step < 30_000


# ----------------------------------------------------------------------------- the routes


@pytest.fixture
def logdir(tmp_path):
    root = tmp_path / "runs"
    older = make_run(root / "profile", "padded", "20261122-031500")
    (older / EXTRACT).unlink()  # a run of a version that wrote no extract: converted on first read
    make_run(root / "profile", "cuda_fused", "20261122-031600", scale=0.5)
    broken = make_run(root / "profile", "concat", "20261122-031700")
    (broken / EXTRACT).unlink()
    (broken / read_summary(broken).trace).unlink()
    (root / "train" / "x" / "padded").mkdir(parents=True)
    (root / "train" / "x" / "padded" / "summary.json").write_text('{"steps": 3}')  # a training run's: not listed
    (root / "profile" / "loop" / "1").mkdir(parents=True)
    (root / "profile" / "loop" / "1" / "summary.json").write_text("{")
    return root


def client(logdir) -> Client:
    plugin = TracesPlugin(TBContext(logdir=str(logdir)))
    apps = plugin.get_plugin_apps()

    def app(environ, start_response):
        return apps[environ["PATH_INFO"]](environ, start_response)

    return plugin, Client(app)


def test_runs_lists_profile_runs_and_why_others_are_not_shown(logdir):
    plugin, http = client(logdir)
    response = http.get("/runs")
    assert response.status_code == 200
    listing = response.get_json()
    assert [r["run"] for r in listing["runs"]] == [
        "profile/padded/20261122-031500",
        "profile/cuda_fused/20261122-031600",
    ]
    padded = listing["runs"][0]
    assert (padded["strategy"], padded["mode"], padded["steps"], padded["extract"]) == (
        "padded",
        "train",
        [10, 11, 12],
        False,
    )
    skipped = {s["run"]: s["reason"] for s in listing["skipped"]}
    assert skipped == {
        "profile/concat/20261122-031700": "no extract.json.gz and no trace to build one from",
        "profile/loop/1": "not JSON (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 co)",
    }
    assert listing["colors"]["regions"]["forward"] == "#1f77b4" and "gpu" not in listing["colors"]
    assert listing["measures"]["launches"]["header"] == "launches" and "gpu_ms" in listing["why"]
    assert plugin.is_active() and plugin.frontend_metadata().tab_name == "Traces"
    assert not TracesPlugin(TBContext(logdir=str(logdir / "nothing"))).is_active()


def test_step_serves_one_step_and_converts_an_older_run(logdir):
    _, http = client(logdir)
    response = http.get("/step?run=profile/padded/20261122-031500&step=11")
    assert response.status_code == 200
    step = response.get_json()
    assert (
        step["step"] == 11 and step["gpu"] and {"regions", "threads", "calls", "streams", "why", "names"} <= set(step)
    )
    assert (logdir / "profile" / "padded" / "20261122-031500" / EXTRACT).is_file()  # converted, kept
    fast = http.get("/step?run=profile/cuda_fused/20261122-031600&step=10").get_json()
    assert fast["dur"] == pytest.approx(step["dur"] / 2, rel=0.3)


@pytest.mark.parametrize(
    "query, status, message",
    [
        ("run=profile/nope/1&step=10", 404, "no profile run 'profile/nope/1'"),
        ("run=../../etc&step=10", 404, "no profile run '../../etc'"),
        ("run=profile/padded/20261122-031500&step=99", 404, "has no step '99' (its steps: 10, 11, 12)"),
        ("run=profile/concat/20261122-031700&step=10", 404, "no profile run"),
    ],
)
def test_step_refuses_what_it_cannot_serve_in_one_line(logdir, query, status, message):
    _, http = client(logdir)
    response = http.get(f"/step?{query}")
    assert response.status_code == status and message in response.get_json()["error"]


def test_index_js_is_the_module_shipped_in_the_package(logdir):
    _, http = client(logdir)
    response = http.get("/index.js")
    assert response.status_code == 200 and response.mimetype == "text/javascript"
    body = response.get_data(as_text=True)
    assert "export async function render()" in body
    assert "https://" not in body and "http://" not in body  # no network: nothing is fetched from elsewhere
