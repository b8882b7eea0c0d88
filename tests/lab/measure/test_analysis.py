"""Trace analysis (detector/lab/measure/trace.py, analysis.py) and timelines (detector/lab/present/timeline.py): exact
counts on a hand-written trace, cross-checks on a trimmed recorded H200 trace, a real CPU-only torch.profiler trace,
broken files."""

import gzip
import json
import statistics
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule
from trace_helpers import AUTOGRAD, call, gpu, mark, synthetic_events

from detector.checked import RecordError
from detector.lab.measure.analysis import check_steps, measure_steps, summarise
from detector.lab.measure.extract import build
from detector.lab.measure.trace import load_trace
from detector.lab.present.timeline import draw_step, draw_steps
from detector.lab.record.measures import MEASURES
from detector.lab.record.run import representative_step
from detector.lab.record.spread import Spread
from detector.lab.record.steps import StepModel

DATA = Path(__file__).parents[2] / "data"
GPU_TRACE = DATA / "padded_gpu_trace.json.gz"


def test_synthetic_trace_exact_measures():
    steps = measure_steps(synthetic_events())
    assert [s.step for s in steps] == [5, 6]
    regions = steps[0].regions
    assert list(regions) == ["data wait", "copy data", "forward", "calc loss", "backward", "other", "step"]
    assert list(regions["forward"]) == list(MEASURES)
    counts = ("launches", "kernels", "h2d_copies", "h2d_bytes", "d2h_copies", "d2h_bytes", "syncs")
    expected = {  # region: (launches, kernels, h2d, h2d bytes, d2h, d2h bytes, syncs); the lab's syncs left out
        "data wait": (0, 0, 0, 0, 0, 0, 0),
        "copy data": (0, 0, 2, 1024, 0, 0, 0),
        "forward": (5, 7, 0, 0, 0, 0, 0),
        "calc loss": (2, 2, 0, 0, 5, 4 + 8 + 16 + 32 + 128, 5),
        "backward": (3, 3, 0, 0, 0, 0, 0),  # the unnamed autograd thread's launches included
        "other": (0, 0, 0, 0, 1, 4, 2),
        "step": (10, 12, 2, 1024, 6, 192, 7),
    }
    for region, values in expected.items():
        assert tuple(regions[region][m] for m in counts) == values, region
    # GPU ms by launch: copy data 120-160 + memset 170-230; forward 220-320 + 330-340 + 350-380 + the late
    # kernel 1200-1300 (run in step 6); calc loss 10+2+5+10+5+4+5+2; backward 5 + 640-670; other 2
    gpu_us = {"data wait": 0, "copy data": 100, "forward": 240, "calc loss": 43, "backward": 35, "other": 2}
    gpu_us["step"] = 40 + 150 + 10 + 30 + 100 + 43 + 35 + 2  # the memset merges with k1 and k2: 170-320
    for region, us in gpu_us.items():
        assert regions[region]["gpu_ms"] == pytest.approx(us / 1e3), region
    assert regions["forward"]["wall_ms"] == pytest.approx(0.2)
    assert regions["other"]["wall_ms"] == pytest.approx((10 + 50 + 200) / 1e3)  # [0,10) [50,100) [800,1000)
    # the device ran 310 µs of the step's 1000 (the late kernel ran in step 6's time); idle is the step's alone
    assert regions["step"]["gpu_idle_share"] == pytest.approx(1 - 310 / 1000)
    assert regions["forward"]["gpu_idle_share"] is None
    # runtime: 4 + 4 + 4 + 10 (cudaMalloc around cuMemAlloc) + 6 + 4; the lab's synchronize (18 µs) left out
    assert regions["forward"]["runtime_ms"] == pytest.approx(0.032)
    assert regions["forward"]["sync_wait_ms"] == pytest.approx(0.018)
    assert regions["step"]["sync_wait_ms"] == pytest.approx((15 + 18 + 10 + 10) / 1e3)
    assert regions["backward"]["runtime_ms"] == pytest.approx(0.015)  # main + autograd threads
    ops = {name: (regions[name]["ops"], regions[name]["slices"], regions[name]["host_reads"]) for name in regions}
    assert ops == {
        "data wait": (0, 0, 0),
        "copy data": (0, 0, 0),
        "forward": (3, 0, 0),
        "calc loss": (7, 4, 2),
        "backward": (1, 0, 0),  # the autograd thread's operator
        "other": (0, 0, 0),
        "step": (11, 4, 2),
    }
    assert check_steps(synthetic_events(), steps) == []  # the regions and "other" add up to the step


