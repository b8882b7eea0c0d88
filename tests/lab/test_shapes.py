"""`make shapes` (detector/lab/shapes.py, detector/lab/measure/costs.py): the box-count histogram, the padding and the
images over the slots of a dataset the test writes; the prediction from a bench losses result with known costs, or from
a timing here; the check against profile runs over the same boxes, and where the two disagree."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from annotation_helpers import widerface_counts, write_widerface
from conftest import ROOT
from lab_helpers import (
    BUSY,
    MARKUP_NAME,
    PER_BOX,
    PER_SLOT,
    QUIET,
    SHOWN,
    bench_file,
    edit_summary,
    make_run,
    rendered,
    tables_whole,
)
from omegaconf import OmegaConf

from detector.cli import main as cli
from detector.config.schema import load_config
from detector.lab.measure import costs
from detector.lab.measure.cases import sample_counts
from detector.lab.present.shapes import MEMORY_AGREES, check_lines, memory_lines, prediction_lines, shapes_markdown
from detector.lab.profile import run_profile
from detector.lab.record import bench as bench_record
from detector.lab.record.shapes import (
    Batch,
    Check,
    Cost,
    Costs,
    Memory,
    Over,
    PredictedMemory,
    Prediction,
    ProfiledStep,
    ShapesRecord,
    read_shapes,
)
from detector.lab.record.spread import Spread
from detector.lab.shapes import auto_ranking, histogram, predict, run_shapes

SLOTS, BATCH = 32, 16


@pytest.fixture
def dataset(tmp_path):
    counts = widerface_counts(images=300, seed=5, crowds=3)
    return counts, f"widerface:{write_widerface(tmp_path / 'wider_like.txt', counts, seed=5)}"


def shapes_config(tmp_path, source, *overrides):
    """The CPU pinned: the bench files these tests write are the CPU's, as the runs they check against."""
    return load_config(
        ["device=cpu", "preset=cpu", f"data.boxes={source}", f"data.max_boxes={SLOTS}", f"data.batch_size={BATCH}"]
        + [f"bench.out={tmp_path / 'bench' / 'bench.json'}", f"profile.out_dir={tmp_path / 'runs' / 'profile'}"]
        + list(overrides),
        announce=None,
    )


def test_histogram_bins_split_at_the_slots():
    counts = np.array([0, 0, 1, 2, 3, 5, 9, 33, 40, 600])
    assert histogram(counts, 32) == [
        (0, 0, 2),
        (1, 1, 1),
        (2, 3, 2),
        (4, 7, 1),
        (8, 15, 1),
        (16, 31, 0),
        (32, 32, 0),
        (33, 63, 2),
        (64, 127, 0),
        (128, 255, 0),
        (256, 511, 0),
        (512, 600, 1),
    ]
    assert histogram(np.zeros(4, int), 8) == [(0, 0, 4)]


def test_a_prediction_where_every_strategy_pays_for_the_slots_names_the_next_its_ties_and_padded():
    found = [
        Cost("padded", 2e-3, 0.0, "-"),
        Cost("packed", 1.00e-3, 1e-6, "-"),
        Cost("cuda_conditional", 1.02e-3, 0.0, "-"),
    ]
    predicted = predict(found, slots=1000, boxes=100)  # packed 1.0001 ms, cuda_conditional 1.02, padded 2
    assert predicted.strategy == "packed" and predicted.ties == ["cuda_conditional"]
    assert [n for n, _, _ in predicted.ranking] == ["packed", "cuda_conditional", "padded"]
    assert predicted.reason == (
        "packed pays mostly for the slots: 1.00 µs a slot × 1,000 slots + 0.00100 µs a box × 100 boxes = 1.00 ms; "
        "every strategy pays mostly for the slots here; the next, cuda_conditional: 1.02 µs a slot × 1,000 slots "
        "+ 0 µs a box × 100 boxes = 1.02 ms; padded: 2.00 µs a slot × 1,000 slots + 0 µs a box × 100 boxes = 2.00 ms"
    )
    assert predict([], 1, 1) is None


