"""`make curves`: training runs' loss curves side by side, and the largest difference of their running means."""

import json
from pathlib import Path

import pytest

from detector.cli.main import main as cli_main
from detector.errors import UserError
from detector.lab.curves import compare_curves, running_mean


def run_folder(tmp_path, name, loss, steps=200, log_every=10):
    """A run folder whose summary.json holds the curve ``loss(step)`` as `make train` logs it (window means)."""
    folder = tmp_path / name
    folder.mkdir()
    history = [[s, loss(s)] for s in range(log_every, steps + 1, log_every)]
    (folder / "summary.json").write_text(json.dumps({"history": history}))
    return str(folder)


def test_running_mean_weighs_the_log_windows_by_their_length():
    points = {10: 4.0, 20: 2.0, 50: 1.0}  # windows (0, 10], (10, 20], (20, 50]
    assert running_mean(points, window=50) == {50: (10 * 4 + 10 * 2 + 30 * 1) / 50}
    assert running_mean(points, window=20) == {20: 3.0}  # step 50's window starts at 30, no log boundary


def test_curves_table_the_losses_and_say_whether_a_run_is_within_the_noise(tmp_path, capsys):
    bf16 = run_folder(tmp_path, "bf16", lambda s: 2 - s / 200)
    float8 = run_folder(tmp_path, "float8", lambda s: 2 - s / 200 + 0.01)  # 0.01 above bf16 throughout
    other_seed = run_folder(tmp_path, "seed1", lambda s: 2 - s / 200 + (0.03 if s <= 50 else -0.005))
    assert cli_main(["curves", bf16, float8, other_seed]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [f"A: {bf16}", f"B: {float8}", f"C: {other_seed}"]
    assert "| step | A | B | C |" in out and "| 50 | 1.7500 | 1.7600 | 1.7800 |" in out
    assert [line for line in out if line.startswith("| ")][-1] == "| 200 | 1.0000 | 1.0100 | 0.9950 |"
    assert "B against A: largest |difference| of the 50-step means 0.0100 at " in "\n".join(out)
    assert "C against A: largest |difference| of the 50-step means 0.0300 at 50" in out
    assert out[-1] == "B: within the run-to-run noise of A (C, the noise reference)"
    worse = run_folder(tmp_path, "worse", lambda s: 2 - s / 200 + 0.05)
    assert compare_curves([bf16, worse, other_seed]).endswith(
        "B: outside the run-to-run noise of A (C, the noise reference)"
    )


def test_curves_refuse_what_they_cannot_compare_in_one_line(tmp_path, capsys):
    bf16 = run_folder(tmp_path, "bf16", lambda s: 1.0)
    assert cli_main(["curves", bf16, str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing/summary.json: no such file: `make train` writes" in err
    odd = run_folder(tmp_path, "odd", lambda s: 1.0, log_every=15)  # no 50-step window starts on its log boundaries
    with pytest.raises(UserError, match="train.log_every must divide 50"):
        compare_curves([bf16, odd])


def test_a_damaged_value_of_a_summary_is_one_warning_and_the_curves_still_compared(tmp_path, capsys):
    """make curves reads the summaries through the one reader: a NaN step time is named, not carried; a history
    point of no step is left out; a NaN loss is what a diverged run measured, and is kept."""
    bf16 = run_folder(tmp_path, "bf16", lambda s: 2 - s / 200)
    float8 = run_folder(tmp_path, "float8", lambda s: 2 - s / 200 + 0.01)
    summary = Path(float8) / "summary.json"
    data = json.loads(summary.read_text())
    data |= {"step_ms": float("nan"), "history": data["history"] + [[-5, 1.0]], "final_loss": float("nan")}
    summary.write_text(json.dumps(data))
    assert cli_main(["curves", bf16, float8]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"warning: {summary}: history[20] is -5, expected an integer in [0, 1e15]: history[20] left out",
        f"warning: {summary}: step_ms is NaN, expected a finite number in [0, 1e15]: left out",
    ]
    assert "| 200 | 1.0000 | 1.0100 |" in out and "B against A: largest |difference| of the 50-step means 0.0100" in out
