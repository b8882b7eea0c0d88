"""Memory measures (detector/lab/record/measures.py MEMORY): exact figures per region on a hand-written trace, the
operator each allocation is attributed to, the checks that catch a broken trace, the allocator's own figures held
against the trace's, the extract's rows and their envelope, the verdicts that lead with memory, and a real CPU
profile."""

import gzip
import json
from pathlib import Path

import pytest
import torch
from lab_helpers import H100_TRACES, TINY_PROFILE
from trace_helpers import MAIN, MEMORY_EVENTS, mark, memory, synthetic_events, synthetic_memory

from detector.config.schema import load_config
from detector.lab.measure.allocator import snapshot, step_figures
from detector.lab.measure.analysis import allocator_checks, check_steps, measure_steps, summarise
from detector.lab.measure.extract import MEMORY_ROWS, build
from detector.lab.measure.trace import load_trace
from detector.lab.present.text import memory_card, run_card
from detector.lab.profile import run_profile
from detector.lab.record.measures import format_value, memory_text
from detector.lab.record.run import read_summary
from detector.lab.record.steps import EXTRACT, Extract, StepModel, read_extract

# region: (live at its start, peak allocated, peak rise, allocated bytes, allocations, frees) of step 5 of
# synthetic_memory(), from MEMORY_EVENTS: 1000 B live before the first event
EXPECTED = {
    "data wait": (1000, 1000, 0, 0, 0),
    "copy data": (1000, 1100, 100, 100, 1),
    "forward": (1100, 1800, 700, 700, 2),
    "calc loss": (1300, 2300, 1000, 1000, 1),
    "backward": (1300, 1600, 300, 300, 1),
    "other": (1000, 1600, 0, 0, 0),  # [0, 10), [50, 100) and [800, 1000): the free at 900 rises nothing
    "step": (1000, 2300, 1300, 2100, 5),
}


def test_each_regions_memory_from_the_allocators_events_exactly():
    steps = measure_steps(synthetic_memory())
    regions = steps[0].regions
    for region, (_, peak, rise, allocated, allocs) in EXPECTED.items():
        got = tuple(regions[region][m] for m in ("peak_bytes", "peak_rise_bytes", "alloc_bytes", "allocs"))
        assert got == (peak, rise, allocated, allocs), region
    # a GPU's device mallocs are its cudaMalloc calls (one in forward), not its allocations
    assert regions["forward"]["device_mallocs"] == 1 and regions["calc loss"]["device_mallocs"] == 0
    assert regions["step"]["device_mallocs"] == 1 and regions["step"]["device_frees"] == 0
    # reserved free at the step's end: the allocator's 4096 B reserved less the 1000 allocated after the last event
    assert regions["step"]["reserved_free_bytes"] == 4096 - 1000
    assert regions["calc loss"]["reserved_free_bytes"] is None  # the step's alone
    assert regions["step"]["alloc_retries"] is None  # not in a trace: the allocator's figures give it
    # step 6 allocates nothing: its level is the one step 5 left
    six = steps[1].regions["step"]
    assert (six["peak_bytes"], six["peak_rise_bytes"], six["allocs"]) == (1000, 0, 0)
    assert check_steps(synthetic_memory(), steps) == []


def test_a_gpu_runs_memory_is_its_gpus_and_each_event_has_the_operator_that_needed_it():
    trace = load_trace(synthetic_memory())
    assert trace.memory.device == "cuda:0"
    assert len(trace.memory.ts) == len(MEMORY_EVENTS)  # the CPU tensor's allocation left out
    assert trace.memory.ops == ["", "aten::addmm", "aten::relu", "", "aten::select", "aten::item", "aten::mul", ""]


def test_without_memory_events_the_memory_measures_are_absent_not_zero():
    regions = measure_steps(synthetic_events())[0].regions
    for m in ("peak_bytes", "peak_rise_bytes", "alloc_bytes", "allocs", "alloc_retries", "reserved_free_bytes"):
        assert regions["step"][m] is None, m
    assert regions["forward"]["device_mallocs"] == 1  # a GPU's cudaMalloc calls are in the trace all the same


