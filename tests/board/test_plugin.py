"""The per-step extract (detector/lab/measure/extract.py) and the Traces tab's routes (detector/board/plugin.py),
without a browser (tests/board/test_browser.py drives the tab itself)."""

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest
from lab_helpers import GPU_TRACE, edit_summary, make_run, rank_runs
from tensorboard.plugins.base_plugin import TBContext
from trace_helpers import AUTOGRAD, MAIN, synthetic_events
from werkzeug.test import Client

from detector.board.plugin import STATIC, TracesPlugin, inside
from detector.checked import RecordError
from detector.lab.measure import extract
from detector.lab.measure.analysis import measure_steps
from detector.lab.measure.trace import load_trace
from detector.lab.record import run as records
from detector.lab.record import steps as extracts
from detector.lab.record.run import read_summary
from detector.lab.record.steps import EXTRACT, EXTRACT_VERSION

# ----------------------------------------------------------------------------- the extract


def test_extract_of_the_hand_written_trace():
    found = extract.build(synthetic_events(), about={"strategy": "padded"})
    assert found.version == EXTRACT_VERSION and found.about == {"strategy": "padded"} and found.gpu
    assert list(found.steps) == ["5", "6"] and found.representative_step in (5, 6)
    names = found.names
    step = found.steps["5"]
    assert step.dur == 1000
    assert [r[0] for r in step.regions] == ["data wait", "copy data", "forward", "calc loss", "backward"]
    assert step.regions[2] == ["forward", 200, 200]
    # threads: the main one first, then the autograd thread (found by its process, not its name)
    assert [t.tid for t in step.threads] == [MAIN, AUTOGRAD]
    main_ops = [names[op[2]] for op in step.threads[0].ops]
    assert main_ops[:2] == ["aten::linear", "aten::relu"]  # aten::addmm runs inside aten::linear: not top level
    # calls: launches (flag 1) and syncs (flag 2) and those that launched copies; the lab's syncs are not syncs
    calls = {names[c[3]]: c for c in step.calls}
    assert calls["cudaGraphLaunch"][5] == extract.LAUNCH and calls["cudaEventSynchronize"][5] == extract.SYNC
    assert calls["cudaMemsetAsync"][5] == 0  # it launched a memset: kept, neither launch nor sync
    assert sum(1 for c in step.calls if names[c[3]] == "cudaDeviceSynchronize" and c[5]) == 1  # the bare one
    region = {c[0]: c[4] for c in step.calls}
    assert region[210] == 2 and region[900] == -1  # forward's launch; the .item() after the regions: "other"
    # GPU work by launch, whenever it ran: forward's late kernel runs at 1200 µs, in step 6's time
    stream7 = next(s for s in step.streams if s.stream == "7")
    late = next(e for e in stream7.events if names[e[3]] == "late")
    assert late[:2] == [1200, 100] and names[step.calls[late[4]][3]] == "cudaLaunchKernel"
    assert not any(names[e[3]] == "late" for s in found.steps["6"].streams for e in s.events)
    assert step.why["forward"]["launches"] == 5 and "gpu_idle_share" not in step.why["forward"]
    assert step.memory is None and "memory" not in step.to_json()  # no memory events: no lane (measure/ tests' have)


def test_extract_is_written_once_and_converted_for_older_runs(tmp_path):
    run = make_run(tmp_path / "profile", "padded", "20261122-031500")
    record = read_summary(run)
    (run / EXTRACT).unlink()  # an older run: converted from its trace on first read, and kept
    trace = run / record.trace
    found = extract.load(run, record, trace)
    assert (run / EXTRACT).is_file() and list(found.steps) == ["10", "11", "12"]
    assert found.about["strategy"] == "padded"
    assert extract.load(run, record, trace) == found
    (run / EXTRACT).write_bytes(b"not gzip")
    with pytest.raises(RecordError, match="extract.json.gz: not JSON"):
        extract.load(run, record, trace)
    (run / EXTRACT).unlink()
    assert extract.load(run, record, trace, keep=False) == found and not (run / EXTRACT).exists()
    with pytest.raises(RecordError, match="no extract.json.gz and no trace to build one from"):
        extract.load(run, record, None)  # the caller found none that may be read
    trace.unlink()
    with pytest.raises(RecordError, match="no extract.json.gz and no trace to build one from"):
        extract.load(run, record, trace)


