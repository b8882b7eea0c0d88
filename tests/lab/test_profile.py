"""`make profile`: the training step of a config under torch.profiler, one new folder per run."""

import os
import re
import threading
import time

import pytest
import torch
from conftest import REAL_SAMPLE_SECONDS
from lab_helpers import TINY_PROFILE, make_run

from detector.cli import main as cli
from detector.config.schema import load_config
from detector.data import batches
from detector.data.targets import make_targets
from detector.errors import UserError
from detector.lab import profile as profiling
from detector.lab.compare import run_compare
from detector.lab.measure import cpu_load
from detector.lab.measure.trace import read_events
from detector.lab.present.text import run_card
from detector.lab.record.measures import format_value
from detector.lab.record.run import ProfileRecord, read_summary
from detector.lab.record.spread import Spread
from detector.train.run.speed_options import compile_cache_file
from detector.train.run.step import TrainStep

TINY = TINY_PROFILE
TRAIN_REGIONS = ["data wait", "copy data", "forward", "calc loss", "backward", "optimizer step", "other", "step"]


def profile(tmp_path, *overrides) -> ProfileRecord:
    """`make profile` with ``overrides`` into ``tmp_path`` (and the compiled step's cache, where it compiles, into
    ``tmp_path/train``, as `make train` with train.out_dir there): the record it wrote, read back."""
    folders = [f"profile.out_dir={tmp_path}", f"train.out_dir={tmp_path / 'train'}"]
    cfg = load_config([*TINY, *folders, *overrides], announce=None)
    run_dir, record = cli.profile(cfg)
    assert read_summary(run_dir).to_json() == record.to_json()  # what it wrote is what every reader reads
    return record


def run_dirs(folder):
    return sorted(p for p in folder.iterdir() if p.is_dir())


def test_a_profile_run_gets_its_own_folder_with_the_trace_alone_and_a_summary(tmp_path):
    summary = profile(tmp_path, "profile.strategy=padded")
    (run_dir,) = run_dirs(tmp_path / "padded")
    assert summary.run == run_dir.name and summary.mode == "train"
    (trace,) = (run_dir / "trace").iterdir()  # only the trace: what trace readers expect in the folder
    assert trace.name.endswith(".pt.trace.json.gz") and summary.trace == f"trace/{trace.name}"
    assert list(summary.analysis.regions) == TRAIN_REGIONS
    assert len(summary.per_step) == 2 and summary.analysis.steps == 2
    assert summary.stats("step").median > 0
    launched = summary.stats("step", "launches")
    assert launched.median > 0 if summary.analysis.gpu else launched is None  # a CPU step: no GPU to launch on
    assert summary.median("step", "ops") > 0 and summary.analysis.warnings == []
    assert list(run_dir.glob("events.out.tfevents.*")), "TensorBoard events beside the trace"
    assert (run_dir / "extract.json.gz").is_file()  # the step model the pictures draw
    # the steps timed after the profiler's window, as training runs them
    assert len(summary.timed.wall_ms) == 10 and summary.timed.step_ms.n == 10
    assert summary.sync_regions is False
    # the machine's noise around the run: the others' load (unknown only where /proc cannot be read)
    noise = summary.noise
    assert noise.cores >= 1 and noise.timed_spread == pytest.approx(summary.timed.step_ms.relative_iqr())
    assert all(load is None or load >= 0 for load in (noise.load_before, noise.load_during, noise.load_after))

    again = profile(tmp_path, "profile.strategy=padded")  # a re-run: a new folder, the old one kept
    assert [p.name for p in run_dirs(tmp_path / "padded")] == sorted([summary.run, again.run])


def test_the_profile_times_the_training_step_of_the_same_config(tmp_path):
    summary = profile(tmp_path, "profile.strategy=concat", "train.lr=0.123", "train.grad_clip=0.5")
    names = {e.get("name") for e in read_events(tmp_path / "concat" / summary.run / summary.trace)[1]}
    assert "Optimizer.step#OnePassAdamW.step" in names  # make train's optimizer, not a profiling stand-in
    assert summary.config["train"]["lr"] == 0.123 and summary.config["train"]["strategy"] == "concat"


def test_the_printed_table_names_the_timed_steps_and_what_needs_a_gpu(tmp_path, capsys):
    summary = profile(tmp_path, "profile.strategy=loop", "profile.timed=3")
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("| region |")]
    header, gpu = headers[0], summary.analysis.gpu
    # a GPU's table is wider: split by columns into parts, each repeating the region column (present/text.py)
    assert header.startswith("| region | wall ms |") and any("| operators | slices |" in h for h in headers)
    assert ("| GPU ms |" in header) == gpu  # the device at hand's columns
    assert "As training runs it (no profiler, no regions; 3 steps): step" in out
    assert ("need a GPU" in out) == (not gpu)
    assert "Noise: " in out
    none = profile(tmp_path, "profile.strategy=padded", "profile.timed=0")
    assert none.timed.step_ms.n == 0 and "profile.timed=0" in capsys.readouterr().out