def test_a_cpu_runs_memory_is_the_cpus_and_its_allocator_mallocs_every_allocation():
    cpu = [e for e in synthetic_memory() if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu = [e for e in cpu if not (e.get("name") == "[memory]" and e["args"]["Device Type"] == 1)]
    cpu += [memory(ts, b, t, reserved=0, tid=tid, device=(0, -1)) for ts, b, t, tid in MEMORY_EVENTS]
    regions = measure_steps(cpu)[0].regions
    step = regions["step"]
    # MEMORY_EVENTS' five allocations and three frees, and the CPU tensor's allocation at 250
    assert step["allocs"] == 6 and step["device_mallocs"] == 6 and step["device_frees"] == 3
    assert step["alloc_retries"] is None and step["reserved_free_bytes"] is None  # none on the CPU


def test_a_memory_event_that_does_not_follow_from_the_one_before_is_named():
    events = [(350, -500, 1200, MAIN) if i == 3 else e for i, e in enumerate(MEMORY_EVENTS)]  # a lost event's 100 B
    warnings = check_steps(synthetic_memory(events), measure_steps(synthetic_memory(events)))
    # its own link and the next: 1800 - 500 is not 1200, and 1200 + 1000 is not 2300
    assert any("2 of 8 memory events do not follow from the one before" in w for w in warnings), warnings
    # calc loss then rises 1100 B over its start of 1200 with 1000 B allocated
    assert any("rises further than it allocated in 1 of 2 steps (step 5: calc loss (+1,100 B" in w for w in warnings)


def test_a_region_that_rises_further_than_it_allocated_is_named():
    steps = measure_steps(synthetic_memory())
    steps[0].regions["calc loss"]["peak_rise_bytes"] = 5000  # more than its 1000 allocated bytes
    warnings = check_steps(synthetic_memory(), steps)
    assert any("rises further than it allocated in 1 of 2 steps (step 5: calc loss" in w for w in warnings), warnings
    steps[0].regions["step"]["peak_bytes"] = 9000  # no region reaches it
    warnings = check_steps(synthetic_memory(), steps)
    assert any("the step's peak is not its regions' highest in 1 of 2 steps" in w for w in warnings), warnings


# The allocator's figures of step 5 as torch.cuda.memory_stats gives them: 1000 B live, a peak of 2300, one cudaMalloc
ALLOCATOR = {5: {"live": 1000, "peak": 2300, "device_mallocs": 1, "retries": 2}}


def test_the_allocators_own_figures_set_the_retries_and_agree_with_the_trace():
    steps = measure_steps(synthetic_memory())
    assert allocator_checks(steps, ALLOCATOR) == []
    assert steps[0].regions["step"]["alloc_retries"] == 2
    analysis = summarise(load_trace(synthetic_memory()), steps, ALLOCATOR)
    assert analysis.regions["step"]["alloc_retries"].median == 2


@pytest.mark.parametrize(
    "change, warning",
    [
        ({"peak": 2302}, None),  # within ALLOCATOR_TOLERANCE (1e-3: 2.3 B of 2300)
        ({"peak": 2400}, "the step's peak differs from the allocator's"),
        ({"live": 900}, "the bytes live at the step's start differ"),
        ({"device_mallocs": 3}, "under expandable segments it maps memory with driver calls the trace does not record"),
    ],
)
def test_the_trace_is_held_against_the_allocators_figures(change, warning):
    warnings = allocator_checks(measure_steps(synthetic_memory()), {5: ALLOCATOR[5] | change})
    assert (warnings == []) if warning is None else any(warning in w for w in warnings), warnings


def test_the_allocators_figures_of_a_step_from_two_memory_stats_snapshots():
    before = {"allocated_bytes.all.current": 1000, "reserved_bytes.all.current": 4096, "allocation.all.allocated": 7}
    before |= {"num_device_alloc": 3, "num_device_free": 1, "num_alloc_retries": 0}
    after = dict(before) | {"allocated_bytes.all.current": 1200, "allocated_bytes.all.peak": 2300}
    after |= {
        "allocation.all.allocated": 12,
        "num_device_alloc": 5,
        "num_alloc_retries": 1,
        "reserved_bytes.all.current": 8192,
    }
    figures = step_figures(snapshot(before), snapshot(after))
    assert figures == {
        "live": 1000,
        "peak": 2300,
        "allocations": 5,
        "device_mallocs": 2,
        "device_frees": 0,
        "retries": 1,
        "reserved_free": 8192 - 1200,
    }
    # a torch without num_device_alloc: its segments' counters stand for the device mallocs
    old = {"segment.all.allocated": 4, "segment.all.freed": 2}
    assert snapshot(old)["device_mallocs"] == 4 and snapshot(old)["device_frees"] == 2


# ----------------------------------------------------------------------------- the extract


def test_the_extract_holds_each_steps_memory_with_its_operators():
    found = build(synthetic_memory())
    step = found.steps["5"]
    assert step.memory.device == "cuda:0" and step.memory.start == 1000
    assert step.memory.events == 8
    rows = step.memory.rows
    assert [r[1] for r in rows] == [total for _, _, total, _ in MEMORY_EVENTS]
    assert [found.names[r[3]] if r[3] >= 0 else "" for r in rows][1:3] == ["aten::addmm", "aten::relu"]
    start, modelled = StepModel(found, 5).memory()
    assert start == 1000 and [region for *_, region in modelled] == [
        "copy data", "forward", "forward", "forward", "calc loss", "calc loss", "backward", "other"
    ]  # fmt: skip
    assert found.steps["6"].memory.rows == [] and found.steps["6"].memory.start == 1000
    Extract.parse(json.loads(json.dumps(found.to_json())), "extract")  # what it writes, it reads


def test_a_compiled_graphs_own_allocations_are_named_by_the_graph_and_its_operator_not_its_hash():
    """The packed strategy's step as recorded on an H100 (its model compiled), with allocator events placed as
    inductor's code makes them: a buffer allocated in the forward graph of region 1/0 just before its triton kernel,
    freed after it; one in a backward graph; one inside an operator of the graph (named by that operator, as
    before). None is named by the graph's record function, ``## Call CompiledFxGraph <hash> ##``."""
    events = json.loads(gzip.decompress(H100_TRACES["packed"].read_bytes()))["traceEvents"]
    step = next(e for e in events if e.get("name") == "ProfilerStep#10")
    ops = [e for e in events if e.get("cat") == "cpu_op" and step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
    forward = next(e for e in ops if e["name"].startswith("triton_poi_fused_add_cat_div_mul_sigmoid_split"))
    backward = next(e for e in ops if e["name"] == "triton_poi_fused_threshold_backward_0")
    stem = next(e for e in ops if e["name"] == "detector::stem_forward")
    placed = [  # (µs, bytes, thread): the allocations just before a kernel's launch, the free just after it
        (forward["ts"] - 2, 2**20, forward["tid"]),
        (forward["ts"] + forward["dur"] + 2, -(2**20), forward["tid"]),
        (backward["ts"] - 2, 2**21, backward["tid"]),
        (stem["ts"] + 10, 2**22, stem["tid"]),
    ]
    total = 2**30
    for ts, nbytes, tid in placed:
        total += nbytes
        events.append(memory(ts, nbytes, total, tid=tid) | {"pid": step["pid"]})
    found = build(events)
    rows = found.steps["10"].memory.rows
    assert [found.names[r[3]] for r in sorted(rows)] == [
        "detector::stem_forward",
        "compiled graph (forward, region 1/0), before triton_poi_fused_add_cat_div_mul_sigmoid_split_sub_view_0",
        "compiled graph (forward, region 1/0), after triton_poi_fused_add_cat_div_mul_sigmoid_split_sub_view_0",
        "compiled graph (backward), before triton_poi_fused_threshold_backward_0",
    ]
    assert not any("CompiledFxGraph" in name for name in found.names)


def test_a_step_of_many_events_keeps_the_envelope_and_its_exact_peak():
    events = [mark("ProfilerStep#1", 0, 100_000)]
    total, peak_at = 0, 61_234
    for k in range(40_000):  # a saw of +64 / -64, and one spike of a MiB
        size = 2**20 if k == peak_at // 2 else 64 if k % 2 == 0 else -64
        total += size
        events.append(memory(k * 2.5, size, total, device=(0, -1)))
        if size == 2**20:
            total -= size
            events.append(memory(k * 2.5 + 1, -size, total, device=(0, -1)))
    found = build(events).steps["1"].memory
    assert found.events == len(events) - 1
    assert len(found.rows) <= MEMORY_ROWS
    assert max(r[1] for r in found.rows) == 2**20 + 64  # the spike, kept
    assert min(r[1] for r in found.rows) == 0


def test_a_broken_memory_row_leaves_that_steps_memory_out():
    found = build(synthetic_memory()).to_json()
    found["steps"]["5"]["memory"]["rows"][0] = [1.0, 2, 3, 99]  # an operator past the name table
    read = Extract.parse(found, "extract")
    assert read.steps["5"].memory is None and read.steps["6"].memory is not None
    assert read.left_out == [
        f"extract: step 5.memory.rows[0].operator is 99, expected an integer in [-1, {len(read.names) - 1}]: "
        "step 5.memory left out"
    ]


# ----------------------------------------------------------------------------- real profiles, each on its device


def profile_on(tmp_path_factory, device: str):
    out = tmp_path_factory.mktemp(f"profile-{device}")
    cfg = load_config(
        TINY_PROFILE + [f"device={device}", "profile.strategy=padded", f"profile.out_dir={out}", "profile.timed=2"]
    )
    run_dir = run_profile(cfg).run_dir
    return run_dir


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    return profile_on(tmp_path_factory, "cpu")  # on the CPU whatever the machine holds: the CPU's allocator


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the caching allocator's own figures")
    return profile_on(tmp_path_factory, "cuda")


def test_a_cpu_profile_records_its_allocators_memory(cpu_run):
    record = read_summary(cpu_run)
    assert record.analysis.warnings == []  # the chain, the rises and the step's peak hold on a real trace
    step, loss = record.stats("step", "peak_bytes"), record.stats("calc loss", "peak_rise_bytes")
    assert step.median > 0 and loss.median > 0
    # the CPU's allocator asks the system for every allocation: no cache between
    assert record.stats("step", "allocs").median == record.stats("step", "device_mallocs").median > 0
    assert record.stats("step", "alloc_retries") is None and record.stats("step", "reserved_free_bytes") is None
    rows = read_extract(Path(cpu_run) / EXTRACT).steps
    assert all(step.memory.device == "cpu" and step.memory.rows for step in rows.values())
    with gzip.open(next((Path(cpu_run) / "trace").glob("*.json.gz"))) as f:
        assert '"[memory]"' in f.read().decode()


def test_a_gpu_profile_records_the_caching_allocators_memory(gpu_run):
    record = read_summary(gpu_run)
    assert record.analysis.warnings == []  # the trace's peak is the allocator's own (allocator_checks), too
    assert record.stats("step", "peak_bytes").median > 0 and record.stats("calc loss", "peak_rise_bytes").median > 0
    allocs, mallocs = record.stats("step", "allocs").median, record.stats("step", "device_mallocs").median
    # warm steps: the caching allocator serves allocations from the segments it holds, cudaMalloc is rare
    assert allocs > 0 and 0 <= mallocs < allocs
    assert record.stats("step", "alloc_retries").median == 0  # a number on a GPU (no retry in a tiny step)
    assert record.stats("step", "reserved_free_bytes").median >= 0
    rows = read_extract(Path(gpu_run) / EXTRACT).steps
    assert all(step.memory.device.startswith("cuda") and step.memory.rows for step in rows.values())


def test_the_card_shows_every_memory_measure_and_none_where_the_cpu_has_none(cpu_run):
    record = read_summary(cpu_run)
    card = run_card(record)
    assert "Memory on cpu, median [q1–q3] per step:" in card
    step_row = next(line for line in card.splitlines() if line.startswith("| step |") and "none" in line)
    assert step_row.endswith("| none | none |")  # alloc retries, reserved free: not 0, none
    assert "alloc retries, reserved free: none on the CPU" in card
    record.analysis.regions["step"].pop("peak_bytes")
    assert memory_card(record)[1].startswith("Memory: not recorded")


def test_the_card_names_the_gpu_and_every_memory_measure_has_a_value_there(gpu_run):
    record = read_summary(gpu_run)
    card = run_card(record)
    assert f"Memory on {torch.cuda.get_device_name()}, median [q1–q3] per step:" in card
    step_row = next(line for line in card.splitlines() if line.startswith("| step |"))
    assert "none" not in step_row and "none on the CPU" not in card


def test_memory_is_written_in_binary_units():
    assert memory_text(3 * 2**30) == "3 GiB" and memory_text(1536 * 2**10) == "1.5 MiB" and memory_text(12) == "12 B"
    assert format_value("peak_bytes", 2**20) == "1 MiB" and format_value("h2d_bytes", 1e6) == "1 MB"