def test_synthetic_repeated_region_is_summed_and_absent_regions_left_out():
    regions = measure_steps(synthetic_events())[1].regions
    assert list(regions) == ["data wait", "copy data", "other", "step"]
    assert regions["data wait"]["wall_ms"] == pytest.approx(0.03)  # 10 µs + 20 µs
    assert (regions["copy data"]["h2d_copies"], regions["copy data"]["h2d_bytes"]) == (1, 500)
    assert regions["step"]["syncs"] == 0
    assert regions["step"]["gpu_ms"] == pytest.approx(0.04)  # its own copy; the late kernel is step 5's
    assert regions["step"]["gpu_idle_share"] == pytest.approx(1 - 140 / 500)  # ... but it ran in this step


def test_violated_invariants_are_warnings_not_silent_numbers():
    events = synthetic_events()
    events.append(gpu("kernel", "orphan", 700, 50, 999))  # no call with correlation 999
    events.append(call("cudaLaunchKernel", 640, 2, 998, tid=AUTOGRAD))  # a launch whose kernel was dropped
    events.append(mark("calc loss", 550, 100))  # overlaps backward: the regions exceed the step
    steps = measure_steps(events)
    warnings = check_steps(events, steps)
    assert len(warnings) == 3
    assert warnings[0].startswith(
        "the regions do not add up to the step in 1 of 2 steps (step 5: wall ms 1.1 against 1"
    )
    assert any("1 of 11 kernel launches in the active steps have no kernel" in w for w in warnings)
    assert any("1 GPU events (0.05 ms) in the active steps have no launching call" in w for w in warnings)
    # a kernel launched by a call the analysis does not know as a launch: counted as a kernel, not a launch
    events = synthetic_events() + [call("cudaLaunchCooperativeKernel", 615, 2, 997), gpu("kernel", "k", 700, 5, 997)]
    warnings = check_steps(events, measure_steps(events))
    assert warnings == []  # the region still has other launches: nothing to see per region
    backward = (30, 31, 32)  # its launches and their kernels, replaced by one unknown launch call
    alone = [e for e in synthetic_events() if e.get("args", {}).get("correlation") not in backward]
    alone += [call("cudaLaunchCooperativeKernel", 615, 2, 997), gpu("kernel", "k", 700, 5, 997)]
    warnings = check_steps(alone, measure_steps(alone))
    assert warnings == [
        "kernels with no launch counted in 1 of 2 steps (step 5: backward (1 kernels)): launched by a call the "
        "analysis does not know as a launch"
    ]
    assert summarise(load_trace(events), steps).regions["step"]["wall_ms"].n == 2


def test_dict_and_list_inputs_agree():
    events = synthetic_events()
    assert measure_steps({"traceEvents": events}) == measure_steps(events)


def collective(name, ts, dur, corr, stream, **args):
    """A collective's kernel as Kineto writes NCCL's, with the message args it gives (``In msg nelems`` ...)."""
    event = gpu("kernel", name, ts, dur, corr, stream=stream)
    event["args"] |= {key.replace("_", " "): value for key, value in args.items()}
    return event


def communication_events() -> list[dict]:
    """One step (µs): a forward of compute alone; a backward whose all-reduce (stream 20) and reduce-scatter (stream
    21, launched from the autograd thread) overlap each other and, in part, the backward's kernels (stream 7); an
    optimizer step whose all-gather gives no message size and runs beside nothing."""
    events = [mark("ProfilerStep#1", 0, 1000), mark("forward", 100, 200), mark("backward", 300, 300)]
    events += [mark("optimizer step", 600, 300)]
    events += [call("cudaLaunchKernel", 110, 5, 1), gpu("kernel", "fwd", 150, 100, 1)]
    events += [call("cudaLaunchKernel", 310, 5, 2), gpu("kernel", "bwd_a", 320, 180, 2)]  # 320-500
    all_reduce = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
    events += [call("cudaLaunchKernelExC", 330, 5, 3), collective(all_reduce, 400, 160, 3, 20)]  # 400-560
    events[-1]["args"] |= {"Collective name": "allreduce", "In msg nelems": 1000, "Out msg nelems": 1000}
    events[-1]["args"] |= {"dtype": "Float"}  # 4000 bytes
    events += [call("cudaLaunchKernelExC", 340, 5, 4, tid=AUTOGRAD)]
    events += [collective("ncclKernel_ReduceScatter_RING_LL_Sum_bf16", 540, 40, 4, 21)]  # 540-580
    events[-1]["args"] |= {"In msg nelems": 2000, "Out msg nelems": 1000, "dtype": "BFloat16"}  # 4000 bytes
    events += [call("cudaLaunchKernel", 350, 5, 5), gpu("kernel", "bwd_b", 520, 50, 5)]  # 520-570
    events += [call("cudaLaunchKernelExC", 610, 5, 6), collective("ncclDevKernel_AllGather_RING_LL", 700, 100, 6, 20)]
    events += [call("cudaLaunchKernel", 620, 5, 7), gpu("kernel", "adam", 620, 70, 7)]  # 620-690
    return events


