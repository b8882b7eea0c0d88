"""``detector.bench.run(cfg, target)`` on the CPU: the losses target, GPU-only targets, unknown targets."""

import dataclasses
import json

import pytest
import torch

from detector import bench
from detector.bench import losses
from detector.config.schema import load_config
from detector.lab.measure.timing import Stats
from detector.lab.record import bench as bench_record
from detector.lab.record.spread import Spread
from detector.losses import STRATEGIES


def bench_config(tmp_path, *overrides):
    base = [
        "device=cpu",
        "preset=cpu",
        "data.max_boxes=16",
        "bench.warmup=1",
        "bench.repeats=3",
        f"bench.out={tmp_path}/bench.json",
    ]
    return load_config(base + list(overrides), announce=None)


def test_losses_writes_medians_with_spreads(tmp_path, capsys):
    cfg = bench_config(
        tmp_path, "bench.batch_sizes=[8]", "bench.distributions=[seed]", "bench.strategies=[padded,concat]"
    )
    records = bench.run(cfg, "losses")
    assert [r["strategy"] for r in records] == ["padded", "concat"]
    saved = json.loads((tmp_path / "losses.json").read_text())
    assert saved["device"] == "cpu" and saved["torch"] == torch.__version__ and saved["target"] == "losses"
    assert saved["config"]["strategies"] == ["padded", "concat"] and saved["config"]["repeats"] == 3
    for r in saved["results"]:
        for key in ("forward_ms", "forward_backward_ms"):
            t = r[key]
            assert 0 < t["low"] <= t["median"] <= t["high"] and t["n"] == 3
        assert r["graph_forward_backward_ms"] is None  # no CUDA graphs on the CPU
    out = capsys.readouterr().out
    assert "| strategy | batch | boxes | valid | fwd ms |" in out and "| padded | 8 | seed |" in out
    assert "[" in out.split("| padded | 8 | seed |")[1].splitlines()[0]  # a spread beside the median


def test_losses_times_every_registered_strategy(tmp_path):
    cfg = bench_config(tmp_path, "bench.batch_sizes=[3]", "bench.distributions=[seed,zero]")
    records = bench.run(cfg, "losses")
    runnable = {name for name, s in STRATEGIES.items() if not s.unavailable(torch.device("cpu"))}
    assert {r["strategy"] for r in records} == runnable
    assert all(r["forward_ms"].median > 0 and r["forward_backward_ms"].median > 0 for r in records)
    assert len(json.loads((tmp_path / "losses.json").read_text())["results"]) == len(records)


@pytest.mark.parametrize("target", ["kernels", "layers", "blocks"])
def test_gpu_only_targets_say_so_in_one_line_on_the_cpu(tmp_path, capsys, target):
    assert bench.run(bench_config(tmp_path), target) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"bench {target}: needs a CUDA device" in out
    assert not list(tmp_path.iterdir())


def test_unknown_target_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown bench target 'kernel'; valid targets: losses, kernels, layers"):
        bench.run(bench_config(tmp_path), "kernel")
    assert issubclass(bench.UnknownTargetError, ValueError)


def test_step_times_the_configs_training_step_and_the_data_pipeline(tmp_path, capsys):
    tiny = ["data.batch_size=4", "data.image_size=32", "model.channels=[4,8]", "model.hidden=16"]
    results = bench.run(bench_config(tmp_path, *tiny, "bench.max_seconds=1"), "step")
    assert list(results["steps"]) == ["config"]  # the speed-option variants and the floor are a GPU's
    pieces = results["steps"]["config"]
    assert list(pieces) == ["step", "forward", "forward+backward", "optimizer"]
    assert all(s.median > 0 for s in pieces.values()) and results["floor"] is None
    assert results["data_images_per_s"] > 0 and results["sampler_images_per_s"] > 0
    out = capsys.readouterr().out
    assert "| config | step |" in out and "images/s drawn" in out
    assert json.loads((tmp_path / "step.json").read_text())["target"] == "step"


def record(strategy, batch, fwd_bwd, graph=None, distribution="seed"):
    """A bench losses record with a spread of +-5 % around each median."""
    spread = lambda m: m and Stats(m, m * 0.95, m * 1.05, 10)  # noqa: E731
    return {
        "strategy": strategy,
        "batch_size": batch,
        "distribution": distribution,
        "forward_backward_ms": spread(fwd_bwd),
        "graph_forward_backward_ms": spread(graph),
    }