def test_the_shape_report_of_a_file_and_its_prediction_from_bench_losses(tmp_path, dataset, capsys):
    counts, source = dataset
    path = bench_file(tmp_path)
    report = run_shapes(shapes_config(tmp_path, source))
    kept = np.minimum(counts, SLOTS)
    assert report.images == 300 and report.boxes == counts.sum() and report.max_boxes == SLOTS
    assert sum(n for _, _, n in report.histogram) == 300
    assert report.padding == pytest.approx(1 - kept.sum() / (300 * SLOTS))
    assert (report.over.images, report.over.dropped) == (3, int((counts - kept).sum()))
    assert report.costs.file == str(path) and "cpu, torch 2.13.0" in report.costs.source
    found = {c.strategy: c for c in report.costs.costs}
    for name in PER_SLOT:
        assert found[name].per_slot_ms == pytest.approx(PER_SLOT[name])
        assert found[name].per_box_ms == pytest.approx(PER_BOX[name], abs=1e-12)
    slots, boxes = BATCH * SLOTS, BATCH * kept.mean()
    predicted = report.predicted
    expected = {n: PER_SLOT[n] * slots + PER_BOX[n] * boxes for n in PER_SLOT}
    assert predicted.strategy == min(expected, key=expected.get) == "packed"  # ~90 % of the slots are padding
    assert [n for n, _, _ in predicted.ranking] == ["packed", "padded"]
    assert predicted.reason.startswith("packed pays mostly for the boxes: 0.100 µs a slot × 512 slots + 2.00 µs")
    assert "; the fastest that pays mostly for the slots, padded: 1.00 µs a slot × 512 slots" in predicted.reason
    assert predicted.ties == []
    assert report.auto == (  # the ranking's first that train here, in its order (train/run/auto.py)
        "train.strategy=auto would time packed, padded in the training step (the 2 first of make shapes' prediction "
        f"for widerface-wider_like at batch 16 x 32 slots, from bench losses' {path})"
    )
    out = capsys.readouterr().out
    assert report.auto in out
    assert "**Images over the slots**: 3 (1.00 %) hold more than 32 boxes: data.over_max_boxes=truncate drops" in out
    assert "No profile run over this source at 32 slots, batch 16 on cpu" in out
    (folder,) = (tmp_path / "runs" / "shapes" / "widerface-wider_like").iterdir()
    assert {p.name for p in folder.iterdir()} == {"shapes.md", "shapes.json", "counts.png"}
    assert (folder / "counts.png").read_bytes()[:4] == b"\x89PNG"
    assert read_shapes(folder) == report  # shapes.json holds what the command returned
    assert json.loads((folder / "shapes.json").read_text())["version"] == 2


def test_a_bench_file_of_another_device_is_not_used_and_the_timing_here_says_so(tmp_path, dataset):
    _, source = dataset
    bench_file(tmp_path, device="NVIDIA H100 80GB HBM3")
    report = run_shapes(shapes_config(tmp_path, source, "bench.strategies=[padded,packed]"))
    assert report.costs.file is None
    assert report.costs.source.startswith("timed here on cpu, torch ")
    assert "is of NVIDIA H100 80GB HBM3, and this run is on cpu" in report.costs.source
    assert [c.strategy for c in report.costs.costs] == ["padded", "packed"]
    assert all(c.per_slot_ms > 0 and c.per_box_ms >= 0 for c in report.costs.costs)


def test_a_bench_files_slots_are_those_it_records_or_that_its_cases_tell(tmp_path):
    found, why = costs.from_bench(bench_file(tmp_path, slots=256, batch=1024), "cpu", 1024, 64)
    assert not why and "batch 1024 x 256 slots" in found.source  # at batch 1024 only 256 draws its boxes
    # at batch 64 a tail case of ~one crowd image draws the same boxes at 160, 256 and 406 slots: the run's decide
    path = bench_file(tmp_path, slots=256, batch=64)
    assert "x 256 slots" in costs.from_bench(path, "cpu", 64, 256)[0].source
    assert costs.from_bench(path, "cpu", 64, 64) == (
        None,
        f"{path} does not say its slots; its cases fit 3 slot counts ([160, 256, 406]), not 64",
    )
    recorded = costs.from_bench(bench_file(tmp_path, slots=256, batch=64, record_slots=True), "cpu", 64, 64)[0]
    assert "x 256 slots" in recorded.source