def test_collectives_are_measured_apart_exactly():
    events = communication_events()
    regions = measure_steps(events)[0].regions
    comm = {name: tuple(regions[name][m] for m in ("comm_ms", "comm_bytes")) for name in regions}
    # backward: the union 400-580 (the two collectives' overlap counted once), 4000 + 4000 bytes; the all-gather
    # gives no size: time, but no bytes
    assert comm == {
        "forward": (0.0, 0),
        "backward": (pytest.approx(0.18), 8000),
        "optimizer step": (pytest.approx(0.1), 0),
        "other": (0.0, 0),
        "step": (pytest.approx(0.28), 8000),
    }
    # hidden: compute ran beside the collectives in 400-500 (bwd_a) and 540-570 (bwd_b, the reduce-scatter's part
    # not already under bwd_a), 150 of 180 µs; the all-reduce beside the reduce-scatter (540-560) is no compute
    assert regions["backward"]["comm_hidden_share"] == pytest.approx(150 / 180)
    assert regions["optimizer step"]["comm_hidden_share"] == 0.0
    assert regions["step"]["comm_hidden_share"] == pytest.approx(150 / 280)
    assert regions["forward"]["comm_hidden_share"] is None  # no collective: no share to speak of
    assert regions["step"]["gpu_ms"] == pytest.approx((100 + 260 + 100 + 70) / 1e3)  # collectives are GPU work too
    assert check_steps(events, measure_steps(events)) == []
    # a trace with GPU work and no collective (one GPU) has none; a trace without GPU events cannot tell
    single = measure_steps(synthetic_events())[0].regions["step"]
    assert (single["comm_ms"], single["comm_bytes"], single["comm_hidden_share"]) == (0.0, 0, None)
    assert all(MEASURES[m].gpu_only for m in ("comm_ms", "comm_bytes", "comm_hidden_share"))


# ----------------------------------------------------------------------------- the recorded H200 trace


@pytest.fixture(scope="module")
def gpu_events() -> list[dict]:
    with gzip.open(GPU_TRACE, "rt") as f:
        return json.load(f)["traceEvents"]


def plain_calls(events, start, end, pid=1787) -> list[dict]:
    """The CUDA calls of the profiled process that start in [start, end), any thread."""
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["pid"] == pid]
    return [e for e in calls if start <= e["ts"] < end]


def plain_count(events, start, end) -> dict:
    """The counts of one window written without the analysis: filter by process, time and name."""
    calls = plain_calls(events, start, end)
    correlations = {e["args"]["correlation"] for e in calls}
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and e["args"]["correlation"] in correlations]
    launch_names = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
    return {
        "launches": sum(e["name"] in launch_names for e in calls),
        "kernels": sum(e.get("cat") == "kernel" and e["args"]["correlation"] in correlations for e in events),
        "h2d_copies": sum("HtoD" in e["name"] for e in copies),
        "h2d_bytes": sum(e["args"]["bytes"] for e in copies if "HtoD" in e["name"]),
        "d2h_copies": sum("DtoH" in e["name"] for e in copies),
        "d2h_bytes": sum(e["args"]["bytes"] for e in copies if "DtoH" in e["name"]),
    }


