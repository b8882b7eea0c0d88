"""The scaling table: one process, then each way of sharing the model (train.shard_optimizer) on 2 and, where there
are GPUs for them, 4 (8, ...) processes, from `make train` runs launched with torchrun:

    python -m detector scaling run [key=value ...]   # the runs, then <report.out_dir>/<device>-x<N>.md
    python -m detector scaling <folder>              # the table of the runs in <folder> (a run's work folder)

``run`` first times the link alone: each collective the ways of sharing send, by itself, on as many processes
(detector/bench/link.py, kept in ``<folder>/link-x<N>.json``). Then it trains ``report.train_steps`` steps of each
run (1 process, then ``<n>x-<mode>`` for every mode), each into ``<folder>/<n>x-<mode>/`` (a run that has its
summary.json is not run again: a stopped table resumes), and writes the document: the machine, the commands, one
row per run (median step, images/s, images/s against one process's, per process, images/s as a run lives it, rank
0's peak memory, the largest relative difference of its per-step losses from plain DDP's at the same number of
processes), the verdicts and the link's table. ``report.processes`` says how many processes at most: 0, one per
visible GPU (none: no table); ``report.sharding_modes`` which modes (all four by default: fewer, a shorter table). On
the CPU the processes are gloo's, which is how the tests run it. `make report` runs it as one of its parts on a
machine of several GPUs.

"As a run lives it": each run checkpoints halfway and at its end and evaluates at its end, and its start-up, first
step, checkpoint waits and evaluation are measured (summary.json's ``wall_clock``); ``lived`` projects them onto a
run of the defaults' length and cadence (train.steps, train.checkpoint_every, train.eval_every): the images/s a
user's run of the defaults gets, where the steady step's leave all of that out.

A summary that cannot be read, or a value it holds that no measure takes (a damaged record: detector/checked.py),
is one warning naming the file and the field, under the table (stderr for ``<folder>``), and the rest is shown.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from detector.bench.link import read_link, summary_lines
from detector.checked import RecordError
from detector.config.device import device_name, resolve_device
from detector.config.schema import TrainConfig, load_config
from detector.config.sharing import WAYS, of_kind
from detector.errors import UserError
from detector.lab.children import Child, run_child
from detector.lab.present.tables import cell_text, code_block, code_text, markdown_table, ms
from detector.lab.record.provenance import device_slug, machine_line, now, quote
from detector.train.checkpoints import AUTO, interval_steps
from detector.train.observe import summary
from detector.train.observe.summary import TrainingSummary

REFERENCE = of_kind("reference")[0]  # plain DDP: the others' losses are held to its
KEEP_OURS_ABOVE = 1.03  # our ShardedBlocks stays only where it is more than 3 % faster than the best of torch's
# images/s against one GPU's that the scaling is held to (the link's time fits under the step's compute:
# docs/training.md, "Several GPUs")
TARGETS = {2: 2.0, 4: 3.9}
SECTIONS = ("data", "model", "train", "preset", "device", "autocast")  # the overrides a training run takes
LINK_SECONDS = 600  # the link alone: seconds at seed scale, then the table goes on without it
RUN_NAME = re.compile(r"(\d+)x(?:-(\w+))?$")


@dataclass(frozen=True)
class Run:
    """One training run of the table: ``processes`` of them sharing the model as ``mode`` says."""

    processes: int
    mode: str | None  # None for one process

    @property
    def name(self) -> str:
        return f"{self.processes}x" + (f"-{self.mode}" if self.mode else "")

    def command(self, work: Path, steps: int, overrides: list[str]) -> list[str]:
        """The command line (after ``python``): ``-m detector train ...``, under torchrun for several processes."""
        # a checkpoint halfway and at the end: what a save costs the step, for ``lived``
        args = ["-m", "detector", "train", f"train.steps={steps}", f"train.checkpoint_every={max(1, steps // 2)}"]
        args += [f"train.out_dir={work / self.name}", *overrides]
        args += [f"train.shard_optimizer={self.mode}"] if self.mode else []
        if self.processes == 1:
            return args
        return ["-m", "detector.cli.launch", "--standalone", f"--nproc_per_node={self.processes}", *args]


def plan(processes: int, modes=tuple(WAYS)) -> list[Run]:
    """One process, then each of ``modes`` on 2, 4, 8 ... processes up to ``processes``, in table order."""
    counts = [n for n in (2**k for k in range(1, 8)) if n <= processes]
    return [Run(1, None)] + [Run(n, mode) for n in counts for mode in WAYS if mode in modes]


def table_processes(cfg: DictConfig) -> int:
    """``report.processes``, or for 0 the GPUs visible (none on the CPU)."""
    if cfg.report.processes:
        return cfg.report.processes
    return torch.cuda.device_count() if resolve_device(cfg).type == "cuda" else 0


# ----------------------------------------------------------------------------- running


def run_all(runs: list[Run], work: Path, steps: int, overrides: list[str]) -> dict[str, str]:
    """Each run that has no summary yet, its output kept in ``work/logs/<name>.log``; returns the failed runs'
    ``name -> why`` (the others go on: the table says which failed)."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    failed = {}
    for i, run in enumerate(runs, 1):
        if next((work / run.name).rglob(summary.SUMMARY), None):  # its summary, readable or not: the table says
            continue
        command = run.command(work, steps, overrides)
        print(f"[{i}/{len(runs)}] {run.name}: python {' '.join(quote(a) for a in command)}", flush=True)
        log = work / "logs" / f"{run.name}.log"
        with open(log, "w") as out:
            ran = run_child(Child(run.name, command), out)
        if ran.code:
            failed[run.name] = f"exit {ran.code}, its output in {log}"
        print(f"[{i}/{len(runs)}] {run.name}: {failed.get(run.name, 'done')} in {ran.seconds:.0f} s")
    return failed


