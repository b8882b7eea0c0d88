"""`bench memory` (detector/bench/memory.py, ceiling.py, crowd.py): the ceiling's search against a device of known
capacity, out-of-memory probes and time limits; the crowd file; the document's tables from hand-written results of a
GPU; the whole command on the CPU, its proof folder within the limits the GPU proof is copied back under; on a GPU,
one real probe past the device's memory."""

import json
import tarfile

import numpy as np
import pytest
import torch
from conftest import stop_before_rename

from detector.bench import ceiling
from detector.bench.ceiling import GRANULE, RESOLUTION, Probe, next_batch, search
from detector.bench.crowd import CROWD_FEWEST, CROWD_MOST, crowd_counts, write_crowd
from detector.bench.memory import allocator_lines, ceiling_lines, config_args, finish, read_child, run_bench
from detector.checked import RecordError, read_json
from detector.cli import main as cli
from detector.config.schema import load_config
from detector.data.annotations import read_annotations, slots_for
from detector.lab.measure.allocator import EXPANDABLE

GIB = 2**30


def device(capacity: int, base: int, per_image: int, failing=(), seconds_per_image: float = 1e-4):
    """A fake device: a batch fits where base + per_image × batch <= capacity; ``failing`` batches fail otherwise."""
    tried = []

    def probe(batch: int) -> Probe:
        tried.append(batch)
        if batch in failing:
            return Probe(batch, False, 0.1, error="failed: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED")
        fits = base + per_image * batch <= capacity
        peak = base + per_image * batch if fits else None
        error = None if fits else "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
        return Probe(batch, fits, seconds_per_image * batch, peak, base if fits else None, error)

    def estimate(found: Probe) -> int:
        return int((capacity - found.base) / ((found.peak - found.base) / found.batch))

    return probe, estimate, tried


@pytest.mark.parametrize("per_image", [3_000_000, 4_100_000, 17_000_000])
def test_the_ceiling_is_found_within_its_resolution_in_a_few_probes(per_image):
    # 80 GiB, 17 GiB of model and optimizer: the largest batch is (80 - 17) GiB / per_image
    probe, estimate, tried = device(80 * GIB, 17 * GIB, per_image)
    found = search(probe, 1024, estimate, seconds=600)
    truth = (63 * GIB) // per_image
    assert found["largest"] <= truth < found["first_failure"]
    assert found["first_failure"] - found["largest"] <= max(GRANULE, RESOLUTION * found["largest"])
    assert found["stopped"] is None and len(tried) <= 8, tried  # the estimate lands near it at once
    assert all(p["fits"] == (p["batch"] <= truth) for p in found["probes"])


def test_a_first_batch_that_does_not_fit_is_halved_and_a_pessimistic_estimate_still_converges():
    probe, estimate, tried = device(10 * GIB, 4 * GIB, 8_000_000)  # 805 images fit: the first batch, 1024, does not
    found = search(probe, 1024, estimate, seconds=600)
    assert found["largest"] <= 805 < found["first_failure"] and tried[:2] == [1024, 512]
    probe, _, tried = device(80 * GIB, 17 * GIB, 4_000_000)
    found = search(probe, 1024, lambda p: p.batch, seconds=600)  # an estimate that says "here": growth decides
    assert found["largest"] <= (63 * GIB) // 4_000_000 < found["first_failure"]


def test_a_probe_that_would_not_finish_in_time_is_not_started_and_the_ceiling_is_a_lower_bound():
    probe, estimate, tried = device(80 * GIB, 17 * GIB, 4_000_000, seconds_per_image=0.004)  # 4 s at batch 1024
    found = search(probe, 1024, estimate, seconds=10)
    assert tried == [1024] and found["largest"] == 1024 and found["first_failure"] is None
    assert found["stopped"].startswith("time-limited: a probe at ")


