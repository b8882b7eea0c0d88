"""TensorBoard events of a profile run (detector.board) read back with TensorBoard's own reader, and the
`make tensorboard` launcher with and without the PyTorch Profiler plugin.

``make_run`` builds a profile run folder as `make profile` writes it, from the recorded H200 trace of the
padded strategy (tests/data); test_compare.py and test_browser.py build theirs with it too.
"""

import gzip
import json
from functools import cache
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from detector import analysis, board
from detector.measures import MEASURES
from detector.trace_view import TracesPlugin

GPU_TRACE = Path(__file__).parent / "data" / "padded_gpu_trace.json.gz"
GPU_EVENTS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@cache
def _fixture_json() -> str:
    return gzip.decompress(GPU_TRACE.read_bytes()).decode()


def make_run(
    profile_dir: Path, strategy: str, stamp: str, mode: str = "train", scale: float = 1.0, gpu: bool = True
) -> Path:
    """``profile_dir/<strategy>[-forward]/<stamp>/`` with trace/ and summary.json, as `make profile` writes
    them, from the recorded padded trace: ``scale`` multiplies every time (0.5: a run twice as fast);
    ``gpu=False`` drops the GPU events (a CPU-only trace). Returns the run folder."""
    trace = json.loads(_fixture_json())
    if scale != 1.0:
        for e in trace["traceEvents"]:
            if e.get("ph") == "X":
                e["ts"], e["dur"] = e["ts"] * scale, e["dur"] * scale
    if not gpu:
        trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in GPU_EVENTS]
    run = profile_dir / (strategy if mode == "train" else f"{strategy}-forward") / stamp
    timed = [100.0 * scale * (1 + i / 100) for i in range(5)]  # steps timed without the profiler
    (run / "trace").mkdir(parents=True)
    path = run / "trace" / f"{strategy}.1795312409264487939.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode(), compresslevel=1))
    summary = {
        "strategy": strategy,
        "mode": mode,
        "device": "NVIDIA H200" if gpu else "cpu",
        "torch": "2.11.0+cu130",
        "preset": "seed_scale",
        "batch_size": 1024,
        "image_size": 256,
        "max_boxes": 256,
        "run": stamp,
        "created": "2026-11-22T03:15:00",
        "trace": f"trace/{path.name}",
        "analysis": analysis.trace_summary(path),
        "timed": {"step_ms": analysis.spread(timed), "wall_ms": timed},
        "per_step": analysis.measure_steps(path),
        "config": {"profile": {"strategy": strategy, "mode": mode}},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def read_events(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def test_profile_events_scalars_text_images(tmp_path):
    run = make_run(tmp_path / "profile", "padded", "20261122-031500")
    summary = json.loads((run / "summary.json").read_text())
    board.write_profile_events(run, summary)

    assert sorted(p.name for p in (run / "trace").iterdir()) == [Path(summary["trace"]).name]  # trace/ stays clean
    events = read_events(run)
    tags = events.Tags()
    # one tag per measure and region, the same in every run: TensorBoard overlays the strategies; numbered
    # so that TensorBoard's name order is the vocabulary's, the whole step first
    assert board.scalar_tag("wall_ms", "step") == "2 wall ms/0 step"
    assert board.scalar_tag("gpu_ms", "backward") == "3 GPU ms/5 backward"
    for measure, region in (("wall_ms", "forward"), ("launches", "calc loss"), ("device_step_ms", "step")):
        assert board.scalar_tag(measure, region) in tags["scalars"], (measure, region)
    assert board.scalar_tag("gpu_idle_share", "step") in tags["scalars"]  # the step's alone
    assert board.scalar_tag("gpu_idle_share", "forward") not in tags["scalars"]
    assert board.scalar_tag("sync_wait_ms", "step") not in tags["scalars"]  # 0 throughout: not written
    forward = events.Scalars(board.scalar_tag("launches", "forward"))
    assert [e.step for e in forward] == [s["step"] for s in summary["per_step"]] == [10, 11, 12]
    assert [e.value for e in forward] == [s["regions"]["forward"]["launches"] for s in summary["per_step"]]
    wall = [e.value for e in events.Scalars("2 wall ms/0 step")]
    assert wall == pytest.approx([s["regions"]["step"]["wall_ms"] for s in summary["per_step"]])

    assert tags["tensors"] == ["summary/tables/text_summary"]
    text = events.Tensors("summary/tables/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "padded, train, NVIDIA H200" in text and "| calc loss |" in text and "launches" in text
    assert "As training runs it (no profiler, no regions; 5 steps): step 102 ms" in text
    assert "need a GPU" not in text and "**warning**" not in text

    assert sorted(tags["images"]) == [
        f"{board.RUN_GROUP}/ms per region",
        f"{board.RUN_GROUP}/timeline of the median step",
    ]
    image = events.Images(f"{board.RUN_GROUP}/timeline of the median step")[0]
    assert image.width > 1000 and image.height > 100 and image.encoded_image_string[:4] == b"\x89PNG"


def test_profile_events_of_a_cpu_trace(tmp_path):
    """No GPU: the GPU-only measures are None in the summary, have no scalar, and the text says so once."""
    run = make_run(tmp_path / "profile", "padded", "20261122-031500", gpu=False)
    summary = json.loads((run / "summary.json").read_text())
    board.write_profile_events(run, summary, events=run / summary["trace"])

    tags = read_events(run).Tags()
    assert board.scalar_tag("wall_ms", "forward") in tags["scalars"]
    assert board.scalar_tag("ops", "forward") in tags["scalars"]
    gpu_only = [name for name, m in MEASURES.items() if m.gpu_only]
    assert not [t for t in tags["scalars"] if any(t.split("/")[0].endswith(MEASURES[m].header) for m in gpu_only)]
    text = board.summary_markdown(summary)
    assert text.count("need a GPU") == 1 and "| GPU ms |" not in text and "launches" in text.split("need a GPU")[0]
    assert f"{board.RUN_GROUP}/timeline of the median step" in tags["images"]


def test_a_summary_with_warnings_shows_them(tmp_path):
    run = make_run(tmp_path / "profile", "padded", "20261122-031500")
    summary = json.loads((run / "summary.json").read_text())
    summary["analysis"]["warnings"] = ["3 of 9 kernel launches have no kernel"]
    assert "**warning**: 3 of 9 kernel launches have no kernel" in board.summary_markdown(summary)


def test_tensorboard_launcher_serves_the_traces_tab(monkeypatch, capsys):
    started = []
    monkeypatch.setattr("absl.app.run", lambda main, argv, flags_parser: started.append((main, argv)))
    monkeypatch.setattr("tensorboard.default.get_dynamic_plugins", lambda: [])  # as if not installed

    board.main("somewhere/runs", 6123, host="127.0.0.1")

    ((main, argv),) = started
    assert argv == ["tensorboard", "--logdir", "somewhere/runs", "--port", "6123", "--host", "127.0.0.1"]
    assert main.__self__.plugin_loaders[-1].plugin_class is TracesPlugin  # added: no entry point here
    out = capsys.readouterr().out
    assert "http://127.0.0.1:6123/" in out and "#traces" in out and "#timeseries" in out and "#text" in out


def test_timed_note_compares_the_device_step_on_a_gpu_and_never_calls_noise_an_overhead():
    def summary(host, device, timed):
        step = {"wall_ms": {"median": host}, "device_step_ms": {"median": device} if device else None}
        return {"analysis": {"regions": {"step": step}}, "timed": {"step_ms": {"n": 10, **timed}}}

    timed = {"median": 34.8, "q1": 34.8, "q3": 34.9}
    # a GPU: the host's ProfilerStep (30.1, running ahead) is not what the timed CUDA events measure
    note = board.timed_note(summary(30.1, 35.1, timed))
    assert "The profiled step on the device is 1.01× that: the profiler adds +1 %." in note
    note = board.timed_note(summary(30.1, None, timed))  # the CPU: host times both
    assert "The profiled step is 0.86× that (14 % shorter: the profiled and the timed steps differ" in note
    assert "adds" not in note