def test_the_extract_stays_small():
    """A seed-scale GPU step is tens of kilobytes: the tab reads it, not the trace."""
    found = extract.build(GPU_TRACE, measure_steps(GPU_TRACE))
    per_step = len(gzip.compress(json.dumps(found.to_json()).encode())) / len(found.steps)
    assert per_step < 30_000


def test_each_step_keeps_its_start_on_the_hosts_clock():
    """The ProfilerStep's own timestamp: the ranks of one host share the clock, so the tab can align them."""
    trace = load_trace(GPU_TRACE)
    found = extract.build(trace, measure_steps(trace))
    starts = {str(s.step): e["ts"] for s, e in zip(measure_steps(trace), trace.steps, strict=True)}
    assert {n: step.start for n, step in found.steps.items()} == starts
    bad = found.to_json()
    first = next(iter(starts))
    bad["steps"][first]["start"] = "soon"
    assert first not in extracts.Extract.parse(bad, "extract.json.gz").steps  # left out, with a warning


# ----------------------------------------------------------------------------- the routes


PADDED, FUSED, CONCAT = (
    "profile/padded/20261122-031500",
    "profile/cuda_fused/20261122-031600",
    "profile/concat/20261122-031700",
)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Three profile runs, made once: the tests copy them."""
    root = tmp_path_factory.mktemp("made")
    make_run(root / "profile", "padded", "20261122-031500")
    make_run(root / "profile", "cuda_fused", "20261122-031600", scale=0.5)
    make_run(root / "profile", "concat", "20261122-031700")
    return root


@pytest.fixture
def logdir(tmp_path, made):
    root = tmp_path / "runs"
    shutil.copytree(made, root)
    (root / PADDED / EXTRACT).unlink()  # a run of a version that wrote no extract: converted on first read
    (root / CONCAT / EXTRACT).unlink()
    (root / CONCAT / read_summary(root / CONCAT).trace).unlink()
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
    # its steps timed as the lab's tables lead: the recorded H200 step left the GPU idle 11 % of the time, waiting for
    # the host, so by the wall clock (a device-paced run's by its device step: test_traces_lanes.py), the median step
    # its representative
    record = read_summary(logdir / PADDED)
    assert record.leading_time() == "wall_ms" and padded["clock"] == "wall"
    wall = {str(s.step): s.regions["step"]["wall_ms"] for s in record.per_step}
    assert padded["step_ms"] == wall and padded["paced"].startswith("paced by the host (GPU idle")
    assert wall[str(padded["representative"])] == sorted(wall.values())[1]
    skipped = {s["run"]: s["reason"] for s in listing["skipped"]}
    assert skipped == {
        "profile/concat/20261122-031700": "no extract.json.gz and no trace to build one from",
        "profile/loop/1": "not JSON (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 co)",
    }
    assert listing["colors"]["regions"]["forward"] == "#1f77b4" and "gpu" not in listing["colors"]
    assert listing["measures"]["launches"]["header"] == "launches" and "gpu_ms" in listing["why"]
    assert listing["measures"]["peak_rise_bytes"]["unit"] == "memory" and "peak_rise_bytes" in listing["why"]
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


def test_every_module_of_the_page_is_served_by_its_exact_name_and_nothing_else(logdir):
    plugin, http = client(logdir)
    modules = sorted(f"/{p.name}" for p in STATIC.glob("*.js"))
    assert "/index.js" in modules and len(modules) > 1
    assert sorted(plugin.get_plugin_apps()) == sorted([*modules, "/runs", "/step"])  # no wildcard route
    for route in modules:
        response = http.get(route)
        assert response.status_code == 200 and response.mimetype == "text/javascript", route
        assert response.get_data() == (STATIC / route[1:]).read_bytes()
    assert "export async function render()" in http.get("/index.js").get_data(as_text=True)


def test_the_page_draws_data_as_text_in_modules_of_one_screenful():
    """No network, no markup built from data (the one innerHTML is the page's constant skeleton), no module
    over 500 lines."""
    for path in STATIC.glob("*.js"):
        text = path.read_text()
        assert "https://" not in text and "http://" not in text, path.name
        assert len(text.splitlines()) <= 500, path.name
        for sink in ("insertAdjacentHTML", "outerHTML", "document.write", "srcdoc"):
            assert sink not in text, (path.name, sink)
        code = [line.split("//")[0].strip() for line in text.splitlines()]
        uses = [line for line in code if "innerHTML" in line]
        assert uses == (["document.body.innerHTML = HTML;"] if path.name == "page.js" else []), path.name


# ----------------------------------------------------------------------------- what the tab may read and write


def test_inside_resolves_links_before_it_decides(tmp_path):
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.json").write_text("{}")
    (root / "run" / "summary.json").write_text("{}")
    (root / "run" / "out.json").symlink_to(outside / "secret.json")
    (root / "run" / "dangling.json").symlink_to(outside / "not yet.json")
    (root / "run" / "near.json").symlink_to(root / "run" / "summary.json")
    (root / "run" / "loop.json").symlink_to(root / "run" / "loop.json")
    (root / "linked").symlink_to(outside, target_is_directory=True)
    real = (root / "run" / "summary.json").resolve()
    assert inside(root, root / "run" / "summary.json") == real
    assert inside(root, root / "run" / "near.json") == real  # a link that stays inside
    assert inside(root, root / "run" / "new.json") == real.with_name("new.json")  # not there yet: where it would be
    for path in ("run/out.json", "run/dangling.json", "linked/secret.json", "run/../../elsewhere/secret.json"):
        assert inside(root, root / path) is None, path
    assert inside(root, root / "run" / "loop.json") is None
    assert inside(root, root / "run" / str(outside / "secret.json")) is None  # an absolute path joined on
    assert inside(root / "run", root / "run" / ".." / "run" / "summary.json") == real


def tree(root: Path) -> dict:
    """Every file under ``root`` with its size and mtime, links not followed: what a test checks nothing wrote."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            stat = path.lstat()
            found[path.relative_to(root).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return found


def test_a_linked_summary_or_extract_that_leads_out_of_the_logdir_is_not_followed(tmp_path, made):
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    shutil.copytree(made / PADDED, root / PADDED)
    shutil.copytree(made / FUSED, outside / "fused")
    shutil.copytree(made / CONCAT, outside / "concat")
    linked_summary = root / "profile" / "linked" / "1"
    linked_summary.mkdir(parents=True)
    (linked_summary / "summary.json").symlink_to(outside / "fused" / "summary.json")
    linked_extract = root / "profile" / "concat" / "1"
    shutil.copytree(made / CONCAT, linked_extract)
    (linked_extract / EXTRACT).unlink()
    (linked_extract / EXTRACT).symlink_to(outside / "concat" / EXTRACT)
    (root / "profile" / "folder").symlink_to(outside / "fused", target_is_directory=True)
    before = tree(tmp_path)
    _, http = client(root)
    listing = http.get("/runs").get_json()
    assert [r["run"] for r in listing["runs"]] == [PADDED]
    assert {s["run"]: s["reason"] for s in listing["skipped"]} == {
        "profile/concat/1": "its extract.json.gz is a link that leads out of the log directory: not read",
        "profile/linked/1": "its summary.json is a link that leads out of the log directory: not read",
    }  # the linked folder is not walked into: rglob does not follow links to folders
    for run in ("profile/concat/1", "profile/linked/1", "profile/folder"):
        response = http.get(f"/step?run={run}&step=10")
        assert response.status_code == 404 and response.get_json()["error"].startswith("no profile run"), run
    assert http.get(f"/step?run={PADDED}&step=10").status_code == 200
    assert tree(tmp_path) == before


@pytest.mark.parametrize("where", ["absolute", "dotdot", "link"])
def test_a_trace_outside_the_run_folder_is_not_read_and_no_extract_is_written(tmp_path, made, where):
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    shutil.copytree(made / CONCAT, outside / "concat")  # its trace would build a perfectly good extract
    trace = outside / "concat" / read_summary(outside / "concat").trace
    run = root / "profile" / "concat" / "1"
    shutil.copytree(made / CONCAT, run)
    (run / EXTRACT).unlink()
    names = {"absolute": str(trace), "dotdot": os.path.relpath(trace, run), "link": "trace/linked.json.gz"}
    if where == "link":
        (run / "trace" / "linked.json.gz").symlink_to(trace)
    edit_summary(run, lambda s: s.update(trace=names[where]))
    before = tree(tmp_path)
    _, http = client(root)
    listing = http.get("/runs").get_json()
    assert listing["runs"] == [] and listing["skipped"] == [
        {
            "run": "profile/concat/1",
            "reason": f"no extract.json.gz, and its trace {names[where]!r} lies outside the run's folder: not read",
        }
    ]
    assert http.get("/step?run=profile/concat/1&step=10").status_code == 404
    assert tree(tmp_path) == before  # no extract in the run folder, nothing anywhere else


def test_an_extract_is_written_through_no_link(tmp_path, made):
    """A run without an extract is still served from its trace, but where a link waits at the extract's name or at
    the name it is first written to, nothing is written: the write would land where the link leads."""
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    run = root / PADDED
    shutil.copytree(made / PADDED, run)
    (run / EXTRACT).unlink()
    (run / f".{EXTRACT}.new").symlink_to(victim)
    before = tree(tmp_path)
    _, http = client(root)
    assert http.get("/runs").get_json()["runs"][0]["extract"] is False
    response = http.get(f"/step?run={PADDED}&step=11")
    assert response.status_code == 200 and response.get_json()["step"] == 11
    assert tree(tmp_path) == before and victim.read_text() == "keep me"


# ----------------------------------------------------------------------------- headers, caps, bad input


def test_every_answer_says_nosniff(logdir):
    plugin, http = client(logdir)
    queries = [f"/step?run={PADDED}&step=11", f"/step?run={PADDED}&step=x", "/step?run=nope&step=1", "/runs"]
    for url in queries + [route for route in plugin.get_plugin_apps() if route.endswith(".js")]:
        response = http.get(url)
        assert response.headers.get("X-Content-Type-Options") == "nosniff", (url, response.status_code)


def bomb(path: Path, megabytes: int) -> None:
    """A gzip file of a few kB that decompresses to ``megabytes`` MiB of JSON whitespace: one member, repeated."""
    member = gzip.compress(b" " * 2**20, compresslevel=9)
    path.write_bytes(member * megabytes)


def test_decompression_is_capped_and_refused_in_one_line(logdir, monkeypatch):
    monkeypatch.setattr(extracts, "EXTRACT_BYTES", 2**20)  # read_extract's cap, as every read of the tab goes through
    monkeypatch.setattr(extract, "TRACE_BYTES", 2**20)
    bomb(logdir / FUSED / EXTRACT, 3)
    bomb(logdir / PADDED / read_summary(logdir / PADDED).trace, 3)  # the run converted from its trace
    _, http = client(logdir)
    for run, name in ((FUSED, EXTRACT), (PADDED, read_summary(logdir / PADDED).trace)):  # named in its run
        response = http.get(f"/step?run={run}&step=10")
        assert response.status_code == 422
        assert response.get_json() == {"error": f"{name}: larger than 1 MiB decompressed: not a record this lab writes"}
    assert not (logdir / PADDED / EXTRACT).exists()


@pytest.mark.parametrize(
    "query, status, message",
    [
        ("step=10", 400, "run: missing, expected ?run=<a run listed by ./runs>&step=<N>"),
        (f"run={PADDED}", 400, "step: '' is not a step number, expected ?step=<N>"),
        (f"run={PADDED}&step=-1", 400, "step: '-1' is not a step number, expected ?step=<N>"),
        (f"run={PADDED}&step=1e3", 400, "step: '1e3' is not a step number, expected ?step=<N>"),
        (f"run={PADDED}&step=%C2%B2", 400, "step: '²' is not a step number, expected ?step=<N>"),
    ],
)
def test_bad_parameters_are_a_400_naming_them(logdir, query, status, message):
    _, http = client(logdir)
    response = http.get(f"/step?{query}")
    assert response.status_code == status and response.get_json() == {"error": message}


def test_a_run_that_goes_bad_after_the_listing_is_a_422_with_its_reason(logdir):
    _, http = client(logdir)
    assert http.get("/runs").status_code == 200
    (logdir / FUSED / EXTRACT).write_bytes(gzip.compress(b'{"version": 1, "steps": []}'))
    response = http.get(f"/step?run={FUSED}&step=10")
    assert response.status_code == 422
    assert response.get_json() == {"error": "extract.json.gz: steps is list [], expected an object"}


BAD_SUMMARIES = {
    "timed": (lambda s: s.update(timed="x"), "timed is str 'x', expected an object"),
    "warnings": (
        lambda s: s["analysis"].update(warnings=3),
        "analysis.warnings is int 3, expected a list",
    ),
    "trace": (lambda s: s.update(trace=3), "summary.json.trace is int 3, expected a string"),
    "steps": (lambda s: s.update(per_step=[3]), "per_step[0] is int 3, expected an object"),
    "wall_ms": (
        lambda s: s["analysis"]["regions"]["step"].update(
            wall_ms={"median": 1.0, "q1": 1, "q3": 1, "min": 1, "max": 1}
        ),
        "its step wall time is not usable (no steps)",
    ),
    "list": (
        lambda s: s.clear(),
        "no strategy, mode, analysis, per_step: not written by (this version of) make profile",
    ),
}


def test_one_bad_run_is_skipped_with_its_reason_and_the_others_are_listed(logdir, monkeypatch):
    for name, (change, _) in BAD_SUMMARIES.items():
        shutil.copytree(logdir / FUSED, logdir / "bad" / name)
        edit_summary(logdir / "bad" / name, change)
    (logdir / "bad" / "list" / "summary.json").write_text("[]")
    (logdir / "bad" / "folder" / "summary.json").mkdir(parents=True)  # a folder where the file should be
    large = logdir / "bad" / "large"
    shutil.copytree(logdir / FUSED, large)
    edit_summary(large, lambda s: s.update(padding=" " * 2**20))
    monkeypatch.setattr(records, "SUMMARY_BYTES", 2**20)  # the good summaries are tens of kB
    _, http = client(logdir)
    response = http.get("/runs")
    assert response.status_code == 200
    listing = response.get_json()
    assert [r["run"] for r in listing["runs"]] == [PADDED, FUSED]
    reasons = {s["run"]: s["reason"] for s in listing["skipped"]}
    expected = {f"bad/{name}": reason for name, (_, reason) in BAD_SUMMARIES.items()}
    expected["bad/list"] = "not a JSON object"
    expected["bad/folder"] = "cannot read it (IsADirectoryError: [Errno 21] Is a directory: 'summary.json')"
    expected["bad/large"] = "larger than 1 MiB: not a record this lab writes"
    expected[CONCAT] = "no extract.json.gz and no trace to build one from"
    expected["profile/loop/1"] = (
        "not JSON (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 co)"
    )
    assert reasons == expected
    assert http.get(f"/step?run={FUSED}&step=10").status_code == 200


def test_a_run_with_synchronised_regions_is_listed_after_the_strategys_runs_as_training_runs_it(tmp_path):
    """make report profiles padded a second time under profile.sync_regions (the article's protocol), after the
    first: the newest padded run is then the synchronised one, but the tab ticks the first of each strategy, and
    that must be the step as training runs it."""
    root = tmp_path / "runs"
    make_run(root / "profile", "padded", "20261122-031500")
    synced = make_run(root / "synced", "padded", "20261122-041500")
    edit_summary(synced, lambda s: s.update(sync_regions=True))
    _, http = client(root)
    runs = http.get("/runs").get_json()["runs"]
    assert [(r["run"], r["synced"]) for r in runs] == [
        ("profile/padded/20261122-031500", False),
        ("synced/padded/20261122-041500", True),
    ]


def test_the_ranks_of_a_run_of_several_processes_are_listed_together_in_order_with_their_group(tmp_path):
    """make profile NPROC=2 writes <strategy>/<time>/rank<r>/: the tab ticks a run's ranks together, in order."""
    root = tmp_path / "runs"
    make_run(root / "profile", "padded", "20261122-041500")  # a newer run of one process
    rank_runs(root, "20261122-031500", [1e9, 1e9 + 5000])
    _, http = client(root)
    runs = http.get("/runs").get_json()["runs"]
    assert [(r["run"], r["rank"], r["ranks"], r["group"]) for r in runs] == [
        ("profile/padded/20261122-041500", None, None, "profile/padded/20261122-041500"),
        ("profile/padded/20261122-031500/rank0", 0, 2, "profile/padded/20261122-031500"),
        ("profile/padded/20261122-031500/rank1", 1, 2, "profile/padded/20261122-031500"),
    ]
    step = http.get(f"/step?run=profile/padded/20261122-031500/rank1&step={runs[2]['representative']}").get_json()
    assert step["start"] >= 1e9 + 5000


def strict(body: bytes):
    """``body`` parsed as a browser parses JSON: NaN, Infinity and -Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(body, parse_constant=refuse)


def test_a_damaged_extract_is_served_as_strict_json_with_its_warnings_listed(logdir):
    """NaN and Infinity in an extract, and a memory lane of -1e12 bytes: the damaged steps are left out (the run list
    says which and why), the others served as JSON a browser parses; never NaN in an HTTP 200."""
    found = extracts.read_extract(logdir / FUSED / EXTRACT)
    found.steps["10"].calls[0][1] = float("nan")
    found.steps["11"].memory = extracts.StepMemory("cuda:0", 0, 1, [[5.0, -(10**12), -(10**12), -1]])
    found.steps["12"].why["forward"]["wall_ms"] = float("inf")
    extracts.write_extract(logdir / FUSED, found)
    _, http = client(logdir)
    response = http.get("/runs")
    assert response.status_code == 200
    (fused,) = [r for r in strict(response.get_data())["runs"] if r["run"] == FUSED]
    assert fused["warnings"] == [
        "extract.json.gz: step 10.calls[0].duration is NaN, expected a finite number in [0, 1e15]: step 10 left out",
        "extract.json.gz: step 11.memory.rows[0].allocated is -1000000000000, expected an integer in [0, 1e15]: "
        "step 11.memory left out",
        "extract.json.gz: step 12.why.forward.wall_ms is Infinity, expected a finite number in [0, 1e15]: "
        "step 12 left out",
    ]
    served = http.get(f"/step?run={FUSED}&step=11")
    assert served.status_code == 200 and "memory" not in strict(served.get_data())  # the step without its lane
    for step in (10, 12):
        response = http.get(f"/step?run={FUSED}&step={step}")
        assert response.status_code == 404 and "its steps: 11" in strict(response.get_data())["error"]


def test_a_value_that_is_not_finite_is_never_sent(logdir, monkeypatch):
    """A value that got past the readers (here one set after the read) is a 422 with its reason, never an HTTP 200
    with NaN in it."""
    found = extracts.read_extract(logdir / FUSED / EXTRACT)
    found.steps["10"].dur = float("nan")
    monkeypatch.setattr(extract, "load", lambda *args, **kwargs: found)
    _, http = client(logdir)
    response = http.get(f"/step?run={FUSED}&step=10")
    assert response.status_code == 422
    reason = strict(response.get_data())["error"]
    assert reason.startswith("cannot be read (ValueError: Out of range float values are not JSON compliant")


def test_a_summarys_damaged_values_are_listed_with_its_run(logdir):
    edit_summary(logdir / FUSED, lambda s: s["noise"].update(load_during=float("nan")))
    _, http = client(logdir)
    (fused,) = [r for r in strict(http.get("/runs").get_data())["runs"] if r["run"] == FUSED]
    assert fused["warnings"] == [
        "summary.json: noise.load_during is NaN, expected a finite number in [0, 1e15]: noise left out"
    ]