def measure_link(work: Path, processes: int, overrides: list[str]) -> tuple[dict | None, str | None]:
    """The link alone on ``processes`` processes (detector/bench/link.py), kept in ``work/link-x<N>.json`` (a
    stopped table does not measure it again): its times, or None and why not."""
    path = work / f"link-x{processes}.json"
    if not path.exists():
        (work / "logs").mkdir(parents=True, exist_ok=True)
        log = work / "logs" / f"link-x{processes}.log"
        command = ["-m", "detector.cli.launch", "--standalone", f"--nproc_per_node={processes}"]
        command += ["-m", "detector", "link", f"--out={path}", *overrides]
        print(f"the link alone: python {' '.join(quote(a) for a in command)}", flush=True)
        with open(log, "w") as out:  # seconds at seed scale: a link that hangs must not hold up the table
            ran = run_child(Child("the link alone", command, LINK_SECONDS), out)
        if ran.code is None:
            return None, f"no result in {LINK_SECONDS} s, its output in {log}"
        if ran.code or not path.exists():
            return None, f"exit {ran.code}, its output in {log}"
    try:
        return read_link(path).to_json(), None
    except RecordError as err:
        return None, str(err)


def summary_of(folder: Path) -> TrainingSummary | None:
    """The newest summary.json under a run's folder (``<folder>/<experiment>/<run>/``), or None; RecordError naming
    the file and the field where it is not a training run's summary."""
    paths = sorted(folder.rglob(summary.SUMMARY), key=lambda p: p.stat().st_mtime)
    return summary.read(paths[-1]) if paths else None


def read_runs(folder: Path) -> tuple[dict[Run, TrainingSummary], list[str]]:
    """The summaries of the runs in ``folder`` (subfolders named ``<n>x[-<mode>]``), in table order, and the warnings
    of reading them: each summary that cannot be read, each value left out of one."""
    found, warnings = {}, []
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        match = RUN_NAME.fullmatch(path.name)
        try:
            read = summary_of(path) if match and path.is_dir() else None
        except RecordError as err:
            warnings.append(f"{err}: not in the table")
            continue
        if read:
            found[Run(int(match.group(1)), match.group(2))] = read
            warnings += read.left_out
    order = {mode: i for i, mode in enumerate(WAYS)}
    return dict(sorted(found.items(), key=lambda item: (item[0].processes, order.get(item[0].mode, -1)))), warnings


# ----------------------------------------------------------------------------- the table and its verdicts