NOTE = r" \(((?:[^()]|\([^()]*\))*)\)"  # a part's note, in parentheses (and those of the note's own)


def parts_of(out: str) -> tuple[float, dict[str, float], str]:
    """The command's last line ``profile 9.1 s: model and optimizer 0.2 s, ..., loader 3 ms, ...``: its total, each part
    in seconds (as printed), and the first step's note."""
    line = next(line for line in out.splitlines() if line.startswith("profile ") and " s: " in line)
    total, listed = re.fullmatch(r"profile ([\d.]+) s: (.*)", line).groups()
    note = re.search(rf"first step [\d.]+ m?s{NOTE}", listed)
    parts = {}
    for part in re.sub(NOTE, "", listed).split(", "):
        name, value, unit = re.fullmatch(r"(.+) ([\d.]+) (s|ms)", part).groups()
        parts[name] = float(value) / (1e3 if unit == "ms" else 1)
    return float(total), parts, note[1] if note else ""


def test_the_load_samples_lie_over_the_models_build_and_the_traces_analysis(tmp_path, capsys, monkeypatch):
    """The machine's load before and after the steps is sampled over windows of at least SAMPLE_SECONDS laid over the
    run's own work, not by waits of their own: where the build and the analysis each take longer than a sample, no
    time goes to sampling, and both loads are still read."""
    monkeypatch.setattr(cpu_load, "SAMPLE_SECONDS", REAL_SAMPLE_SECONDS)
    build, read = profiling.TrainStep, profiling.load_trace

    def slow_build(*args, **kwargs):
        time.sleep(REAL_SAMPLE_SECONDS + 0.1)
        return build(*args, **kwargs)

    def slow_read(*args, **kwargs):
        time.sleep(REAL_SAMPLE_SECONDS + 0.1)
        return read(*args, **kwargs)

    monkeypatch.setattr(profiling, "TrainStep", slow_build)
    monkeypatch.setattr(profiling, "load_trace", slow_read)
    record = profile(tmp_path, "profile.strategy=padded", "device=cpu", "profile.timed=3")
    _, parts, _ = parts_of(capsys.readouterr().out)
    assert "load samples" not in parts and "load samples" not in record.times.seconds
    assert parts["model and optimizer"] >= REAL_SAMPLE_SECONDS and parts["analysed"] >= REAL_SAMPLE_SECONDS
    if os.path.exists("/proc/stat"):
        assert record.noise.load_before is not None and record.noise.load_after is not None


def test_the_last_line_says_where_the_runs_time_went_part_by_part(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cpu_load, "SAMPLE_SECONDS", REAL_SAMPLE_SECONDS)  # the samples' time, as a user's run takes
    started = time.perf_counter()
    record = profile(tmp_path, "profile.strategy=padded", "device=cpu", "profile.timed=3")
    took = time.perf_counter() - started
    out = capsys.readouterr().out
    total, parts, note = parts_of(out)
    # the load's samples lie over the model's build and the trace's analysis: listed only where those were shorter
    assert [part for part in parts if part != "load samples"] == [
        "model and optimizer",
        "loader",
        "first step",
        "3 more steps",
        "profiler stop",
        "trace written",
        "3 timed steps",
        "analysed",
        "TensorBoard events",
    ]  # nothing compiles on the CPU preset: no compile cache, and no note on the first step
    assert note == "" and record.times.compile_cache is None
    # each part as summary.json keeps it (the events aside: written after it), rounded as printed (0.1 s, or 1 ms)
    seconds = record.times.seconds
    for name, kept in seconds.items():
        assert parts[name] == pytest.approx(kept, abs=0.051 if kept >= 0.1 else 5.1e-4), name
    # the parts follow one another: they sum to the printed total (the command's, less the summary's read-back and a
    # few lines of its own: the card, the process group's set-up), a machine's stall between them aside
    events = parts["TensorBoard events"]
    assert total - max(1.0, 0.1 * total) < sum(seconds.values()) + events < total + 0.1 and total <= took + 0.05
    # named truthfully: the steps' parts hold the steps the run printed and timed; the load's two windows of 0.5 s lie
    # over the build and the analysis, the rest of either (where it was shorter) slept as "load samples"
    printed = [float(ms) / 1e3 for ms in re.findall(r"step +\d+/4 \[\w+ *\] +([\d.]+) ms", out)]
    assert len(printed) == 4 and seconds["first step"] >= printed[0] - 1e-4
    assert seconds["3 more steps"] >= sum(printed[1:]) - 3e-4
    assert seconds["3 timed steps"] >= sum(record.timed.wall_ms) / 1e3
    windows = seconds["model and optimizer"] + seconds["analysed"] + seconds.get("load samples", 0.0)
    assert windows >= 2 * REAL_SAMPLE_SECONDS
    assert seconds["trace written"] > 0 and seconds["analysed"] > 0