def plain_union_us(intervals) -> float:
    """The length of a union of (start, end) intervals by a sweep over +1/-1 edges."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    total, depth, last = 0.0, 0, None
    for t, step in edges:
        total += (t - last) if depth else 0.0
        depth, last = depth + step, t
    return total


def plain_gpu_us(events, start, end) -> float:
    """GPU µs of the work launched by the calls in [start, end), whenever it ran."""
    correlations = {e["args"]["correlation"] for e in plain_calls(events, start, end)}
    launched = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return plain_union_us([(e["ts"], e["ts"] + e["dur"]) for e in launched if e["args"]["correlation"] in correlations])


def plain_busy_us(events, start, end) -> float:
    """GPU busy µs inside [start, end), whoever launched it."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    clipped = [(max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in gpu]
    return plain_union_us([(a, b) for a, b in clipped if a < b])


def test_gpu_trace_matches_a_plain_count(gpu_events):
    steps = measure_steps(gpu_events)
    assert [s.step for s in steps] == [10, 11, 12]
    marks = [e for e in gpu_events if e.get("cat") == "user_annotation" and e["tid"] == 1787]
    for step in steps:
        window = next(e for e in marks if e["name"] == f"ProfilerStep#{step.step}")
        inside = [e for e in marks if window["ts"] <= e["ts"] < window["ts"] + window["dur"]]
        for name, measures in step.regions.items():
            if name == "other":
                continue  # the gaps between the marks: checked by the invariants
            wanted = name if name != "step" else window["name"]
            mark = next(e for e in inside if e["name"] == wanted or (name == "data wait" and "DataLoader" in e["name"]))
            start, end = mark["ts"], mark["ts"] + mark["dur"]
            assert {k: measures[k] for k in plain_count(gpu_events, start, end)} == plain_count(gpu_events, start, end)
            assert measures["gpu_ms"] == pytest.approx(plain_gpu_us(gpu_events, start, end) / 1e3)
            assert measures["wall_ms"] == pytest.approx(mark["dur"] / 1e3, abs=1e-6)  # ts + dur - ts: ns rounding
        busy = plain_busy_us(gpu_events, window["ts"], window["ts"] + window["dur"])
        assert step.regions["step"]["gpu_idle_share"] == pytest.approx(1 - busy / window["dur"])
    assert check_steps(gpu_events, steps) == []


def test_gpu_trace_known_facts(gpu_events):
    for step in measure_steps(gpu_events):
        regions = step.regions
        names = ["data wait", "copy data", "forward", "calc loss", "backward", "optimizer step", "other", "step"]
        assert list(regions) == names
        # padded "copy data": 3 H2D copies, images uint8 [1024, 1, 256, 256] + boxes uint8 [1024, 256, 4]
        # + counts int64 [1024]
        copy = regions["copy data"]
        assert (copy["h2d_copies"], copy["h2d_bytes"]) == (3, 1024 * 256 * 256 + 1024 * 256 * 4 + 1024 * 8)
        launches = {name: regions[name]["launches"] for name in regions}
        assert launches == {
            "data wait": 0,
            "copy data": 0,
            "forward": 49,
            "calc loss": 49,
            "backward": 163,  # 1 on the main thread, 162 on the autograd thread
            "optimizer step": 371,
            "other": 0,
            "step": 632,
        }
        assert regions["step"]["kernels"] == 632
        # an older trace: every region ends in a synchronize without the "lab sync" label, which now counts;
        # "other" holds the previous step's loss.item() (a cudaMemcpyAsync + cudaStreamSynchronize)
        assert [regions[name]["syncs"] for name in regions] == [0, 1, 1, 1, 1, 1, 1, 6]
        assert (regions["other"]["d2h_copies"], regions["other"]["d2h_bytes"]) == (1, 4)
        assert 0 < regions["calc loss"]["runtime_ms"] < regions["calc loss"]["wall_ms"]
        assert regions["step"]["ops"] == sum(regions[name]["ops"] for name in names[:-1]) > 0


# ----------------------------------------------------------------------------- summary statistics


def test_spread_matches_the_statistics_module():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    assert Spread.of(values + [None]) == Spread(statistics.median(values), q1, q3, 1.0, 9.0, 6)
    assert Spread.of([5]) == Spread(5, 5, 5, 5, 5, 1)
    assert Spread.of([None, None]).n == 0 and Spread.of([]).median is None and not Spread.of([])