def test_which_strategy_names_the_fastest_per_situation_and_what_the_newcomers_cost():
    records = [
        record("padded", 1024, 2.5, graph=1.0),
        record("cuda_conditional", 1024, 0.16, graph=0.05),
        record("packed", 1024, 0.162, graph=0.2),  # within cuda_conditional's spread eager, not in a graph
        record("torchvision", 1024, 4.0),
        record("nested", 1024, 8.0),
        record("compiled", 1024, 0.5, graph=0.3),
        record("nested_compiled", 1024, 1.5, graph=0.6),
        record("padded", 1024, 0.01, distribution="tail"),  # another distribution: not in the table
    ]
    rows = {line.split("|")[1].strip(): line for line in losses.which(records).splitlines()[2:]}
    assert list(rows) == ["eager, batch 1024", "one CUDA graph, batch 1024", "torch.compile'd, batch 1024"]
    eager = [c.strip() for c in rows["eager, batch 1024"].split("|")[1:-1]]
    assert eager[1] == "cuda_conditional (≈ packed)" and eager[2].startswith("0.160 [")
    assert eager[3] == "torchvision: 25× the time" and eager[4] == "nested: 50× the time"
    graph = [c.strip() for c in rows["one CUDA graph, batch 1024"].split("|")[1:-1]]
    assert graph[1] == "cuda_conditional" and graph[3] == "its CUDA-graph capture failed (the log says why)"
    compiled = [c.strip() for c in rows["torch.compile'd, batch 1024"].split("|")[1:-1]]
    assert compiled[1] == "compiled" and compiled[4] == "nested_compiled: 3× the time"
    records.append(record("nested_compiled", 2048, 0.4))
    records.append(record("compiled", 2048, 0.9))
    rows = {line.split("|")[1].strip(): line for line in losses.which(records).splitlines()[2:]}
    assert "| nested_compiled is the fastest |" in rows["torch.compile'd, batch 2048"]
    gone = [r for r in records if not r["strategy"].startswith("torchvision")]
    reasons = {"torchvision": "it is not installed", "torchvision_padded": "it is not installed"}
    assert "| unavailable here: it is not installed |" in losses.which(gone, reasons).splitlines()[2]


def test_blocks_sweep_skips_configurations_that_fail_and_restores_the_one_in_use():
    from detector.bench import blocks
    from detector.model import conv_pool_kernel

    in_use = dict(conv_pool_kernel.CONFIGS)

    def call():  # stands in for a kernel launch: the widest blocks "run out of registers"
        if conv_pool_kernel.CONFIGS["dgrad"][0] == 256:
            raise RuntimeError("out of resources: registers")

    cfg = load_config(["device=cpu", "bench.warmup=0", "bench.repeats=2"], announce=None)
    times = blocks.sweep(call, conv_pool_kernel, "dgrad", cfg, torch.device("cpu"))
    assert sorted(times) == [(b, w) for b in (32, 64, 128) for w in blocks.WARPS]
    assert conv_pool_kernel.CONFIGS == in_use


def test_blocks_picks_the_fastest_configuration_and_program_count_and_times_the_step_with_them(
    tmp_path, monkeypatch, capsys
):
    """run_bench's choices on the CPU with a stand-in timer: the kernels' times are a function of the settings
    in force when timed, fastest at (64, 4) and, for a kernel whose programs loop (its module's PROGRAMS), at
    4096 programs; the step marked "fastest" runs with both, and the settings in use come back afterwards."""
    from detector.bench import blocks
    from detector.model import conv_pool_kernel, stem_kernel

    saved = {m: (dict(m.CONFIGS), dict(m.PROGRAMS)) for m in (conv_pool_kernel, stem_kernel)}
    kernels = [(stem_kernel, "backward"), (conv_pool_kernel, "dgrad")]
    monkeypatch.setattr(blocks.bench, "gpu_device", lambda cfg, target, unavailable: torch.device("cpu"))
    monkeypatch.setattr(blocks, "calls", lambda cfg, device: {k: k for k in kernels})
    monkeypatch.setattr(blocks, "device_batch", lambda cfg, strategy, device: None)

    def event_ms(key, device, **budget):
        module, kernel = key
        block, warps = module.CONFIGS[kernel]
        ms = 1 + abs(block - 64) / 64 + abs(warps - 4) / 4 + abs(module.PROGRAMS.get(kernel, 4096) - 4096) / 4096
        return Stats(ms, ms, ms, 3)

    steps = []

    def step_stats(cfg, device, batch, pieces):
        steps.append({m.__name__: (dict(m.CONFIGS), dict(m.PROGRAMS)) for m in (conv_pool_kernel, stem_kernel)})
        return {"step": Stats(10.0, 10.0, 10.0, 3)}

    monkeypatch.setattr(blocks, "event_ms", event_ms)
    monkeypatch.setattr(blocks, "step_stats", step_stats)
    results = blocks.run_bench(bench_config(tmp_path))
    stem = results["kernels"]["stem_kernel.backward"]
    assert stem["fastest"] == (64, 4) and stem["programs"]["fastest"] == 4096
    assert set(stem["programs"]["ms"]) == {str(n) for n in blocks.PROGRAM_COUNTS}
    dgrad = results["kernels"]["conv_pool_kernel.dgrad"]
    assert dgrad["fastest"] == (64, 4) and "programs" not in dgrad  # one program a block: nothing to sweep
    in_use, fastest = steps
    assert in_use["detector.model.stem_kernel"] == saved[stem_kernel]
    assert fastest["detector.model.stem_kernel"][0]["backward"] == (64, 4)
    assert fastest["detector.model.stem_kernel"][1]["backward"] == 4096
    assert fastest["detector.model.conv_pool_kernel"][0]["dgrad"] == (64, 4)
    assert {m: (m.CONFIGS, m.PROGRAMS) for m in saved} == saved
    out = capsys.readouterr().out
    in_use_cell = f"{saved[stem_kernel][0]['backward']}, {saved[stem_kernel][1]['backward']} programs"
    assert f"| stem_kernel.backward | {in_use_cell} |" in out and "| (64, 4), 4096 programs | 1.00 [" in out