def test_a_failure_other_than_memory_ends_the_search_with_its_reason():
    # 1024 fits; the estimate (16,911) is past GROWTH × 1024, so the second probe is 8192, which fails otherwise
    probe, estimate, tried = device(80 * GIB, 17 * GIB, 4_000_000, failing={8192})
    found = search(probe, 1024, estimate, seconds=600)
    assert tried == [1024, 8192] and found["largest"] == 1024
    assert found["stopped"].startswith("failed: cuDNN error")


def test_next_batch_steps():
    assert next_batch(1024, None, None) == 2048  # no estimate: double
    assert next_batch(1024, None, 100_000) == 8192  # at most GROWTH times the largest fit
    assert next_batch(1024, None, 2000) == 2016  # just past the estimate, in granules
    assert next_batch(15_000, 16_000, None) == 15_488  # halfway
    assert next_batch(15_800, 16_000, None) == 0  # within RESOLUTION: done
    assert next_batch(0, 64, None) == 32 and next_batch(0, 1, None) == 0


def test_an_out_of_memory_error_is_told_from_other_failures():
    assert ceiling.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert ceiling.out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not ceiling.out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_the_crowd_file_holds_hundreds_of_faces_an_image_and_fits_1024_slots(tmp_path):
    counts = crowd_counts()
    assert counts.min() >= CROWD_FEWEST and counts.max() == CROWD_MOST and 200 < np.median(counts) < 450
    annotations = read_annotations(f"widerface:{write_crowd(tmp_path / 'crowd.txt')}")
    assert (annotations.counts == counts).all()
    assert slots_for(annotations, 1024, "fit") == 1024


def test_the_children_get_the_configuration_that_differs_from_this_machines():
    default = load_config([], announce=None)
    # each the opposite of this machine's default (a GPU compiles by default, the CPU does not)
    compile = "false" if default.train.compile else "true"
    batch = default.data.batch_size + 1
    cfg = load_config([f"data.batch_size={batch}", "model.channels=[4,16]", f"train.compile={compile}"], announce=None)
    args = config_args(cfg)
    assert {f"data.batch_size={batch}", "model.channels=[4,16]", f"train.compile={compile}"} <= set(args)
    assert f"train.lr={default.train.lr}" not in args  # what this machine's default already is is not passed
    assert load_config(args, announce=None) == cfg
    # a CPU run on any machine (the CPU's preset), with a value that preset would change: the child runs it too
    cpu = load_config(["device=cpu", "train.compile=true"], announce=None)
    assert config_args(cpu)[0] == "preset=cpu" and load_config(config_args(cpu), announce=None) == cpu


# ----------------------------------------------------------------------------- the document, from a GPU's results


def child(setting, allocator_rows=None, ceilings=None):
    jobs = [
        {"job": [source, name, "allocator"], "slots": slots, "allocator": row}
        for (source, name, slots), row in (allocator_rows or {}).items()
    ]
    jobs += [
        {"job": [source, name, "ceiling"], "slots": slots, "ceiling": found}
        for (source, name, slots), found in (ceilings or {}).items()
    ]
    return {"setting": setting, "device": "cuda:0", "jobs": jobs}


def row(reserved_free, mallocs, peak=40 * GIB):
    return {"reserved_free": reserved_free, "device_mallocs": mallocs, "device_frees": 0, "retries": 0, "peak": peak}


CROWD = "crowd:/w/crowd_bbx_gt.txt"


def test_the_ceiling_table_names_each_source_and_its_lower_bounds():
    fit = {"batch": 15_488, "fits": True, "seconds": 1.5, "peak": 79 * GIB, "base": 17 * GIB, "error": None}
    oom = {"batch": 16_000, "fits": False, "seconds": 0.4, "peak": None, "base": None, "error": "out of memory: ..."}
    found = {"largest": 15_488, "first_failure": 16_000, "probes": [fit, oom], "stopped": None}
    limited = {"largest": 2048, "first_failure": None, "probes": [fit | {"batch": 2048}], "stopped": "time-limited: x"}
    results = child("default", ceilings={("synthetic", "padded", 256): found, (CROWD, "loop", 1024): limited})
    lines = "\n".join(ceiling_lines(results, load_config([], announce=None)))
    assert "| synthetic faces, 256 slots | padded | 15,488 | 16,000 | 79 GiB | 2 | 1.9 |" in lines
    assert "| crowd file, 1024 slots (fit) | loop | ≥ 2,048 | — | 79 GiB | 1 | 1.5 (time-limited: x) |" in lines