def test_a_bench_result_is_one_record_written_and_read_again(tmp_path):
    path = bench_file(tmp_path)  # version 1: no "version" key, as files were written before the record
    old = bench_record.read(path)
    assert old.target == "losses" and old.version == bench_record.VERSION and old.max_boxes is None
    again = tmp_path / "again.json"
    old.write(again)
    assert bench_record.read(again) == old and json.loads(again.read_text())["version"] == bench_record.VERSION
    assert costs.from_bench(again, "cpu", BATCH, SLOTS)[0].costs == costs.from_bench(path, "cpu", BATCH, SLOTS)[0].costs
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written atomically: no temporary left


def test_a_bench_file_that_cannot_be_used_is_none_and_one_line_naming_the_file_and_field(tmp_path):
    path = bench_file(tmp_path)
    data = json.loads(path.read_text())
    data["results"][1]["valid_boxes"] = -3
    path.write_text(json.dumps(data))
    assert costs.from_bench(path, "cpu", BATCH, SLOTS) == (
        None,
        f"{path}.results[1].valid_boxes is -3, expected an integer in [0, 1e15]",
    )
    path.write_text(json.dumps(data | {"version": 7}))
    refused = f"{path}: version 7, this detector reads versions 1 and 2"
    assert costs.from_bench(path, "cpu", BATCH, SLOTS) == (None, refused)
    path.write_text(json.dumps(data | {"results": [], "device": "NVIDIA H200"}))
    assert costs.from_bench(path, "cpu", BATCH, SLOTS) == (None, f"{path} is of NVIDIA H200, and this run is on cpu")
    path.write_text(json.dumps(data | {"target": "step"}))
    assert costs.from_bench(path, "cpu", BATCH, SLOTS) == (None, f"{path} is not a bench losses result")
    missing = tmp_path / "none.json"
    assert costs.from_bench(missing, "cpu", BATCH, SLOTS) == (None, f"no {missing} (make bench)")


def profiled(root, strategy, stamp, source, scale, slots=SLOTS, batch=BATCH, noise=QUIET):
    """A CPU profile run over ``source``, its steps ``scale`` times the recorded ones."""
    run = make_run(root, strategy, stamp, gpu=False, batch_size=batch, scale=scale, noise=noise)

    def change(summary):
        summary["max_boxes"], summary["data"] = slots, {"boxes": source, "over_max_boxes": "truncate"}

    edit_summary(run, change)
    return run


def test_the_check_against_profiles_over_the_same_boxes(tmp_path, dataset, monkeypatch):
    _, source = dataset
    bench_file(tmp_path)  # predicts packed
    root = tmp_path / "runs" / "profile"
    profiled(root, "padded", "20261122-030000", source, scale=1.0, noise=BUSY)
    profiled(root, "packed", "20261122-030000", source, scale=2.0)  # measured twice as slow: a disagreement
    profiled(root, "packed", "20261122-020000", source, scale=0.5)  # older: not the one read
    profiled(root, "padded", "20261122-040000", "synthetic", scale=9.0)  # newer, but over other boxes
    profiled(root, "cuda_fused", "20261122-030000", source, scale=0.4, slots=64)  # other slots
    monkeypatch.chdir(tmp_path)  # the same file, named by a relative path
    relative = f"widerface:{source.partition(':')[2].removeprefix(str(tmp_path) + '/')}"
    report = run_shapes(shapes_config(tmp_path, relative))
    check = report.measured
    assert set(check.runs) == {"padded", "packed"} and check.fastest == ["padded"]
    assert check.runs["padded"].folder.endswith("padded/20261122-030000")
    assert check.disagreements == [("packed", "padded", pytest.approx(2.0))]
    markdown = next((tmp_path / "runs" / "shapes").rglob("shapes.md")).read_text()
    assert "**The prediction disagrees**: measured fastest padded, predicted packed." in markdown
    assert "- predicted packed faster than padded; measured padded 2× faster" in markdown
    assert "Noisy runs (padded): their times may not hold on a quiet machine." in markdown
    assert "| packed | 202 [201–203] | quiet |" in markdown

    profiled(root, "packed", "20261122-050000", source, scale=0.5)  # a newer packed run: now it agrees
    again = run_shapes(shapes_config(tmp_path, relative))
    assert again.measured.fastest == ["packed"] and again.measured.disagreements == []