def test_summary_over_the_gpu_trace(gpu_events):
    steps = measure_steps(gpu_events)
    summary = summarise(load_trace(GPU_TRACE), steps)
    assert (summary.steps, summary.step_numbers) == (3, [10, 11, 12])
    for region, stats in summary.regions.items():
        for measure in ("wall_ms", "gpu_ms", "launches", "ops"):
            values = [s.regions[region][measure] for s in steps]
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
            got = stats[measure]
            assert (got.median, got.min, got.max, got.n) == (statistics.median(values), min(values), max(values), 3)
            assert (got.q1, got.q3) == pytest.approx((q1, q3))
    assert summary.regions["step"]["gpu_idle_share"].n == 3 and summary.regions["forward"]["gpu_idle_share"].n == 0
    # step 12 waited ~150 ms for data: the median step is not it
    assert representative_step(steps).step != 12
    assert summary.regions["data wait"]["wall_ms"].max > 100
    assert summary.trace == GPU_TRACE.name and summary.gpu is True
    assert summary.representative_step in summary.step_numbers
    assert summary.warnings == []


# ----------------------------------------------------------------------------- a real CPU-only trace


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory) -> Path:
    """A tiny training loop under torch.profiler (CPU activity only), the lab's regions around it."""
    path = tmp_path_factory.mktemp("cpu_trace") / "cpu.pt.trace.json"
    data = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.randn(24, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for x, y in loader:
            with record_function("copy data"):
                x, y = x.clone(), y.clone()
            with record_function("forward"):
                pred = model(x)
            with record_function("calc loss"):
                loss = torch.nn.functional.mse_loss(pred, y)
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer step"):
                optimizer.step()
                optimizer.zero_grad()
            prof.step()
    return path


def test_cpu_trace_has_operators_and_no_gpu_measures(cpu_trace):
    steps = measure_steps(cpu_trace)
    assert len(steps) == 3
    gpu_only = [name for name, m in MEASURES.items() if m.gpu_only]
    for step in steps:
        regions = step.regions
        assert list(regions) == [
            "data wait",
            "copy data",
            "forward",
            "calc loss",
            "backward",
            "optimizer step",
            "other",
            "step",
        ]
        for name, measures in regions.items():
            assert measures["wall_ms"] > 0, name
            assert all(measures[m] is None for m in gpu_only), name  # not 0: there is no GPU to measure
        # the operators each region dispatched: clone in copy data, the Linear's addmm, mse_loss, SGD's updates
        assert regions["copy data"]["ops"] >= 2 and regions["forward"]["ops"] >= 1 and regions["backward"]["ops"] >= 1
        assert regions["step"]["ops"] == sum(regions[name]["ops"] for name in regions if name != "step")
        assert regions["optimizer step"]["slices"] == 0
    summary = summarise(load_trace(cpu_trace), steps)
    assert summary.gpu is False and summary.warnings == []
    assert summary.regions["forward"]["gpu_ms"].n == 0


# ----------------------------------------------------------------------------- timelines


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_draw_step_renders_a_png(tmp_path, cpu_trace):
    gpu = build(GPU_TRACE)
    path = draw_step(StepModel(gpu), tmp_path / "step.png", title="padded, H200")
    assert path == tmp_path / "step.png"
    width, height = png_size(path)
    assert width > 1000 and 200 < height < width
    assert 20_000 < path.stat().st_size < 2_000_000
    png_size(draw_step(StepModel(gpu, 12), tmp_path / "step12.png"))
    cpu = draw_step(StepModel(build(cpu_trace)), tmp_path / "cpu.png")
    assert png_size(cpu)[1] < height  # no GPU rows to draw
    with pytest.raises(RecordError, match=r"no step 99 \(its steps: 10, 11, 12\)$"):
        StepModel(gpu, 99)
    gpu.steps.clear()  # every step left out as damaged where the extract was read
    with pytest.raises(RecordError, match=r"^the extract has no step left to draw \(each was damaged"):
        StepModel(gpu)


def test_a_step_model_places_the_gpu_work_the_step_launched():
    """The model of step 5 of the hand-written trace: the late kernel its forward launched runs in step 6's time,
    and it is the step's, coloured as forward's."""
    model = StepModel(build(synthetic_events()), 5)
    late = [e for e in model.gpu_events() if e[1] == 1200]
    assert late == [("7", 1200, 100, "kernel", "forward")]
    assert model.end() == 1300  # past the step's own 1000 µs on the host
    regions = {region for *_, region in model.gpu_events()}
    assert regions == {"copy data", "forward", "calc loss", "backward", "other"}
    assert model.calls(2) and len(model.calls(1)) == 10  # the syncs, and the 10 launches


def test_draw_steps_stacks_runs_on_one_axis(tmp_path, cpu_trace):
    gpu = StepModel(build(GPU_TRACE))
    path = draw_steps([("padded H200", gpu), ("cpu", StepModel(build(cpu_trace)))], tmp_path / "steps.png")
    one = draw_step(gpu, tmp_path / "one.png")
    assert png_size(path)[1] > png_size(one)[1]  # 3 rows (the CPU run has no GPU row) against 2
    assert path.stat().st_size > 20_000
    with pytest.raises(ValueError, match="at least one"):
        draw_steps([], tmp_path / "empty.png")


# ----------------------------------------------------------------------------- broken and foreign files


# gzip without its time stamp: a parameter's bytes are the same in every process (pytest-xdist compares the ids)
@pytest.mark.parametrize(
    "name, content",
    [
        ("garbage.json", b"\x00\x01 not json"),
        ("truncated.json.gz", gzip.compress(b'{"traceEvents": [{"ph": "X"}]}', mtime=0)[:20]),
        ("foreign.json", json.dumps({"rows": [1, 2, 3]}).encode()),
        ("numbers.json", json.dumps({"traceEvents": [1, 2]}).encode()),
        ("no_steps.json", json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add"}]}).encode()),
        ("malformed.json", json.dumps([{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1"}]).encode()),
        ("deep.json", b'{"traceEvents": ' + b"[" * 100_000),  # was a RecursionError traceback
    ],
)
def test_broken_or_foreign_file_is_a_clear_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        measure_steps(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="absent.json"):
        load_trace(tmp_path / "absent.json")


# ----------------------------------------------------------------------------- recorded H100 traces, as training runs


@pytest.mark.parametrize("strategy, backward_launches", [("padded", 125), ("packed", 40)])
def test_h100_traces_count_the_backward_from_the_autograd_thread(strategy, backward_launches):
    """`make profile` on an H100 (seed scale, torch 2.11, regions unsynchronised; tests/data/make_fixture.py
    trimmed them to three steps): the autograd thread is named twice, "python3" and "pt_autograd_0", and
    launches the backward's kernels; every count adds up, and no invariant is violated."""
    path = DATA / f"{strategy}_h100_trace.json.gz"
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {}
    for e in events:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            names.setdefault(e["tid"], []).append(e["args"]["name"])
    assert any(len(n) == 2 and any("pt_autograd" in x for x in n) for n in names.values())
    steps = measure_steps(events)
    assert check_steps(events, steps) == []
    for step in steps:
        regions = step.regions
        assert regions["backward"]["launches"] == regions["backward"]["kernels"] == backward_launches
        assert regions["backward"]["gpu_ms"] > 10  # the conv and Linear layers' gradients
        assert 40 < regions["step"]["device_step_ms"] < 46  # the device paces the step, not the host
        assert regions["step"]["syncs"] == 1 and regions["step"]["sync_wait_ms"] == 0  # the loader's, no lab sync


# ----------------------------------------------------------------------------- the window's opening, the launch queue


def opening_events(first_start: float, launched_at: float | None) -> list[dict]:
    """Two steps of 1000 µs at 0 and 1000. In the first, a kernel starts at ``first_start`` and runs to 1000 with no
    gap: launched before the window opened (no call in the trace: ``launched_at`` None) or at ``launched_at``. In the
    second, a kernel launched at its start runs 1100-2000."""
    events = [mark("ProfilerStep#1", 0, 1000), mark("ProfilerStep#2", 1000, 1000)]
    if launched_at is not None:
        events.append(call("cudaLaunchKernel", launched_at, 3, 9))
    events.append(gpu("kernel", "first", first_start, 1000 - first_start, 9))
    return events + [call("cudaLaunchKernel", 1001, 3, 11), gpu("kernel", "next", 1100, 900, 11)]


@pytest.mark.parametrize(
    "first_start, launched_at, idle",
    [
        (300, None, 0.0),  # launched before the window, started 300 µs into it: it waited behind unrecorded work
        (300, 1, 0.0),  # launched at 1 µs, started 299 µs later (over QUEUED_US): it waited too
        (60, 1, 0.06),  # started 59 µs after its launch: it did not wait, so the device idled before it
    ],
)
def test_work_running_unrecorded_when_the_window_opened_counts_as_busy(first_start, launched_at, idle):
    """The host runs ahead, so when the profiler's window opens the device still runs work launched before it, which
    the trace does not hold: the first step's idle share counts the gap before the first recorded event as busy where
    that event waited behind earlier work, and as idle where it did not. Later steps are as they were."""
    steps = measure_steps(opening_events(first_start, launched_at))
    assert steps[0].regions["step"]["gpu_idle_share"] == pytest.approx(idle)
    assert steps[1].regions["step"]["gpu_idle_share"] == pytest.approx(0.1)  # 1000-1100: nothing ran


def test_an_idle_share_the_neighbouring_steps_contradict_is_a_warning():
    """A step the host took no longer over, whose device idled far more than in the steps beside it, is named; a step
    that the host took longer over may idle the device (the host was late), and is not."""

    def steps(walls, idles):
        out = []
        for n, (wall, idle) in enumerate(zip(walls, idles, strict=True)):
            out.append(measure_steps(synthetic_events())[0])
            out[-1].step = n
            out[-1].regions["step"] |= {"wall_ms": wall, "gpu_idle_share": idle}
        return out

    from detector.lab.measure.analysis import _idle_checks

    (warning,) = _idle_checks(steps([18, 42, 42], [0.37, 0.01, 0.01]))
    assert "in 1 of 3 steps (step 0 (37.0 % against at most 1.0 %))" in warning
    assert _idle_checks(steps([90, 42, 42], [0.37, 0.01, 0.01])) == []  # the host was late: the device waited
    assert _idle_checks(steps([42, 42, 42], [0.04, 0.01, 0.01])) == []  # 3 points: within IDLE_GAP
    assert _idle_checks(steps([42, 42, 42], [0.01, 0.01, 0.01])) == []


@pytest.mark.parametrize("strategy, first_idle", [("padded", 0.031), ("packed", 0.045)])
def test_h100_traces_first_step_idle_is_its_neighbours(strategy, first_idle):
    """On the recorded H100 traces the device ran steps' work the host launched 100-170 ms earlier: the first step's
    idle share was ``first_idle`` with the opening counted idle, and is now within a point of the steps after it."""
    steps = measure_steps(DATA / f"{strategy}_h100_trace.json.gz")
    idle = [s.regions["step"]["gpu_idle_share"] for s in steps]
    assert idle[0] < first_idle - 0.01
    assert abs(idle[0] - statistics.median(idle[1:])) < 0.01


def test_launches_that_wait_for_room_in_the_queue_are_queue_wait():
    """A launch over 0.2 ms (QUEUE_BLOCKED_US) waited for room in the launch queue: its time is the region's queue
    wait, and adds up over the regions to the step; a launch of a few µs is none."""
    events = [mark("ProfilerStep#1", 0, 5000), mark("forward", 0, 3000), mark("calc loss", 3000, 2000)]
    events += [call("cudaLaunchKernel", 10, 5, 1), gpu("kernel", "a", 20, 5, 1)]
    events += [call("cudaLaunchKernel", 100, 2500, 2), gpu("kernel", "b", 2600, 5, 2)]  # blocked 2.5 ms
    events += [call("cudaLaunchKernel", 3000, 199, 3), gpu("kernel", "c", 3200, 5, 3)]  # under the bound
    (step,) = measure_steps(events)
    waits = {r: step.regions[r]["queue_wait_ms"] for r in ("forward", "calc loss", "step")}
    assert waits == {"forward": pytest.approx(2.5), "calc loss": 0.0, "step": pytest.approx(2.5)}


@pytest.mark.parametrize("strategy, low, high", [("padded", 5, 20), ("packed", 1, 25)])
def test_h100_traces_host_waited_on_a_full_launch_queue(strategy, low, high):
    """The recorded H100 steps are device-paced: the host waited milliseconds a step for room in the launch queue."""
    steps = measure_steps(DATA / f"{strategy}_h100_trace.json.gz")
    assert all(low < s.regions["step"]["queue_wait_ms"] < high for s in steps)


def test_a_device_paced_runs_representative_step_is_typical_on_the_device_and_the_host():
    """On the recorded packed H100 trace the device steps are 42.2, 42.2 and 42.1 ms, the host's 17.8 (the window's
    first, launched into a half-empty queue), 42.3 and 42.1: the step shown is the one near both medians, not the first
    of equal device steps, whose host time would say the host was twice as fast."""
    steps = measure_steps(DATA / "packed_h100_trace.json.gz")
    chosen = representative_step(steps).regions["step"]
    assert chosen["wall_ms"] > 40 and 42 < chosen["device_step_ms"] < 42.5