def test_the_allocator_table_and_what_expandable_segments_changed():
    default = child(
        "default",
        {("synthetic", "padded", 256): row(2 * GIB, 0), (CROWD, "packed", 1024): row(6 * GIB, 3)},
    )
    expandable = child(
        EXPANDABLE, {("synthetic", "padded", 256): row(2 * GIB, 0), (CROWD, "packed", 1024): row(GIB, 0)}
    )
    lines = "\n".join(allocator_lines(default, expandable, torch.device("cuda")))
    assert "| default | crowd file, 1024 slots (fit) | packed | 6 GiB | 3 | 0 | 0 | 40 GiB |" in lines
    assert f"| {EXPANDABLE} | crowd file, 1024 slots (fit) | packed | 1 GiB | 0 | 0 | 0 | 40 GiB |" in lines
    assert "held less reserved-but-free memory or made fewer device mallocs for packed (crowd); not for padded" in lines
    assert "- packed, crowd: reserved free 6 GiB → 1 GiB; device mallocs per step 3 → 0." in lines


def test_on_the_cpu_the_allocator_says_none_and_why():
    cpu = child("default", {("synthetic", "padded", 64): dict.fromkeys(row(0, 0))})
    lines = "\n".join(allocator_lines(cpu, None, torch.device("cpu")))
    assert "| default | synthetic faces, 64 slots | padded | none | none | none | none | none |" in lines
    assert "None on the CPU: c10's CPU allocator neither caches, reserves nor retries." in lines


# ----------------------------------------------------------------------------- the command on the CPU


# ----------------------------------------------------------------------------- the records between parent and child


def test_the_jobs_and_the_results_are_records_written_and_read_again(tmp_path):
    jobs = [["crowd:/w/crowd_bbx_gt.txt", "padded", "allocator"], ["synthetic", "loop", "ceiling"]]
    ceiling.Jobs(jobs).write(tmp_path / "jobs.json")
    assert ceiling.read_jobs(tmp_path / "jobs.json") == jobs
    (tmp_path / "old.json").write_text(json.dumps(jobs))  # version 1: the bare list
    assert ceiling.read_jobs(tmp_path / "old.json") == jobs
    found = child("default", {(CROWD, "padded", 1024): row(0, 3)}, {("synthetic", "loop", 64): {"largest": 96}})
    ceiling.ChildResults(**found).write(tmp_path / "default.json")
    assert read_child(tmp_path / "default.json") == found | {"version": ceiling.VERSION}
    (tmp_path / "v1.json").write_text(json.dumps(found))  # written before the record had a version
    assert read_child(tmp_path / "v1.json") == found | {"version": ceiling.VERSION}
    assert read_child(tmp_path / "none.json") is None  # a child that wrote nothing: no warning
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written atomically: no temporary left


