"""train.strategy=auto (detector/train/run/auto.py, choice.py): the candidates timed in the training step, the choice
and its line, the record in summary.json, the run folder, the kept file and TensorBoard, the kept choice taken at once,
a resume that keeps the strategy, the rule where the spreads overlap, and the one-line errors; on the tiny CPU
detector of the training tests (milliseconds a step)."""

import json
import re

import pytest
import torch
from lab_helpers import bench_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_helpers import TINY, tiny_cfg

from detector.cli import main as cli
from detector.errors import UserError
from detector.losses import STRATEGIES, Strategy
from detector.train import choice
from detector.train.choice import FASTER, MEDIAN, SMALLER, Candidate, Choice
from detector.train.observe import summary
from detector.train.run import auto
from detector.train.run.auto import Ranking
from detector.train.run.entry import run_training

# on the CPU on every machine: the times, the memory and the lines the tests read are the CPU's (a GPU's are
# another test's to read)
AUTO = ["device=cpu", "train.strategy=auto", "train.steps=4", "train.auto_candidates=[padded,packed]"]
MIB = 2**20


@pytest.fixture
def timings(monkeypatch):
    """{strategy: (its timed steps' ms, its peak rise)} the test sets: the candidates' steps still run in the training
    step, their times and memory are the test's (a CPU keeps no peak, and a loaded one's times order nothing)."""
    chosen, real = {}, auto.time_candidate

    def set_by_the_test(step, batches, count, device):
        measured = real(step, batches, count, device)
        assert len(measured[0]) == count  # the steps ran
        return chosen.get(step.strategy.name, measured)

    monkeypatch.setattr(auto, "time_candidate", set_by_the_test)
    return chosen


@pytest.fixture
def odd(monkeypatch):
    """Strategies of the test's: one that cannot run on the CPU, one that raises, one that computes another loss."""
    padded = STRATEGIES["padded"]

    def raising(pred, targets):
        raise RuntimeError("no kernel image for this device")

    def doubled(pred, targets):
        return 2 * padded.fn(pred, targets)

    gpu_only = Strategy("gpu_only", "padded", padded.fn, "a GPU's", unavailable=lambda d: "it needs a GPU")
    for strategy in (
        gpu_only,
        Strategy("raising", "padded", raising, "raises"),
        Strategy("doubled", "padded", doubled, "2x"),
    ):
        monkeypatch.setitem(STRATEGIES, strategy.name, strategy)


def start_line(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("strategy auto: ") and " timing " not in line]
    return line


# ----------------------------------------------------------------------------- the choice


def test_auto_times_its_candidates_in_the_step_and_trains_as_a_run_of_the_fastest(tmp_path, timings, capsys):
    timings |= {"padded": ([5.0, 5.1, 5.2], None), "packed": ([2.0, 2.1, 2.2], None)}
    result = run_training(tiny_cfg(tmp_path / "auto", *AUTO))[0]
    out = capsys.readouterr().out
    assert "strategy auto: timing padded, packed in the training step, 2 warm-up and 3 timed steps each " in out
    assert re.fullmatch(
        r"strategy auto: packed — 2.1 \[2.05–2.15\] ms a step against padded 5.1 \[5.05–5.15\]; 3 timed steps each "
        r"\(fewer: a short run\); chosen in \d+\.\d s: \d+\.\d s the step's first call \(its compile, which a run "
        r"pays anyway\), \d+\.\d s timing",
        start_line(out),
    ), start_line(out)
    assert out.index("strategy auto: packed") < out.index("training auto ")  # said before the run starts
    assert (result.strategy, result.run) == ("packed", "auto")
    made = result.auto
    assert (made.strategy, made.rule, made.source, made.ranking) == (
        "packed",
        FASTER,
        "measured",
        "train.auto_candidates",
    )
    assert [(c.strategy, c.step_ms) for c in made.candidates] == [
        ("padded", [5.0, 5.1, 5.2]),
        ("packed", [2.0, 2.1, 2.2]),
    ]
    assert (made.timed_steps, made.warm_steps, made.short_run, made.device) == (3, 2, True, "cpu")
    # the run builds its own step from the seed: it trains as a run of the chosen strategy does
    named = run_training(tiny_cfg(tmp_path / "named", AUTO[0], "train.strategy=packed", "train.steps=4"))[0]
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(named.losses), rtol=1e-6, atol=0)
    assert named.auto is None


