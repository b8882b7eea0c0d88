"""`make curves RUNS="A B [C ...]"`: training runs' loss curves side by side, from each run folder's summary.json.

Made for ``train.float8`` against bf16 (docs/training.md): A the bf16 run, B the float8 run on the same seed, C bf16
on another ``train.seed``, the noise reference. It prints each run's loss (the mean of its log window,
``train.log_every`` steps) every ``EVERY`` steps, then, for each run after the first, the largest |difference| of its
``EVERY``-step running mean from the first run's. With three runs or more the last one is the noise reference: a run
whose largest difference is no larger than the reference's matches the first run's curve within that noise. A value
of a run's summary that no measure takes (detector/checked.py) is one warning on stderr, and left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

from detector.checked import RecordError
from detector.errors import UserError
from detector.lab.present.tables import markdown_table
from detector.train.observe import summary

EVERY = 50  # steps between the table's rows, and the running mean's window


def curve(run_dir: str | Path) -> dict[int, float]:
    """Step -> the mean loss of the log window ending there (``make train``'s summary.json ``history``)."""
    try:
        record = summary.read(run_dir)
    except RecordError as err:
        raise UserError(f"{err}: `make train` writes a run's loss curve at its end") from None
    for warning in record.left_out:
        print(f"warning: {warning}", file=sys.stderr)
    return {step: float(loss) for step, loss in record.history}


def running_mean(points: dict[int, float], window: int = EVERY) -> dict[int, float]:
    """The mean loss of the ``window`` steps ending at each logged step whose window starts on a log boundary:
    the log windows' means, weighted by their lengths."""
    bounds = [0, *sorted(points)]
    out = {}
    for end in range(1, len(bounds)):
        if bounds[end] - window in bounds:
            first = bounds.index(bounds[end] - window)
            spans = zip(bounds[first:end], bounds[first + 1 : end + 1], strict=True)
            out[bounds[end]] = sum((stop - start) * points[stop] for start, stop in spans) / window
    return out


def compare_curves(run_dirs: list[str]) -> str:
    """The markdown: the runs, the loss table, and each run's largest difference from the first."""
    if len(run_dirs) < 2:
        raise UserError("curves: name two run folders or more (the first is the baseline)")
    curves = [curve(run) for run in run_dirs]
    means = [running_mean(points) for points in curves]
    common = set.intersection(*(set(m) for m in means))
    if not common:
        raise UserError(f"curves: the runs share no {EVERY}-step mean (train.log_every must divide {EVERY})")
    labels = [chr(ord("A") + i) for i in range(len(run_dirs))]
    lines = [f"{label}: {run}" for label, run in zip(labels, run_dirs, strict=True)]
    rows = [[step, *(f"{points[step]:.4f}" for points in curves)] for step in sorted(common) if step % EVERY == 0]
    lines += ["", markdown_table(["step", *labels], rows), ""]
    biggest = {}
    for label, mean in zip(labels[1:], means[1:], strict=True):
        step = max(sorted(common), key=lambda s, mean=mean: abs(mean[s] - means[0][s]))  # ties: the earliest
        biggest[label] = abs(mean[step] - means[0][step])
        lines.append(
            f"{label} against A: largest |difference| of the {EVERY}-step means {biggest[label]:.4f} at {step}"
        )
    if len(labels) > 2:
        noise = labels[-1]
        for label in labels[1:-1]:
            verdict = "within" if biggest[label] <= biggest[noise] else "outside"
            lines.append(f"{label}: {verdict} the run-to-run noise of A ({noise}, the noise reference)")
    return "\n".join(lines)


def run_curves(run_dirs: list[str]) -> None:
    print(compare_curves(run_dirs))
