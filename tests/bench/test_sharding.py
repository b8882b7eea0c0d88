"""The scaling table (detector/bench/sharding.py): its rows and verdicts from summaries written by hand, and the
whole command on the CPU: one process, then every train.shard_optimizer on 2 gloo processes under torchrun."""

import json
import math
import os
import re

import pytest
import torch
from conftest import ROOT
from lab_helpers import MARKUP_NAME, SHOWN, rendered
from train_helpers import TINY

from detector.bench import sharding
from detector.bench.sharding import Run
from detector.cli import arguments
from detector.cli import main as cli
from detector.config.schema import TrainConfig, load_config
from detector.lab import report
from detector.train.observe.summary import Checkpoints, Save, TrainingSummary
from detector.train.observe.wallclock import PARTS, Account


def summary(world_size: int, step_ms: float, losses: list[float], peak=30.0) -> TrainingSummary:
    rate = 1024 * world_size / step_ms * 1e3
    return TrainingSummary([], losses, world_size=world_size, step_ms=step_ms, images_per_s=rate, peak_memory_gib=peak)


def write_runs(folder, runs: dict[str, TrainingSummary]) -> None:
    for name, s in runs.items():
        (folder / name / "seed_scale" / "padded").mkdir(parents=True)
        s.write(folder / name / "seed_scale" / "padded" / "summary.json")


def test_the_table_its_rows_and_the_three_percent_rule(tmp_path):
    runs = {"1x": summary(1, 100, [1.0, 0.5]), "2x-off": summary(2, 110, [1.0, 0.5])}
    runs |= {"2x-blocks": summary(2, 100, [1.0, 0.5]), "2x-fsdp2": summary(2, 102, [1.0, 0.5001])}
    runs |= {"2x-zero": summary(2, 96, [1.0, 0.5]), "notes": summary(1, 1, [])}  # a folder of another name: no run
    write_runs(tmp_path, runs)
    found, warnings = sharding.read_runs(tmp_path)
    assert list(found) == [Run(1, None), *(Run(2, mode) for mode in ("off", "blocks", "fsdp2", "zero"))]
    assert warnings == []
    text = sharding.table(found)
    assert "| 1 | – | 100 | 10,240 | 1.00× | 100.0% | — | 30.0 | — |" in text  # no wall_clock: lived left out
    assert "| 2 | off | 110 | 18,618 | 1.82× | 90.9% | — | 30.0 | — |" in text  # the reference of its row group
    assert "| 2 | blocks | 100 | 20,480 | 2.00× | 100.0% | — | 30.0 | 0.0e+00 |" in text
    assert "| 2 | fsdp2 | 102 |" in text and "| 2.0e-04 |" in text  # 0.5001 against 0.5
    assert "| 2 | zero | 96.0 | 21,333 | 2.08× | 104.2% |" in text
    lines = sharding.verdicts(found)
    assert lines[0] == "2 processes: `zero` is the fastest, 2.08× one process's images/s (the target: 2.0×, met)."
    assert (
        lines[1]
        == "2 processes: our `blocks` is -4.0% against torch's best, `zero`: torch's `zero` should be the default."
    )
    found[Run(2, "blocks")].images_per_s = found[Run(2, "zero")].images_per_s * 1.031
    assert sharding.verdicts(found)[1].endswith(": keep it.")


def test_losses_that_do_not_pair_step_by_step_have_no_gap():
    base, other = summary(2, 100, [1.0, 0.5]), summary(2, 100, [1.0])
    assert sharding.loss_gap(other, base) is None and sharding.loss_gap(base, base) == 0.0


def test_images_per_s_as_lived_project_the_measured_parts_onto_the_defaults_cadence():
    """1000 steps of 30 ms, with train.checkpoint_every=500 a checkpoint every 500 (2 saves of 0.5 s each, and the
    last one's write, 10 s, waited for at the end), an evaluation every 200 (5 of 2 s), 20 s of start-up and a first
    step of 6 s: 1024 x 1000 images in 20 + 6 + 999 x 0.03 + 2 x 0.5 + 10 + 5 x 2 = 76.97 s."""
    seconds = {"start-up": 20.0, "first step": 6.0, "checkpoints": 0.5 + 0.5 + 10.0, "evaluations": 2.0}
    wall = Account(seconds, 0.0, None, 0.0)
    saves = Checkpoints([Save(step, 0, 0.5, 1.0) for step in (20, 40)])
    run = TrainingSummary([], step_ms=30.0, global_batch=1024, evals=[(40, {})], wall_clock=wall, checkpoints=saves)
    assert sharding.lived(run, TrainConfig(checkpoint_every=500)) == pytest.approx(1024 * 1000 / 76.97)
    # the default cadence (auto): a minute of 30-ms steps between saves, 2000 steps, longer than the run: the final
    # save alone, 20 + 6 + 999 x 0.03 + 0.5 + 10 + 5 x 2 = 76.47 s
    assert sharding.lived(run) == pytest.approx(1024 * 1000 / 76.47)
    assert sharding.lived(TrainingSummary([], step_ms=30.0)) is None  # a summary of an earlier version: not guessed