def wait_for_cache_writes() -> None:
    """Until the compile cache's writer threads (train/run/speed_options.py ``save_compile_cache``) are done."""
    for thread in threading.enumerate():
        if thread.name == "compile-cache":
            thread.join(timeout=60)


def test_a_second_profile_loads_the_compile_cache_the_first_saved_which_is_trainings(tmp_path, capsys):
    """train.compile=true on the CPU: the first profile compiles and saves the compiled step's portable cache into the
    file `make train` of the same configuration reads and writes (train/run/speed_options.py ``compile_cache_file``,
    under train.out_dir); a second profile, as on a fresh machine with runs/ copied, loads it."""
    run = ["profile.strategy=padded", "device=cpu", "train.compile=true", "profile.timed=2"]
    folders = [f"profile.out_dir={tmp_path}", f"train.out_dir={tmp_path / 'train'}"]
    trained = load_config([*TINY, *folders, *run, "train.strategy=padded"], announce=None)  # as `make train` has it
    cache = compile_cache_file(trained, torch.device("cpu"), 1)

    first = profile(tmp_path, *run)
    out = capsys.readouterr().out
    assert "  compiling: step 1 waits for torch.compile" in out and f"compile cache {cache}:" not in out
    assert first.times.compile_cache == "compiled; its cache saved for the next run"
    wait_for_cache_writes()
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # training's file, and no other

    second = profile(tmp_path, *run)
    out = capsys.readouterr().out
    loaded = re.search(rf"  compile cache {re.escape(str(cache))}: (\d+ MiB loaded \(\d+ inductor.*\))\n", out)
    assert loaded, out
    assert second.times.compile_cache == f"compile cache {loaded[1]}" and parts_of(out)[2] == second.times.compile_cache
    assert "compile cache" in second.times.seconds  # its load and save, a part of their own


def test_a_forward_profile_keeps_a_compile_cache_of_its_own():
    """MODE=forward compiles the forward alone, without gradients: saved under training's name, it would replace the
    graphs a training run (or a profile of its step) needs."""
    cfg = load_config([*TINY, "train.compile=true", "device=cpu"], announce=None)
    cpu = torch.device("cpu")
    trained, forward = compile_cache_file(cfg, cpu, 1), compile_cache_file(cfg, cpu, 1, "forward")
    assert trained.parent == forward.parent and trained.name.startswith("padded-") and trained != forward
    assert forward.name.startswith("padded-forward-")


def slowed(monkeypatch, owner, name: str, seconds: float) -> None:
    """``owner.name`` takes ``seconds`` longer each call."""
    function = getattr(owner, name)

    def slow(*args):
        time.sleep(seconds)
        return function(*args)

    monkeypatch.setattr(owner, name, slow)


def test_a_starved_loader_is_flagged_in_the_card_and_compare_does_not_judge_its_time(tmp_path, monkeypatch, capsys):
    """On the CPU, whatever the machine holds: the host is the device, so the data wait alone flags the run (a GPU
    run's flag also needs the device idle as long: test_a_gpu_run_is_loader_paced_only_where_the_device_idled)."""
    # fed: a worker far ahead of a step of 200 ms (the tiny step's own few ms are near the loader's cost per batch,
    # which a machine busy with the rest of the suite stretches)
    slowed(monkeypatch, TrainStep, "__call__", 0.2)
    run = ["device=cpu", "profile.wait=1", "profile.warmup=1", "profile.active=5", "profile.timed=3"]
    fed = profile(tmp_path, *run, "profile.strategy=packed", "data.num_workers=1")
    out = capsys.readouterr().out
    assert fed.loader_paced() is None, fed.loader_paced()
    assert "Loader-paced" not in out
    assert (fed.loader_fill.workers, fed.loader_fill.waiting, fed.loader_fill.room) == (1, 4, 4)
    assert re.search(r"Loader \(data.num_workers=1\): the ring was full, 4 of 4 batches waiting, [\d.]+ s after", out)

    monkeypatch.undo()
    slowed(monkeypatch, batches, "draw_dataset_batch", 0.2)  # starved: 0 workers, each step draws its batch, 200 ms
    starved = profile(tmp_path, *run, "profile.strategy=padded")
    out = capsys.readouterr().out
    assert starved.loader_paced().startswith("data wait ")
    assert re.search(r"\*\*Loader-paced\*\*: data wait \d+ ms, \d+ % of the step: the loader, not the step", out)
    assert "Loader: each batch is drawn in its step (data.num_workers=0), nothing is drawn ahead." in out

    monkeypatch.undo()
    text = run_compare(tmp_path, out_dir=tmp_path / "compared").texts["train"]
    verdict = next(line for line in text.splitlines() if line.startswith("- **packed**"))
    assert "Times as training runs it not judged: padded's run is loader-paced (data wait " in verdict
    assert "packed's is not: the loader, not the loss, set its time" in verdict and "faster" not in verdict
    assert re.search(r"\*\*Loader-paced runs\*\* .*: padded: loader-paced: data wait \d+ ms, \d+ % of the step", text)
    assert re.search(r"\| \*\*step, as training runs it\*\* \| [^|]+ \| [^|]+ · not judged \|", text)