def loss_gap(run: TrainingSummary, base: TrainingSummary) -> float | None:
    """The largest relative difference of ``run``'s per-step losses from ``base``'s; None if they do not pair."""
    ours, theirs = run.losses, base.losses
    if not ours or len(ours) != len(theirs):
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


def lived(run: TrainingSummary, defaults=None) -> float | None:
    """Images/s of a run of the defaults' length and cadence (train.steps, checkpoint_every, eval_every), from this
    run's measured parts: its start-up and first step, its median step, each checkpoint's wait, each evaluation and
    the final checkpoint's write; None for a summary without them (an earlier version's)."""
    wall, saves = run.wall_clock, run.checkpoints.saves if run.checkpoints else []
    if not wall or not saves or not run.evals or not run.step_ms:
        return None
    d = defaults or TrainConfig()
    seconds = wall.seconds
    blocked = [s.blocked_s for s in saves]
    final = max(0.0, seconds["checkpoints"] - sum(blocked))  # the last save's write, which the run's end waits for
    every = d.checkpoint_every
    if every == AUTO:  # the cadence the defaults would choose from this run's step and save
        written = [s.written_s for s in saves if s.written_s]
        every = interval_steps(run.step_ms / 1e3, max(written) if written else 0.0)
    n_saves, n_evals = -(-d.steps // every), -(-d.steps // d.eval_every)
    total = seconds["start-up"] + seconds["first step"] + (d.steps - 1) * run.step_ms / 1e3
    total += n_saves * sum(blocked) / len(blocked) + final
    total += n_evals * seconds["evaluations"] / len(run.evals)
    return d.steps * run.global_batch / total


def cadence_words() -> str:
    every = TrainConfig.checkpoint_every
    return "as this run's step and save set it" if every == AUTO else f"every {every} steps"


def one_process_rate(runs: dict[Run, TrainingSummary]) -> float | None:
    """One process's images/s, which the others are held to (None: no such run, or none measured)."""
    return next((s.images_per_s for r, s in runs.items() if r.processes == 1), None) or None


def table(runs: dict[Run, TrainingSummary]) -> str:
    one = one_process_rate(runs)
    rows = []
    for run, s in runs.items():
        base = next((b for r, b in runs.items() if r.processes == run.processes and r.mode == REFERENCE), None)
        times = s.images_per_s / one if one and s.images_per_s is not None else None
        gap = loss_gap(s, base) if base is not None and run.mode not in (None, REFERENCE) else None
        rate = lived(s)
        rows.append(
            [
                run.processes,
                run.mode or "–",
                ms(s.step_ms),
                None if s.images_per_s is None else f"{s.images_per_s:,.0f}",
                None if times is None else f"{times:.2f}×",
                None if times is None else f"{times / run.processes:.1%}",
                None if rate is None else f"{rate:,.0f}",
                None if s.peak_memory_gib is None else f"{s.peak_memory_gib:.1f}",
                None if gap is None else f"{gap:.1e}",
            ]
        )
    headers = ["processes", "train.shard_optimizer", "step ms", "images/s", "× one process", "per process", "lived"]
    return markdown_table(headers + ["peak GiB", "loss vs DDP"], rows, "rl" + "r" * 7)


def verdicts(runs: dict[Run, TrainingSummary]) -> list[str]:
    """Per number of processes: the fastest mode against one process and the target, and whether our own
    sharding earns its place beside torch's engines."""
    one = one_process_rate(runs)
    lines = []
    for n in sorted({r.processes for r in runs} - {1}):
        rate = {r.mode: s.images_per_s for r, s in runs.items() if r.processes == n and s.images_per_s is not None}
        if not rate:
            continue
        best = max(rate, key=rate.get)
        if one:
            times, target = rate[best] / one, TARGETS.get(n)
            bar = "" if target is None else f" (the target: {target}×, {'met' if times >= target else 'not met'})"
            lines.append(f"{n} processes: `{best}` is the fastest, {times:.2f}× one process's images/s{bar}.")
        engines = {m: rate[m] for m in of_kind("torch") if m in rate}
        for ours in (m for m in of_kind("ours") if m in rate and engines):
            engine = max(engines, key=engines.get)
            ahead = rate[ours] / engines[engine]
            keep = "keep it" if ahead > KEEP_OURS_ABOVE else f"torch's `{engine}` should be the default"
            lines.append(f"{n} processes: our `{ours}` is {ahead - 1:+.1%} against torch's best, `{engine}`: {keep}.")
    return lines


def document(
    runs: dict[Run, TrainingSummary],
    failed: dict[str, str],
    device,
    commands: list[str],
    written_by: str,
    link=(None, None),
    warnings=(),
) -> str:
    """The markdown of the scaling document; ``link``: ``measure_link``'s (times, why not); ``warnings``: what could
    not be read of the runs' summaries."""
    most = max(r.processes for r in runs) if runs else 1
    lines = [f"# Scaling on {most} × {device_name(device)}", "", cell_text(machine_line(device)), ""]
    lines += [
        f"Written by {code_text(written_by)} on {now()[:10]}, from these runs (`python` from the repository root):"
    ]
    lines += ["", *code_block(commands), "", table(runs), ""]
    lines += [
        "`× one process`: images/s (by the wall clock, data waits included) against one process's, each process "
        "with the same batch; `per process`: that divided by the processes. `lived`: the images/s of a run of the "
        f"defaults' length ({TrainConfig.steps} steps, checkpoints at the defaults' cadence ({cadence_words()}), an "
        f"evaluation every {TrainConfig.eval_every}) from this run's start-up, first step, checkpoint waits and "
        "evaluation as measured, with its median step. `peak GiB`: rank 0's peak of "
        "allocated GPU memory. `loss vs DDP`: the largest relative difference of the per-step losses from "
        f"plain DDP's (`{REFERENCE}`) on as many processes (docs/training.md says what bounds it).",
        "",
    ]
    lines += [f"- {line}" for line in verdicts(runs)]
    lines += [f"- `{name}` failed: {cell_text(why)}." for name, why in failed.items()]
    lines += [f"- warning: {cell_text(warning)}" for warning in warnings]
    times, why = link
    lines += ["", *summary_lines(times)] if times else ["", f"The link alone was not measured: {why}."] if why else []
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the command


def run_table(overrides: list[str], work: Path | None = None, out: Path | None = None) -> dict[str, str]:
    """Launch the runs (resuming where they stopped) and write the document; returns the failed runs' ``name ->
    why``. Where every run failed there is no table: an earlier document stays as it was."""
    cfg = load_config(overrides, announce=None)
    device, most = resolve_device(cfg), table_processes(cfg)
    if most < 2:
        raise UserError(
            f"report.processes={cfg.report.processes}: the scaling table needs 2 processes or more; this machine "
            f"shows {torch.cuda.device_count()} GPU(s): set report.processes=N (on the CPU: N gloo processes)"
        )
    slug = device_slug(device_name(device))
    work = work or Path(cfg.report.work_dir) / slug / "scaling"
    runs = plan(most, cfg.report.sharding_modes)
    passed = [o for o in overrides if o.partition("=")[0].split(".")[0] in SECTIONS]
    link = measure_link(work, most, passed)
    failed = run_all(runs, work, cfg.report.train_steps, passed)
    commands = ["python " + " ".join(quote(a) for a in r.command(work, cfg.report.train_steps, passed)) for r in runs]
    written_by = " ".join(["python -m detector scaling run", *map(quote, overrides)])
    out = out or Path(cfg.report.out_dir) / f"{slug}-x{max(r.processes for r in runs)}.md"
    if len(failed) == len(runs):
        name, why = next(iter(failed.items()))
        raise UserError(f"every run of the scaling table failed ({name}: {why}); {out} is left as it was")
    found, warnings = read_runs(work)
    text = document(found, failed, device, commands, written_by, link, warnings)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.new")
    temp.write_text(text)
    os.replace(temp, out)
    print(text)
    print(f"scaling table: {out} (its runs in {work}/)" + (f"; {len(failed)} of its runs failed" if failed else ""))
    return failed


def show_table(folder: Path) -> None:
    """The table and verdicts of the runs already in ``folder``: ``python -m detector scaling <folder>``."""
    runs, warnings = read_runs(folder)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not runs:
        raise UserError(f"no runs in {folder}: expected folders named <n>x-<mode> (python -m detector scaling run)")
    print(table(runs))
    print("\n".join(verdicts(runs)))