def test_the_shapes_command_and_its_make_target(tmp_path, dataset, capsys):
    _, source = dataset
    bench_file(tmp_path)
    args = [
        "shapes",
        source,
        "device=cpu",
        "preset=cpu",
        f"data.max_boxes={SLOTS}",
        f"bench.out={tmp_path / 'bench' / 'x.json'}",
    ]
    assert cli.main(args + [f"profile.out_dir={tmp_path / 'runs' / 'profile'}"]) == 0
    assert "# Shapes of widerface:" in capsys.readouterr().out
    assert cli.main(["shapes", "voc:x.xml", "preset=cpu"]) == 2
    assert "error: data.boxes='voc:x.xml' is out of range: allowed synthetic, coco:" in capsys.readouterr().err
    assert cli.main(["shapes", "preset=cpu", "train.steps=3"]) == 2  # a section shapes does not read
    dry = subprocess.run(["make", "-n", "shapes", f"BOXES={source}", "PY=python3"], cwd=ROOT, capture_output=True)
    assert f"python3 -m detector shapes 'data.boxes={source}'" in dry.stdout.decode()


def test_the_synthetic_faces_have_a_shape_too(tmp_path):
    report = run_shapes(shapes_config(tmp_path, "synthetic", "bench.strategies=[padded]", "data.tail_fraction=0"))
    assert report.images == 20_000 and report.over.images == 0
    assert 1.7 < report.boxes / report.images < 2.1  # floor(|N(0, 3)|): ~1.9 an image
    assert report.predicted.strategy == "padded"


def test_each_strategys_loss_memory_grows_with_what_its_layout_holds():
    """padded allocates for every slot and nothing a box; concat and packed_torch for each box, nearly nothing a slot
    (bytes are counts: the tolerance is a byte a slot for a few scalars, spread over the slots)."""
    counts = sample_counts("tail", BATCH, SLOTS, torch.Generator().manual_seed(BATCH)).numpy()
    found = {
        c.strategy: c
        for c in costs.memory_here(["padded", "concat", "packed_torch"], counts, SLOTS, torch.device("cpu"))
    }
    assert found["padded"].per_slot_bytes > 16 and found["padded"].per_box_bytes == 0  # [B, M] floats, several
    for name in ("concat", "packed_torch"):
        assert found[name].per_slot_bytes < 1 and found[name].per_box_bytes > 16, found[name]
    assert found["padded"].at(2 * BATCH * SLOTS, 0) == pytest.approx(2 * found["padded"].at(BATCH * SLOTS, 0))


def test_the_loss_memory_predicted_from_the_counts_agrees_with_a_profile_over_the_same_boxes(tmp_path, dataset):
    _, source = dataset
    bench_file(tmp_path)
    cfg = shapes_config(tmp_path, source, "bench.strategies=[padded,concat]", "data.num_workers=0")
    tiny = ["model.channels=[4,8]", "model.hidden=16", "data.image_size=32", "profile.timed=0"]
    tiny += ["profile.wait=1", "profile.warmup=1", "profile.active=2", "profile.strategy=padded"]
    run_profile(OmegaConf.merge(cfg, OmegaConf.from_dotlist(tiny)))
    report = run_shapes(cfg)
    rows = {row.strategy: row for row in report.memory.strategies}
    assert rows["concat"].profiled is None  # not profiled over these boxes
    padded = rows["padded"]
    assert 1 / MEMORY_AGREES <= padded.profiled / padded.predicted <= MEMORY_AGREES, padded
    markdown = next((tmp_path / "runs" / "shapes").rglob("shapes.md")).read_text()
    assert f"**The memory prediction** is within {MEMORY_AGREES}× for every one profiled." in markdown