def test_a_gpu_run_is_loader_paced_only_where_the_device_idled(tmp_path):
    """A recorded GPU run whose step waited 40 % of its time for its batch: loader-paced where the GPU idled as long
    (the card names both), not where the device stayed busy meanwhile (the host ran ahead)."""
    record = read_summary(make_run(tmp_path, "padded", "20261122-100000"))
    step = record.stats("step").median
    record.analysis.regions["data wait"]["wall_ms"] = Spread.of([0.4 * step] * 3)
    record.analysis.regions["step"]["gpu_idle_share"] = Spread.of([0.35] * 3)
    assert (
        record.loader_paced() == f"data wait {format_value('wall_ms', 0.4 * step)} ms, 40 % of the step; GPU idle 35 %"
    )
    assert "**Loader-paced**: data wait" in run_card(
        record
    ) and "; GPU idle 35 %: the loader, not the step" in run_card(record)
    record.analysis.regions["step"]["gpu_idle_share"] = Spread.of([0.01] * 3)
    assert record.loader_paced() is None and "Loader-paced" not in run_card(record)


def test_forward_mode_keeps_the_articles_protocol(tmp_path):
    summary = profile(tmp_path, "profile.strategy=padded", "profile.mode=forward")
    assert list(summary.analysis.regions) == ["data wait", "copy data", "forward", "calc loss", "other", "step"]
    assert run_dirs(tmp_path / "padded-forward")


def test_a_failed_run_removes_only_its_own_folder(tmp_path, monkeypatch):
    first = profile(tmp_path, "profile.strategy=padded", "device=cpu")

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(profiling, "profile_steps", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        profile(tmp_path, "profile.strategy=padded", "device=cpu")
    assert [p.name for p in run_dirs(tmp_path / "padded")] == [first.run]


def test_bad_mode_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match="profile.mode='backward' is out of range: allowed one of train, forward"):
        profile(tmp_path, "profile.mode=backward")
    assert not (tmp_path / "padded").exists()


def test_sync_regions_only_labels_the_synchronize_on_a_gpu():
    cfg = load_config([*TINY, "profile.sync_regions=true"], announce=None)
    assert TrainStep(cfg, torch.device("cpu")).regions.sync is False  # nothing to wait for on the CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sync_regions_end_each_region_in_a_labelled_synchronize(tmp_path):
    synced = profile(tmp_path, "profile.strategy=padded", "profile.sync_regions=true", "device=cuda")
    free = profile(tmp_path, "profile.strategy=padded", "device=cuda")
    assert synced.sync_regions is True and free.sync_regions is False
    assert synced.median("step", "sync_wait_ms") > 0 and free.median("step", "sync_wait_ms") == 0
    # the lab's wait is measured on its own: the syncs counted are the step's own (the loader's), as without it
    assert synced.median("step", "syncs") == free.median("step", "syncs")


def test_regions_cost_nothing_when_inactive():
    cfg = load_config(TINY, announce=None)
    step = TrainStep(cfg, torch.device("cpu"))
    batch = (torch.zeros(4, 1, 32, 32, dtype=torch.uint8), make_targets([torch.zeros(0, 4)] * 4, "padded", 64))
    with torch.profiler.profile() as prof:
        step(batch)
        step.regions.active = True
        step(batch)
    names = [e.name for e in prof.events()]
    assert names.count("forward") == 1 and names.count("optimizer step") == 1  # the inactive step marked none