def test_a_summary_that_cannot_be_read_is_one_line_and_the_readable_rows_are_shown(tmp_path, capsys):
    write_runs(tmp_path, {"1x": summary(1, 100, [1.0])})
    for name, text in (("2x-off", json.dumps({"steps": 3})), ("2x-zero", "{")):
        (tmp_path / name / "x").mkdir(parents=True)
        (tmp_path / name / "x" / "summary.json").write_text(text)
    assert cli.main(["scaling", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "| 1 | – | 100 | 10,240 | 1.00× | 100.0% | — | 30.0 | — |" in out and "| 2 |" not in out
    assert err.splitlines() == [
        f"warning: {tmp_path}/2x-off/x/summary.json: no loss curve (history): not written by make train: not in the "
        "table",
        f"warning: {tmp_path}/2x-zero/x/summary.json: not JSON (JSONDecodeError: Expecting property name enclosed in "
        "double quotes: line 1 co): not in the table",
    ]
    (tmp_path / "1x" / "seed_scale" / "padded" / "summary.json").write_text("[]")  # none left: one line
    assert cli.main(["scaling", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: no runs in {tmp_path}: expected folders named <n>x-<mode> (python -m detector scaling run)\n"
    )


@pytest.mark.parametrize("value", [math.nan, math.inf, -1, 1e308, "fast"])
def test_damaged_times_are_left_out_of_the_table_with_one_warning_each(tmp_path, capsys, value):
    """A summary's damaged step time, images/s, wall clock or checkpoint wait: its cell is empty (—), never nan, inf,
    -1.00 or a 300-digit number, and the warning names the file and the field."""
    runs = {"1x": summary(1, 100, [1.0, 0.5]), "2x-off": lived_summary(2, 110), "2x-zero": lived_summary(2, 96)}
    write_runs(tmp_path, runs)

    def spoil(name: str, change) -> str:
        path = tmp_path / name / "seed_scale" / "padded" / "summary.json"
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
        return str(path)

    one = spoil("1x", lambda d: d.update(step_ms=value, images_per_s=value))
    zero = spoil("2x-zero", lambda d: d["checkpoints"]["saves"][0].update(blocked_s=value))
    off = spoil("2x-off", lambda d: d["wall_clock"].update(seconds=d["wall_clock"]["seconds"] | {"steps": value}))
    assert cli.main(["scaling", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    shown = json.dumps(value) if not isinstance(value, str) else repr(value)
    expected = f"{shown}, expected a finite number in [0, 1e15]"
    assert err.splitlines() == [
        f"warning: {one}: step_ms is {expected}: left out",
        f"warning: {one}: images_per_s is {expected}: left out",
        f"warning: {off}: wall_clock.seconds.steps is {expected}: wall_clock left out",
        f"warning: {zero}: checkpoints.saves[0].blocked_s is {expected}: checkpoints left out",
    ]
    rows = [line for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows[0] == "| 1 | – | — | — | — | — | — | 30.0 | — |"
    assert rows[1].startswith("| 2 | off | 110 | 18,618 | — | — | — |")  # against one process: not measured
    assert rows[2].startswith("| 2 | zero | 96.0 | 21,333 | — | — | — |")  # lived: its checkpoints left out
    assert sharding.lived(lived_summary(2, 96)) and sharding.lived(lived_summary(2, 110))  # what the damage took
    assert not any(word in out.lower() for word in ("nan", "inf", "-1.00", "1000000"))
    assert "2 processes: `zero` is the fastest" not in out  # no verdict against an unmeasured process


def lived_summary(world_size: int, step_ms: float) -> TrainingSummary:
    """A summary with what ``lived`` needs: its wall clock, checkpoints and evaluations."""
    found = summary(world_size, step_ms, [1.0, 0.5])
    found.wall_clock = Account(dict.fromkeys(PARTS, 1.0), 7.0, 1 / 7, 0.0)
    found.checkpoints, found.evals, found.global_batch = Checkpoints([Save(1, 0, 0.5, 1.0)]), [(2, {})], 2048
    return found


def test_the_plan_and_its_commands():
    assert [r.name for r in sharding.plan(1)] == ["1x"]
    names = [r.name for r in sharding.plan(5)]  # 2 and 4 processes, not 5
    assert names == ["1x", *(f"{n}x-{m}" for n in (2, 4) for m in ("off", "blocks", "fsdp2", "zero"))]
    # report.sharding_modes picks modes; the table keeps its order (plain DDP, the reference, first)
    assert [r.name for r in sharding.plan(2, ["zero", "off"])] == ["1x", "2x-off", "2x-zero"]
    one, two = Run(1, None).command(ROOT, 40, ["device=cpu"]), Run(2, "zero").command(ROOT, 40, ["device=cpu"])
    assert one[:3] == ["-m", "detector", "train"] and "train.shard_optimizer" not in " ".join(one)
    assert two[:4] == ["-m", "detector.cli.launch", "--standalone", "--nproc_per_node=2"]
    assert two[-1] == "train.shard_optimizer=zero" and f"train.out_dir={ROOT / '2x-zero'}" in two


def test_fewer_than_two_processes_is_refused_in_one_line(tmp_path, capsys):
    assert cli.main(["scaling", "run", "device=cpu", "report.processes=1", f"report.work_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: report.processes=1: the scaling table needs 2 processes or more")
        and err.count("\n") == 1
    )
    assert not any(tmp_path.iterdir())


def test_a_table_whose_every_run_failed_leaves_the_earlier_document_and_says_so_in_one_line(
    tmp_path, monkeypatch, capsys
):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "cpu-x2.md").write_text("the committed table")
    monkeypatch.setattr(sharding, "run_all", lambda runs, *_: {r.name: "exit 1, its output in x.log" for r in runs})
    monkeypatch.setattr(sharding, "measure_link", lambda *_: (None, "exit 1, its output in link.log"))
    args = ["run", "device=cpu", "report.processes=2", f"report.work_dir={tmp_path}", f"report.out_dir={docs}"]
    assert cli.main(["scaling", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: every run of the scaling table failed (1x: exit 1, its output in x.log)")
    assert err.count("\n") == 1 and (docs / "cpu-x2.md").read_text() == "the committed table"


@pytest.mark.slow
def test_the_scaling_table_of_two_gloo_processes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DETECTOR_COMMIT", "abc1234")
    args = ["run", *TINY, "device=cpu", "data.num_workers=0", "report.processes=2", "report.train_steps=11"]
    args += [f"report.work_dir={tmp_path / 'work'}", f"report.out_dir={tmp_path / 'docs'}"]
    assert cli.main(["scaling", *args]) == 0
    doc = (tmp_path / "docs" / "cpu-x2.md").read_text()
    assert doc.startswith("# Scaling on 2 × cpu\n") and "commit abc1234 (a copy of its tree)" in doc
    assert "python -m detector.cli.launch --standalone --nproc_per_node=2 -m detector train train.steps=11" in doc
    rows = {tuple(cells[:2]): cells for cells in (line.strip("|").split(" | ") for line in doc.splitlines())}
    rows = {key: [c.strip() for c in cells] for key, cells in rows.items()}
    for mode in ("off", "blocks", "fsdp2", "zero"):
        cells = rows[(" 2", mode)]
        assert re.fullmatch(r"[\d.]+", cells[2]) and re.fullmatch(r"[\d,]+", cells[3]), cells  # step ms, images/s
        assert re.fullmatch(r"[\d.]+×", cells[4]) and cells[7] == "—", cells  # no GPU: no peak memory
        assert re.fullmatch(r"[\d,]+", cells[6]), cells  # images/s as lived: its checkpoints and evaluation timed
    assert rows[(" 1", "–")][4] == "1.00×"
    # plain DDP is the reference; blocks and zero equal it to the last bit, FSDP2 to its optimizer's rounding
    assert rows[(" 2", "off")][8] == "—"  # the loss against plain DDP's, after the peak memory column
    assert rows[(" 2", "blocks")][8] == rows[(" 2", "zero")][8] == "0.0e+00"
    assert float(rows[(" 2", "fsdp2")][8]) < 1e-5
    assert re.search(r"- 2 processes: `\w+` is the fastest, [\d.]+× one process's images/s \(the target: 2.0×", doc)
    assert "- 2 processes: our `blocks` is " in doc
    # the link alone, measured first on as many processes
    assert "The link alone on 2 processes, the head's " in doc and "| reduce | blocks: the fp32 gradients" in doc
    assert [p.name for p in (tmp_path / "work").rglob("link-x*.json")] == ["link-x2.json"]
    # again: every run has its summary, none runs twice
    capsys.readouterr()
    assert cli.main(["scaling", *args]) == 0
    again = capsys.readouterr().out
    assert "[1/5]" not in again and "the link alone:" not in again


def test_make_report_runs_the_scaling_part_where_there_are_several_processes(tmp_path):
    sections = {name: set(spec[1] or ()) | set(arguments.TOP_LEVEL) for name, spec in arguments.COMMANDS.items()}
    cpu = torch.device("cpu")
    for overrides, scaling in ((["device=cpu"], False), (["device=cpu", "report.processes=2"], True)):
        cfg = load_config(overrides, announce=None)
        parts = report.plan(cfg, cpu, tmp_path, ["padded"], overrides, sections)
        assert (parts[-1].title == "scaling") == scaling
    # its runs and its document in the report's folder, which the report copies out and links
    command = f"python -m detector scaling run --work={tmp_path / 'scaling'} device=cpu report.processes=2"
    assert parts[-1].command() == f"{command} report.out_dir={tmp_path / 'scaling'}"
    assert parts[-1].done == tmp_path / "scaling" / "done"


def test_a_link_that_could_not_be_measured_is_named_in_the_document():
    runs = {Run(1, None): summary(1, 100, [1.0]), Run(2, "blocks"): summary(2, 100, [1.0])}
    why = (None, "exit 1, its output in l.log")
    text = sharding.document(runs, {}, torch.device("cpu"), ["python -m detector train"], "w", why)
    assert text.endswith("\nThe link alone was not measured: exit 1, its output in l.log.\n")


def test_overrides_and_failures_holding_markup_come_out_escaped_in_the_document(monkeypatch):
    """A command line, a failure's reason and the commit named with a tag and pipes: shown as written, as text."""
    monkeypatch.setenv("DETECTOR_COMMIT", MARKUP_NAME)
    runs = {Run(1, None): summary(1, 100, [1.0]), Run(2, "blocks"): summary(2, 100, [1.0])}
    command = f"python -m detector train data.boxes='{MARKUP_NAME}'"
    failed = {"2x-off": f"exit 1: no file {MARKUP_NAME}"}
    text = sharding.document(runs, failed, torch.device("cpu"), [command], f"{command} ```", (None, None))
    page = rendered(text)
    assert "<script" not in page and page.count(SHOWN) == 4  # the commit, who wrote it, its command, the failure
    assert f"<code>{command.replace(MARKUP_NAME, SHOWN)} ```</code>" in page


def test_a_damaged_link_file_is_named_in_one_line_and_not_shown(tmp_path):
    (tmp_path / "link-x2.json").write_text(
        json.dumps({"processes": 2, "device": "cpu", "shape": [64], "collectives": []})
    )
    times, why = sharding.measure_link(tmp_path, 2, ["device=cpu"])  # kept from a stopped table: not measured again
    assert times is None and why == f"{tmp_path}/link-x2.json.shape has 1 items, expected [rows, columns]"


def test_a_link_that_hangs_is_given_up_and_measured_again_next_time(tmp_path, monkeypatch):
    monkeypatch.setattr(sharding, "LINK_SECONDS", 0.3)  # less than torchrun's own start: the link never answers
    times, why = sharding.measure_link(tmp_path, 2, ["device=cpu"])
    assert times is None and why == f"no result in {sharding.LINK_SECONDS} s, its output in {tmp_path}/logs/link-x2.log"
    assert not (tmp_path / "link-x2.json").exists()  # nothing kept: the next table measures it again


def test_the_scaling_tables_modes_take_off_as_a_word(capsys):
    """`python -m detector scaling run "report.sharding_modes=[off,blocks]"` gets past the configuration (here
    to the table's own refusal: no GPUs to share), where off was once refused as 'False'."""
    assert cli.main(["scaling", "run", "report.sharding_modes=[off,blocks]", "device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs 2 processes or more" in err and "out of range" not in err