def test_the_choice_is_in_the_summary_the_run_folder_the_kept_file_and_tensorboard(tmp_path, timings):
    timings |= {"padded": ([5.0, 5.1, 5.2], None), "packed": ([2.0, 2.1, 2.2], None)}
    made = run_training(tiny_cfg(tmp_path, *AUTO))[0].auto
    run = tmp_path / "default" / "auto"
    assert summary.read(run).auto == made
    assert choice.read(run / choice.RUN_FILE) == made
    (kept,) = (tmp_path / auto.KEPT_FOLDER).iterdir()
    assert choice.read(kept) == made
    events = EventAccumulator(str(run), size_guidance={"tensors": 0}).Reload()
    (text,) = events.Tensors("strategy auto/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "| **packed** (chosen) | 2.1 | 2.05–2.15 | 2–2.2 | 3 | not measured |" in table
    assert "| padded | 5.1 | 5.05–5.15 | 5–5.2 | 3 | not measured |" in table
    assert made.line() in table
    # a summary of before the field, or with a damaged choice, is still read
    data = json.loads((run / summary.SUMMARY).read_text())
    (run / summary.SUMMARY).write_text(json.dumps({k: v for k, v in data.items() if k != "auto"}))
    assert summary.read(run).auto is None
    data["auto"]["candidates"][0]["step_ms"][0] = -1.0
    (run / summary.SUMMARY).write_text(json.dumps(data))
    damaged = summary.read(run)
    assert damaged.auto is None and damaged.left_out == [
        f"{run / summary.SUMMARY}: auto.candidates[0].step_ms[0] is -1.0, expected a finite number in [0, 1e15]: auto "
        "left out"
    ]


def test_a_second_run_of_the_same_settings_takes_the_kept_choice_at_once(tmp_path, timings, monkeypatch, capsys):
    timings |= {"padded": ([5.0, 5.1, 5.2], None), "packed": ([2.0, 2.1, 2.2], None)}
    first = run_training(tiny_cfg(tmp_path, *AUTO))[0].auto
    kept = auto.kept_file(tiny_cfg(tmp_path, *AUTO), torch.device("cpu"), 1)
    capsys.readouterr()

    def times_nothing(*args):
        raise AssertionError("a kept choice times no candidate")

    monkeypatch.setattr(auto, "measure", times_nothing)
    again = run_training(tiny_cfg(tmp_path, *AUTO, "train.steps=6"))[0]  # a longer run of the same settings
    line = start_line(capsys.readouterr().out)
    assert (
        line == f"strategy auto: packed, kept for these settings in {kept} (delete it to measure again): {first.why()}"
    )
    assert (again.strategy, again.auto.source, again.auto.file) == ("packed", "kept", str(kept))
    assert again.auto.candidates == first.candidates
    # other settings are another file: the boxes, the model, the candidates asked for
    for other in ("data.max_boxes=8", "model.hidden=16", "train.auto_candidates=[packed,padded,concat]"):
        assert auto.kept_file(tiny_cfg(tmp_path, *AUTO, other), torch.device("cpu"), 1) != kept, other
    assert auto.kept_file(tiny_cfg(tmp_path, *AUTO, "train.log_every=2"), torch.device("cpu"), 1) == kept


def test_a_resumed_auto_run_continues_with_the_strategy_it_chose(tmp_path, timings, capsys):
    timings |= {"padded": ([5.0, 5.1, 5.2], None), "packed": ([2.0, 2.1, 2.2], None)}
    run_training(tiny_cfg(tmp_path, *AUTO, "train.stop_after=2", "train.checkpoint_every=2"))
    for kept in (tmp_path / auto.KEPT_FOLDER).iterdir():
        kept.unlink()  # no kept choice: only the checkpoint says packed
    timings |= {"padded": ([1.0, 1.1, 1.2], None)}  # padded would be chosen now
    capsys.readouterr()
    result = run_training(tiny_cfg(tmp_path, *AUTO))[0]
    assert start_line(capsys.readouterr().out) == (
        "strategy auto: packed, as this run chose at its start (its checkpoint at step 2)"
    )
    assert (result.strategy, result.resumed_at, result.steps) == ("packed", 2, 4)
    assert (result.auto.source, result.auto.resumed_at) == ("resumed", 2)
    assert [c.step_ms for c in result.auto.candidates] == [[5.0, 5.1, 5.2], [2.0, 2.1, 2.2]]  # its measure
    fresh = run_training(tiny_cfg(tmp_path, *AUTO, "train.resume=false"))[0]
    assert (fresh.strategy, fresh.auto.source) == ("padded", "measured")


def test_where_the_spreads_overlap_the_smaller_peak_memory_trains_and_the_line_says_why(tmp_path, timings, capsys):
    timings |= {"padded": ([2.0, 2.1, 2.3], 4 * MIB), "packed": ([2.1, 2.2, 2.4], MIB)}
    result = run_training(tiny_cfg(tmp_path, *AUTO))[0]
    assert (result.strategy, result.auto.rule) == ("packed", SMALLER)  # its median is the slower one
    assert start_line(capsys.readouterr().out).startswith(
        "strategy auto: packed — 2.2 [2.15–2.3] ms a step, not distinguishable from padded 2.1 [2.05–2.2] (the "
        "[q1–q3] overlap): the step's peak memory rise 4× smaller (1 MiB against padded's 4 MiB); 3 timed steps each"
    )


def rows(**times: tuple[list[float], int | None]) -> list[Candidate]:
    return [Candidate(name, ms, peak) for name, (ms, peak) in times.items()]


def test_the_rule_of_the_choice():
    # apart: the faster trains, whatever its memory
    assert choice.decide(rows(padded=([1, 1, 1], 4 * MIB), packed=([2, 2, 2], MIB))) == ("padded", FASTER)
    # overlapping, memory measured: the smaller peak among those tied with the fastest (concat is apart: slower)
    tied = rows(padded=([1, 1.1, 1.3], 4 * MIB), packed=([1.1, 1.2, 1.4], 2 * MIB), concat=([3, 3, 3], MIB))
    assert choice.decide(tied) == ("packed", SMALLER)
    # overlapping, as little memory in two: the faster median of those two
    alike = rows(padded=([1, 1.1, 1.3], 2 * MIB), packed=([1.1, 1.2, 1.4], 2 * MIB), concat=([1, 1.15, 1.3], 4 * MIB))
    assert choice.decide(alike) == ("padded", MEDIAN)
    assert choice.reason(alike, "padded", MEDIAN, "cpu") == (
        "padded — 1.1 [1.05–1.2] ms a step, not distinguishable from packed 1.2 [1.15–1.3], concat 1.15 [1.07–1.23] "
        "(the [q1–q3] overlap): the faster median, of those whose step's peak memory rise is least (2 MiB)"
    )
    # overlapping, peaks within MEMORY_ALIKE of the least (the step's activations dwarf the loss's): as little
    close = rows(padded=([1, 1.1, 1.3], 5000 * MIB), packed=([1.1, 1.2, 1.4], 4990 * MIB))
    assert choice.decide(close) == ("padded", MEDIAN)
    assert choice.reason(close, "padded", MEDIAN, "cuda") == (
        "padded — 1.1 [1.05–1.2] ms a step, not distinguishable from packed 1.2 [1.15–1.3] (the [q1–q3] overlap): the "
        "faster median, of those whose step's peak memory rise is least (4.87 GiB to 4.88 GiB: within 5% of the least)"
    )
    apart = rows(padded=([1, 1.1, 1.3], 5000 * MIB), packed=([1.1, 1.2, 1.4], 4000 * MIB))
    assert choice.decide(apart) == ("packed", SMALLER)
    # overlapping, no memory (the CPU): the faster median, and the line says why
    cpu = rows(padded=([1.1, 1.2, 1.4], None), packed=([1, 1.1, 1.3], None), concat=([3, 3, 3], None))
    assert choice.decide(cpu) == ("packed", MEDIAN)
    made = Choice("packed", MEDIAN, cpu, "x", 10, 2, False, 1.23, 0.0, "cpu", "2.13.0")
    assert made.line() == (
        "strategy auto: packed — 1.1 [1.05–1.2] ms a step, not distinguishable from padded 1.2 [1.15–1.3] (the "
        "[q1–q3] overlap): the faster median, as memory is not measured on the CPU; against concat 3 [3–3]; 10 timed "
        "steps each; chosen in 1.2 s"
    )
    # what choosing cost, in its parts: the ranking's timing, the step's first call (its compile), the rest
    made.seconds, made.ranking_seconds, made.compile_seconds = 47.3, 4.1, 35.2
    assert made.line().endswith(
        "chosen in 47.3 s: 4.1 s ranking, 35.2 s the step's first call (its compile, which a run pays anyway), 8.0 s "
        "timing"
    )
    assert choice.Choice.parse(made.to_json(), "x").compile_seconds == 35.2


def test_the_candidates_share_one_step_built_and_compiled_once_and_one_prediction(tmp_path, timings, monkeypatch):
    built, losses, real_step, real_loss = [], [], auto.TrainStep, auto.candidate_loss

    def counted(*args, **kwargs):
        built.append(args[0].train.strategy)
        return real_step(*args, **kwargs)

    def kept(step, pred, batch):
        losses.append((step.strategy.name, pred))
        return real_loss(step, pred, batch)

    monkeypatch.setattr(auto, "TrainStep", counted)
    monkeypatch.setattr(auto, "candidate_loss", kept)
    made = run_training(tiny_cfg(tmp_path, *AUTO[:-1], "train.auto_candidates=[padded,packed,concat]"))[0].auto
    assert built == ["padded"]  # one step for the three; the run then builds its own
    assert [c.strategy for c in made.candidates] == ["padded", "packed", "concat"]
    assert [name for name, _ in losses] == ["padded", "packed", "concat"]
    assert all(pred is losses[0][1] for _, pred in losses)  # every loss on one prediction, before any step
    assert not losses[0][1].requires_grad


def test_every_candidates_batches_are_drawn_while_the_step_is_built_and_compiles(tmp_path, timings, monkeypatch):
    order, real_step, real_batches = [], auto.TrainStep, auto.candidate_batches
    monkeypatch.setattr(auto, "TrainStep", lambda *a, **k: order.append("step") or real_step(*a, **k))
    monkeypatch.setattr(auto, "candidate_batches", lambda cfg, n, *a: order.append(n) or real_batches(cfg, n, *a))
    run_training(tiny_cfg(tmp_path, *AUTO))
    assert order[:3] == ["padded", "packed", "step"]  # both candidates' workers started before the step is built
    # a ring of a slot a batch, of no more workers than batches: every batch drawn ahead, and then no worker draws
    cfg = tiny_cfg(tmp_path / "ring", *AUTO, "data.num_workers=4")
    for count, workers in ((3, 3), (6, 4)):
        batches = auto.candidate_batches(cfg, "packed", torch.device("cpu"), auto.DistEnv(), count)
        try:
            assert (batches.loader.slot_count, batches.loader.workers) == (count, workers)
            assert batches.fill(60.0) == (count, count)
            assert len(list(batches)) == count
        finally:
            batches.close()


def test_measuring_takes_a_small_share_of_a_long_run_and_fewer_steps_in_a_short_one():
    assert auto.timed_steps(100_000, 3) == auto.TIMED
    assert auto.timed_steps(1000, 3) == 4  # 3 x (2 warm-up + 4) steps: 1.8 % of 1000
    assert auto.timed_steps(6, 2) == auto.LEAST


# ----------------------------------------------------------------------------- the candidates and their errors


def test_without_named_candidates_the_rankings_first_that_train_here_are_timed(tmp_path, timings, odd):
    timings |= {name: ([3.0, 3.0, 3.0], None) for name in ("padded", "concat")} | {"packed": ([1.0, 1.0, 1.0], None)}
    ranked = Ranking(["gpu_only", "packed", "padded", "concat", "loop"], "a stub")
    cfg = tiny_cfg(tmp_path, "device=cpu", "train.strategy=auto", "train.steps=4")
    made = run_training(cfg, rank=lambda cfg, device: ranked)[0].auto
    assert [c.strategy for c in made.candidates] == ["packed", "padded", "concat"]  # gpu_only cannot train here
    assert (made.strategy, made.ranking) == ("packed", "the 3 first of a stub")


def test_make_train_ranks_the_candidates_by_make_shapes_prediction(tmp_path, timings, capsys):
    path = bench_file(tmp_path, slots=16, batch=4, record_slots=True)  # padded and packed, packed predicted faster
    overrides = [
        *TINY,
        "device=cpu",
        "train.strategy=auto",
        "train.steps=4",
        f"train.out_dir={tmp_path}",
        f"bench.out={path}",
    ]
    assert cli.main(["train", *overrides]) == 0
    out = capsys.readouterr().out
    assert (
        "strategy auto: timing packed, padded in the training step, 2 warm-up and 3 timed steps each (candidates: the "
        f"2 first of make shapes' prediction for synthetic at batch 4 x 16 slots, from bench losses' {path})"
    ) in out


ERRORS = {
    "train.auto_candidates=[padded,gpu_only]": "train.auto_candidates: gpu_only cannot train here: it needs a GPU",
    "train.auto_candidates=[padded,raising]": "train.strategy=auto: candidate raising failed in the training step on "
    "cpu: RuntimeError: no kernel image for this device",
    "train.auto_candidates=[padded,doubled]": "train.strategy=auto: candidate doubled computes another loss: ",
}


@pytest.mark.parametrize("candidates", ERRORS)
def test_a_candidate_that_cannot_train_here_is_one_line(tmp_path, odd, candidates):
    with pytest.raises(UserError) as err:
        run_training(tiny_cfg(tmp_path, "device=cpu", "train.strategy=auto", "train.steps=4", candidates))
    assert str(err.value).startswith(ERRORS[candidates]) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / auto.KEPT_FOLDER).exists()  # nothing kept


def test_no_candidate_is_one_line(tmp_path, odd):
    cfg = tiny_cfg(tmp_path, "device=cpu", "train.strategy=auto", "train.steps=4")
    with pytest.raises(UserError, match=r"^train.strategy=auto has no candidates: name them in train.auto_candidates"):
        run_training(cfg)
    with pytest.raises(UserError) as err:
        run_training(cfg, rank=lambda cfg, device: Ranking(["gpu_only"], "a stub"))
    assert str(err.value) == (
        "train.strategy=auto: no candidate trains here (the ranking's: gpu_only; each unavailable, emulated or refused "
        "by the speed options on this device): name them in train.auto_candidates, or set train.strategy"
    )


def test_the_command_says_a_candidates_error_in_one_line(tmp_path, odd, capsys):
    overrides = [*TINY, *AUTO[:3], "train.auto_candidates=[padded,gpu_only]", f"train.out_dir={tmp_path}"]
    assert cli.main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: train.auto_candidates: gpu_only cannot train here: it needs a GPU", err