def test_a_damaged_jobs_file_is_refused_in_one_line_naming_the_file_and_field(tmp_path, capsys):
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps({"version": 2, "jobs": [["synthetic", "padded", "allocator"], ["synthetic", "x", 3]]}))
    assert cli.main(["ceiling", f"--out={tmp_path / 'out.json'}", f"--jobs={path}", "device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}.jobs[1][2] is int 3, expected a string\n" and not (tmp_path / "out.json").exists()


def test_a_damaged_childs_results_are_one_warning_naming_the_file_and_field(tmp_path, capsys):
    found = child("default", {(CROWD, "padded", 1024): row(0, 3)})
    found["jobs"][0]["slots"] = "many"
    (tmp_path / "default.json").write_text(json.dumps(found))
    assert read_child(tmp_path / "default.json") is None
    expected = f"warning: {tmp_path / 'default.json'}.jobs[0].slots is str 'many', expected an integer: left out\n"
    assert capsys.readouterr().err == expected
    with pytest.raises(RecordError, match=r"default.json.jobs\[0\].slots is str"):
        ceiling.ChildResults.read(tmp_path / "default.json")


def test_memory_json_reads_back_and_a_bench_stopped_in_its_write_leaves_no_half_of_it(tmp_path, monkeypatch):
    """memory.json was written in place (``write_text``): a bench stopped in its write left half a file."""
    cfg = load_config(["device=cpu", f"bench.out={tmp_path / 'bench.json'}"], announce=None)
    ran = [{"title": "profile padded", "state": "done", "seconds": 1.5, "command": "python -m detector profile"}]
    work = tmp_path / "memory-work" / "current"
    work.mkdir(parents=True)
    (work / "memory.log").write_text("")
    stop_before_rename(monkeypatch, "memory.json")
    with pytest.raises(KeyboardInterrupt):
        finish(cfg, torch.device("cpu"), work, tmp_path, ["padded"], ran)
    (stopped,) = (tmp_path / "memory").iterdir()
    assert not [p.name for p in stopped.iterdir() if "memory.json" in p.name]  # neither half of it nor its temporary
    monkeypatch.undo()
    results = finish(cfg, torch.device("cpu"), work, tmp_path, ["padded"], ran)
    (out,) = set((tmp_path / "memory").iterdir()) - {stopped}
    assert read_json(out / "memory.json", 2**20) == results


def test_bench_memory_writes_its_proof_folder_on_the_cpu(tmp_path):
    # on the CPU whatever the machine holds (device=cpu reaches every child): the CPU's document, "none" where the CPU
    # has no such thing; test_a_real_probe_past_the_devices_memory... is the GPU's own
    tiny = ["device=cpu", "data.batch_size=8", "data.image_size=32", "model.channels=[4,8]", "model.hidden=16"]
    cfg = load_config(tiny + ["bench.strategies=[padded,loop]", f"bench.out={tmp_path / 'bench.json'}"], announce=None)
    results = run_bench(cfg)
    assert [p["state"] for p in results["parts"]] == ["done"] * 4  # two profiles, compare, the default child
    (out,) = (tmp_path / "memory").iterdir()
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    assert set(files) == {"memory.md", "memory.json", "compare.md", "memory-train.png", "runs.tar.gz", "memory.log"}
    assert len(files) <= 8 and max(files.values()) <= 16 * 2**20  # what the GPU proof is copied back under
    text = (out / "memory.md").read_text()
    assert "- **loop** — calc loss: the peak rise" in text  # the verdicts lead with memory
    assert "None: needs a GPU" in text and "| default | crowd file, 1024 slots (fit) | loop | none |" in text
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = tar.getnames()
    assert sum(n.endswith("/summary.json") for n in names) == 2 and not any("trace" in n for n in names)
    assert json.loads((out / "memory.json").read_text())["children"]["default"]["setting"] == "default"
    assert not (tmp_path / "memory-work" / "current").exists()  # finished: renamed after its time


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the ceiling is a device's memory")
def test_a_real_probe_past_the_devices_memory_is_a_result_and_the_next_still_trains():
    tiny = ["data.batch_size=64", "data.image_size=64", "model.channels=[4,8]", "model.hidden=64"]
    cfg = load_config(tiny + ["train.compile=false"], announce=None)
    step = ceiling.TrainStep(cfg, torch.device("cuda"))
    ceiling.use_strategy(step, cfg, "padded")
    prober = ceiling.Prober(step, ceiling.Pool(cfg), cfg)
    assert prober(64).fits
    # 128 MiB more than this process holds: 4096 images need more. A cap on this process's allocator, not ballast
    # on the card, which would starve the GPU tests of the other workers sharing it (make gpu-check's -n 12)
    allowed = torch.cuda.memory_reserved() + 128 * 2**20
    torch.cuda.set_per_process_memory_fraction(allowed / torch.cuda.get_device_properties(0).total_memory)
    try:
        huge = prober(4096)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert not huge.fits and huge.error.startswith("out of memory"), huge
    assert prober(64).fits  # its tensors freed: the search goes on