def test_blocks_keeps_the_program_count_in_use_when_no_other_count_timed_faster(tmp_path, monkeypatch):
    """The program count does not matter and the clock drifts up as the sweep goes on: every count timed after
    the configurations is slower than the configuration sweep's own time of the count in use, so that count
    stays the fastest (no count is called faster than the one in use for being timed later)."""
    from detector.bench import blocks
    from detector.model import stem_kernel

    in_use = stem_kernel.PROGRAMS["backward"]
    monkeypatch.setattr(blocks.bench, "gpu_device", lambda cfg, target, unavailable: torch.device("cpu"))
    monkeypatch.setattr(blocks, "calls", lambda cfg, device: {(stem_kernel, "backward"): None})
    monkeypatch.setattr(blocks, "device_batch", lambda cfg, strategy, device: None)
    monkeypatch.setattr(blocks, "step_stats", lambda cfg, device, batch, pieces: {"step": Stats(10.0, 10.0, 10.0, 3)})
    timed = []

    def event_ms(call, device, **budget):
        block, warps = stem_kernel.CONFIGS["backward"]
        timed.append(stem_kernel.PROGRAMS["backward"])
        ms = 1 + abs(block - 64) / 64 + abs(warps - 4) / 4 + 0.01 * len(timed)
        return Stats(ms, ms, ms, 3)

    monkeypatch.setattr(blocks, "event_ms", event_ms)
    stem = blocks.run_bench(bench_config(tmp_path))["kernels"]["stem_kernel.backward"]
    assert set(timed[len(blocks.BLOCKS) * len(blocks.WARPS) :]) == set(blocks.PROGRAM_COUNTS)  # they were timed
    assert stem["fastest"] == (64, 4) and stem["programs"]["fastest"] == in_use
    assert stem["programs"]["ms"][str(in_use)].median < min(
        t.median for n, t in stem["programs"]["ms"].items() if n != str(in_use)
    )


def test_losses_stops_timing_a_strategy_past_max_call_ms(tmp_path, capsys):
    cfg = bench_config(
        tmp_path,
        "bench.batch_sizes=[16,2]",
        "bench.distributions=[seed]",
        "bench.strategies=[loop,padded]",
        "bench.max_call_ms=0.000001",  # every call is slower: each strategy is timed at the smallest batch only
    )
    records = bench.run(cfg, "losses")
    assert [(r["strategy"], r["batch_size"]) for r in records] == [("loop", 2), ("padded", 2)]
    out = capsys.readouterr().out
    assert "loop              batch 16     seed   not timed:" in out and "over bench.max_call_ms=1e-06" in out


def test_a_bench_result_writes_dataclasses_as_objects():
    @dataclasses.dataclass
    class Timed:
        median: float
        n: int

    text = json.dumps({"t": Timed(1.0, 3), "s": Spread(1.0, 0.5, 2.0)}, default=bench_record.plain)
    assert json.loads(text) == {
        "t": {"median": 1.0, "n": 3},
        "s": {"median": 1.0, "q1": 0.5, "q3": 2.0, "min": None, "max": None, "n": 0},
    }


@pytest.mark.slow
def test_startup_sets_trains_start_up_beside_torchs_floor_each_a_fresh_process(tmp_path, capsys):
    """bench startup: `train`'s start-up parts and first step beside the floor's (torch, the step's code, the step
    built, its compile cache, one step), each in a process of its own; --help answers without importing torch."""
    tiny = ["data.batch_size=4", "data.image_size=32", "model.channels=[4,8]", "model.hidden=16", "data.num_workers=0"]
    results = bench.run(bench_config(tmp_path, *tiny, "bench.repeats=1"), "startup")
    floor, train = results["floor"], results["train"]
    assert set(floor) == {
        "import torch",
        "import the step's code",
        "build the step",
        "load the compile cache",
        "first step",
        "total",
    }
    assert all(floor[part]["n"] == 1 and floor[part]["median"] >= 0 for part in floor)
    assert floor["total"]["median"] == pytest.approx(sum(floor[p]["median"] for p in floor if p != "total"))
    assert {"interpreter and imports", "configuration", "model and optimizer", "first step", "total"} <= set(train)
    assert results["help_s"]["median"] < results["import_torch_s"]["median"]  # the grammar alone
    out = capsys.readouterr().out
    assert "`train` adds **" in out and "### The floor's parts" in out
    assert json.loads((tmp_path / "startup.json").read_text())["target"] == "startup"
    assert not list(tmp_path.rglob("summary.json"))  # the runs' folders went with the bench's temporary one