def test_names_from_files_come_out_escaped_in_the_shape_report():
    """A profile's strategy and folder, a bench file's strategy and device, named with a tag and pipes: shown as
    written, as text, in the prediction, the check, the memory and the whole document."""
    spread = Spread(median=10.0, q1=9.9, q3=10.1, min=9.8, max=10.2, n=5)
    report = ShapesRecord(
        source=f"widerface:{MARKUP_NAME}",
        device=f"cpu {MARKUP_NAME}",
        images=10,
        boxes=20,
        max_boxes=SLOTS,
        over_max_boxes="truncate",
        batch_size=BATCH,
        histogram=[(0, 1, 4), (2, 3, 6)],
        padding=0.9,
        over=Over(images=0, dropped=0),
        batch=Batch(slots=BATCH * SLOTS, boxes=32.0),
        costs=Costs(MARKUP_NAME, [Cost(MARKUP_NAME, 1e-3, 0.0, "x"), Cost("padded", 1e-3, 0.0, "x")]),
        predicted=Prediction(
            strategy=MARKUP_NAME,
            ties=["padded"],
            reason=f"{MARKUP_NAME} pays mostly for the slots",
            ranking=[(MARKUP_NAME, 1.0, "slots"), ("padded", 1.01, "slots")],
        ),
        measured=Check(
            profile_dir=f"runs/{MARKUP_NAME}",
            runs={
                MARKUP_NAME: ProfiledStep(spread, f"runs/profile/{MARKUP_NAME}"),
                "padded": ProfiledStep(spread, "runs/profile/padded"),
            },
            noisy={MARKUP_NAME: ["other processes kept 1.9 of 2 cores busy"]},
            fastest=[MARKUP_NAME, "padded"],
            disagreements=[("padded", MARKUP_NAME, 1.5)],
        ),
        memory=Memory(
            [PredictedMemory(MARKUP_NAME, 8.0, 64.0, f"batch of {MARKUP_NAME}", predicted=4096.0, profiled=9000.0)],
            not_measured=[MARKUP_NAME],
        ),
    )
    for lines in (prediction_lines(report), check_lines(report), memory_lines(report)):
        page = rendered("\n".join(lines))
        assert "<script" not in page and tables_whole(page) and SHOWN in page, page
    assert f"measured {SHOWN} 1.5× faster" in rendered("\n".join(check_lines(report)))
    assert f"off by more than {MEMORY_AGREES}× for {SHOWN} (2.20×)" in rendered("\n".join(memory_lines(report)))
    page = rendered(shapes_markdown(report, Path("counts.png")))
    assert "<script" not in page and tables_whole(page) and f"Shapes of widerface:{SHOWN}" in page
    report.measured = Check(profile_dir=f"runs/{MARKUP_NAME}")  # no profile over this source: the command to make one
    page = rendered("\n".join(check_lines(report)))
    assert "<script" not in page and f"<code>make profile STRATEGY={SHOWN} BOXES=widerface:{SHOWN}</code>" in page


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("slow", [False, True])
def test_the_cheap_timing_times_a_strategy_that_is_slow_twice_no_more(monkeypatch, slow, warm):
    calls, real = [], costs.loss_closures

    def counted(strategy, pred, targets):
        forward, forward_backward = real(strategy, pred, targets)
        return forward, lambda: calls.append(1) or forward_backward()

    monkeypatch.setattr(costs, "loss_closures", counted)
    monkeypatch.setattr(costs, "SLOW_MS", 0.0 if slow else float("inf"))
    ms = costs.loss_ms("padded", np.array([3, 0, 5]), 8, torch.device("cpu"), warm=warm)
    assert ms > 0
    # slow: the first call and the second, whose time it is (warm: the first, which compiled nothing); else one call,
    # then the quick timing's warm-up and repeats
    slow_calls = 1 if warm else 2
    assert len(calls) == (slow_calls if slow else 1 + costs.QUICK["warmup"] + costs.QUICK["repeats"])


def test_the_ranking_calls_a_strategy_whole_only_where_its_slice_of_the_batch_is_not_far_behind(monkeypatch):
    """At one shape (auto's ranking), each strategy is called first on a sixteenth of the batch, after a call that may
    compile: one far behind the fastest there (twice) is not called whole, its whole estimated from the slice in
    proportion to the images; one slow slice call alone (a hiccup) ranks no strategy last; the rest are timed whole."""
    calls = []
    sliced = {"padded": [0.2], "loop": [31.0, 33.0], "triton": [0.25], "packed": [40.0, 0.1]}  # packed: a hiccup
    whole = {"padded": 0.3, "triton": 0.35, "packed": 0.15}

    def slice_ms(name, part, slots, device, warmup=1):
        calls.append((name, len(part), warmup))
        return sliced[name].pop(0)

    def loss_ms(name, counts, slots, device, warm=False):
        calls.append((name, len(counts), warm))
        return whole[name]

    monkeypatch.setattr(costs, "slice_ms", slice_ms)
    monkeypatch.setattr(costs, "loss_ms", loss_ms)
    found = costs.at_one_shape(["padded", "loop", "triton", "packed"], np.array([3, 0, 5, 1] * 8), 8, "cpu")
    assert costs.SLICE == 16 and 0.2 * costs.FAR_BEHIND <= min(31, 40)
    assert calls == [
        ("padded", 2, 1), ("loop", 2, 1), ("triton", 2, 1), ("packed", 2, 1),
        ("padded", 32, True), ("loop", 2, 0), ("triton", 32, True), ("packed", 2, 0), ("packed", 32, True),
    ]  # fmt: skip
    assert all(seconds > 0 for _, _, seconds in found.values())  # each strategy's timing, its own seconds
    found = {name: (ms, note) for name, (ms, note, _) in found.items()}
    assert found["padded"] == (0.3, "") and found["triton"] == (0.35, "") and found["packed"] == (0.15, "")
    assert found["loop"] == (
        31.0 * 16,
        " (estimated: 2 of the 32 images took 31.0 ms, 155x the fastest's, so it was not called whole)",
    )


def test_a_slice_is_timed_after_a_call_that_may_compile(monkeypatch):
    """slice_ms: one untimed call (triton's compile, the kernels' loading), then one timed; a real strategy here."""
    calls, real = [], costs.loss_closures

    def counted(strategy, pred, targets):
        forward, forward_backward = real(strategy, pred, targets)
        return forward, lambda: calls.append(1) or forward_backward()

    monkeypatch.setattr(costs, "loss_closures", counted)
    assert costs.slice_ms("padded", np.array([3, 0]), 8, torch.device("cpu")) > 0 and len(calls) == 2
    assert costs.slice_ms("padded", np.array([3, 0]), 8, torch.device("cpu"), warmup=0) > 0 and len(calls) == 3


def test_the_ranking_times_every_strategy_whole_where_the_fastest_slice_took_no_time(monkeypatch):
    """A fastest of 0 ms (a clock too coarse for it) bounds nothing: every strategy is timed whole, and no ratio to it
    is written."""
    monkeypatch.setattr(costs, "slice_ms", lambda name, *_, **__: {"packed": 0.0, "loop": 500.0}[name])
    monkeypatch.setattr(costs, "loss_ms", lambda name, *_, **__: {"packed": 0.1, "loop": 480.0}[name])
    found = costs.at_one_shape(["packed", "loop"], np.array([3, 0, 5, 1] * 8), 8, torch.device("cpu"))
    assert {name: (ms, note) for name, (ms, note, _) in found.items()} == {"packed": (0.1, ""), "loop": (480.0, "")}


def test_auto_s_ranking_times_each_strategy_once_at_the_run_s_shape(tmp_path, dataset, monkeypatch):
    counts, source = dataset
    timed, fake = [], {"padded": 3.0, "packed": 1.0, "concat": 2.0}

    def loss_ms(name, batch, slots, device, warm=False):
        timed.append((name, int(batch.sum())))
        return fake[name]

    monkeypatch.setattr(costs, "loss_ms", loss_ms)
    monkeypatch.setattr(costs, "slice_ms", lambda name, *_, **__: fake[name])
    cfg = shapes_config(tmp_path, source, "bench.strategies=[padded,packed,concat]")
    ranked = auto_ranking(cfg, torch.device("cpu"))
    # no bench file: each strategy timed once, on a batch of the data's counts (no empty batch: the ranking predicts
    # at this shape alone), and ranked by that time
    assert [name for name, _ in timed] == ["padded", "packed", "concat"]
    assert len({boxes for _, boxes in timed}) == 1 and timed[0][1] > 0
    assert ranked.strategies == ["packed", "concat", "padded"]
    assert "from a timing here" in ranked.source
