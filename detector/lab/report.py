"""`make report`: the lab's standard set of measurements on the machine at hand, as one document.

The standard set, each part a command of its own (run as a subprocess, so that the document can name the
exact command and each part starts from a clean process):

1. ``profile``: every registered strategy that can run here, in train mode (``report.short`` strategies,
   seconds per step at seed scale, with fewer steps);
2. ``compare`` of those profiles;
3. ``train``: ``report.train_steps`` steps of each of ``report.train_strategies``, whose measured step the
   profiles must agree with;
4. ``bench losses`` (on a GPU at batch 1024 and 16384), and on a GPU also ``bench kernels`` and ``bench step``.
   Its "which strategy should I use?" table opens the document;
5. on a machine of several GPUs (or ``report.processes`` of them), the scaling table (detector/bench/sharding.py):
   every train.shard_optimizer on 2 and 4 ... GPUs against one, launched with torchrun, into its own document
   ``<report.out_dir>/<device>-x<N>.md``, which the report links.

Every override given to `make report` (``ARGS="preset=seed_scale"``) goes to each part that reads its
config section. The runs go to ``<report.work_dir>/<device>/current/``; a part whose output is there
already is not run again, so a report that was stopped resumes where it stopped (with the same
overrides; different ones start afresh and keep the unfinished folder aside). When every part has run,
``<report.out_dir>/<device>.md`` and its charts in ``<report.out_dir>/<device>/`` are replaced (only
then), naming the device, torch, the commit and the commands, and the run folder gets its timestamp. A record of the
report's that cannot be read (compare.json, a training summary), or a value in one that no measure takes, is a
warning in the document naming the file and the field, and the rest is shown.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from detector.checked import RecordError
from detector.config.device import device_name, resolve_device
from detector.errors import UserError
from detector.lab.children import Child, run_child
from detector.lab.folders import new_run_dir, prepare_work
from detector.lab.present.tables import (
    WHICH_HEADING,
    cell_text,
    code_block,
    code_text,
    markdown_table,
    ms,
    spread_cell,
    times,
)
from detector.lab.present.verdicts import profiler_note
from detector.lab.record.comparison import ComparisonRecord, ModeComparison, read_comparison
from detector.lab.record.provenance import device_slug, machine_line, now, quote
from detector.lab.record.run import read_summary
from detector.losses import STRATEGIES, get_strategy
from detector.train.observe import summary
from detector.train.run.step import speed_option_refusal

SYNCED = "padded"  # profiled once more with profile.sync_regions=true on a GPU: what the article's protocol costs
GPU_BATCHES = (1024, 16384)  # bench losses on a GPU: the seed's batch, and one where the loss's own work shows
SHORT_PROFILE = ["profile.wait=1", "profile.warmup=1", "profile.active=3", "profile.timed=2"]
CHARTS = ("ms-per-step-train.png", "counts-train.png", "timeline-train.png", "memory-train.png")


@dataclass
class Part:
    """One command of the report: what it is, its arguments after ``python -m detector``, and the file
    that exists once it has run."""

    title: str
    args: list[str]
    done: Path

    def command(self) -> str:
        return "python -m detector " + " ".join(quote(a) for a in self.args)


def run_report(cfg: DictConfig, overrides: list[str], sections: dict[str, set[str]]) -> Path:
    """Run (or resume) the standard set and write the document; returns its path. ``sections``: the config
    sections each command reads, so that each part gets only the overrides it accepts."""
    rcfg, device = cfg.report, resolve_device(cfg)
    slug = device_slug(device_name(device))
    work = prepare_work(Path(rcfg.work_dir) / slug, overrides)
    strategies, skipped = runnable(cfg, device)
    parts = plan(cfg, device, work, strategies, overrides, sections)
    done = sum(p.done.exists() for p in parts)
    print(f"report on {device_name(device)}: {len(parts)} parts ({done} done already) in {work}/")
    started = time.perf_counter()
    for i, part in enumerate(parts, 1):
        if part.done.exists():
            continue
        print(f"[{i}/{len(parts)}] {part.title}: {part.command()}", flush=True)
        began = time.perf_counter()
        run_part(part, work / "logs" / f"{i:02d}.log")
        print(f"[{i}/{len(parts)}] {part.title}: done in {time.perf_counter() - began:.0f} s", flush=True)
    print(f"all parts done in {time.perf_counter() - started:.0f} s; writing the report", flush=True)
    return finish(cfg, device, work, parts, skipped, overrides)


def finish(cfg: DictConfig, device, work: Path, parts: list[Part], skipped: dict, overrides: list[str]) -> Path:
    """Write the document from the finished parts in ``work`` and give the run folder its time stamp; returns the
    document's path. A report whose profiles the noise check flags does not replace an existing
    ``<report.out_dir>/<device>.md`` (unless report.force=true): it stays in its run folder, and says so."""
    out_dir, slug = Path(cfg.report.out_dir), device_slug(device_name(device))
    noisy = noisy_runs(work)
    kept = bool(noisy) and (out_dir / f"{slug}.md").exists() and not cfg.report.force
    path = write_document(cfg, device, work, parts, skipped, overrides, work if kept else out_dir)
    final = new_run_dir(work.parent)
    os.replace(work, final)  # onto the new, empty folder: its time's name, and no other run's
    if not kept:
        print(f"report: {path} (charts in {path.with_suffix('')}/); its runs: {final}/")
        return path
    path = final / path.name
    print(
        f"report: the noise check flags {len(noisy)} of its profiles ({'; '.join(noisy[:2])}): "
        f"{out_dir / f'{slug}.md'} is kept as it was, and this report is {path}. Run it again on a quiet "
        "machine, or replace the kept one with make report ARGS=report.force=true"
    )
    return path


def profile_records(work: Path) -> list:
    """The records of the report's profiles (its training runs' summaries, and any unreadable one, left out: compare
    has said why)."""
    records = []
    for path in sorted(work.glob("*/*/*/summary.json")):
        try:
            records.append(read_summary(path))
        except RecordError:
            continue
    return records


def noisy_runs(work: Path) -> list[str]:
    """``<strategy>: <why>`` for each profile of the report whose noise check flags it."""
    return [f"{r.strategy}: {'; '.join(r.noise_reasons())}" for r in profile_records(work) if r.noisy]


def load_line(work: Path) -> str:
    """The load the report's profiles ran under: each profile's noise, summed up in one line."""
    records = profile_records(work)
    noises = [r.noise for r in records if r.noise]
    if not noises:
        return "The load of other processes was not recorded."
    during = [n.load_during for n in noises if n.load_during is not None]
    noisy = [cell_text(r.strategy) for r in records if r.noisy]
    load = f"at most {max(during):.2f} of {noises[0].cores} cores" if during else "unknown"
    verdict = f"the noise check flags {', '.join(noisy)}" if noisy else "no run was flagged as noisy"
    return f"Other processes' load during the profiles: {load}; {verdict} (each run's noise: compare below)."


def runnable(cfg: DictConfig, device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The strategies to profile, and why the others cannot run here."""
    names = list(cfg.report.strategies) or list(STRATEGIES)
    skipped = {}
    for name in names:
        strategy = get_strategy(name)
        reason = strategy.unavailable(device) or speed_option_refusal(strategy, cfg.train, 1, device)
        if reason:
            skipped[name] = reason
    return [n for n in names if n not in skipped], skipped


def plan(cfg, device, work: Path, strategies: list[str], overrides: list[str], sections: dict) -> list[Part]:
    def passed(command: str) -> list[str]:
        return [o for o in overrides if o.partition("=")[0].split(".")[0] in sections[command]]

    rcfg = cfg.report
    parts = []
    for name in strategies:
        short = SHORT_PROFILE if name in rcfg.short else []
        args = ["profile", f"profile.strategy={name}", f"profile.out_dir={work / 'profile'}", *passed("profile")]
        parts.append(Part(f"profile {name}", args + short, work / "profile" / name / "done"))
    compare = work / "compare"
    parts.append(
        Part("compare", ["compare", "--dir", str(work / "profile"), "--out", str(compare)], compare / "compare.json")
    )
    if device.type == "cuda" and SYNCED in strategies:  # the article's protocol, beside the profile as training runs
        args = ["profile", f"profile.strategy={SYNCED}", f"profile.out_dir={work / 'synced'}", *passed("profile")]
        parts.append(
            Part(
                f"profile {SYNCED}, regions synchronised",
                args + ["profile.sync_regions=true"],
                work / "synced" / "done",
            )
        )
    for name in [n for n in rcfg.train_strategies if n in strategies]:
        out = work / "train" / name  # its own folder: the run's name depends on the speed options
        args = ["train", f"train.strategy={name}", f"train.steps={rcfg.train_steps}", f"train.out_dir={out}"]
        args += ["train.checkpoint_every=0", "train.log_every=10", *passed("train")]
        parts.append(Part(f"train {name}", args, out / "done"))
    targets = ["losses"] + (["kernels", "step"] if device.type == "cuda" else [])
    for target in targets:
        args = ["bench", target, f"bench.out={work / 'bench' / 'bench.json'}", *passed("bench")]
        if target == "losses" and device.type == "cuda" and not any(a.startswith("bench.batch_sizes=") for a in args):
            args.append(f"bench.batch_sizes=[{','.join(map(str, GPU_BATCHES))}]")
        parts.append(Part(f"bench {target}", args, work / "bench" / f"{target}.md"))
    if rcfg.processes > 1 or (not rcfg.processes and device.type == "cuda" and torch.cuda.device_count() > 1):
        # its runs and its document in the report's folder; write_document copies the document out
        args = ["scaling", "run", f"--work={work / 'scaling'}", *overrides, f"report.out_dir={work / 'scaling'}"]
        parts.append(Part("scaling", args, work / "scaling" / "done"))
    return parts


def run_part(part: Part, log: Path) -> None:
    """Run one part (lab/children.py), its output shown and kept in ``log``; a failure stops the report in one
    line."""
    with open(log, "w") as out:
        # a part whose file is its own output (compare.json, a bench's page) is done once the child wrote it
        done = part.done if part.done.name == "done" else None
        ran = run_child(Child(part.title, ["-m", "detector", *part.args], done=done), out, echo=True)
    if ran.code:
        raise UserError(
            f"report: `{part.command()}` failed (exit {ran.code}); its output is in {log}. "
            "Run make report again to resume after fixing it"
        )


# ----------------------------------------------------------------------------- the document


def write_document(
    cfg: DictConfig, device, work: Path, parts: list[Part], skipped: dict, overrides: list[str], out_dir: Path
) -> Path:
    """``<out_dir>/<device>.md`` and its charts in ``<out_dir>/<device>/``, replaced only once both are written."""
    slug = device_slug(device_name(device))
    path, charts = out_dir / f"{slug}.md", out_dir / slug
    compare, unread = comparison(work)
    lines = [
        f"# Results on {device_name(device)}",
        "",
        cell_text(machine_line(device)),
        "",
        f"Written by {code_text('make report' + (' ARGS=' + quote(' '.join(overrides)) if overrides else ''))} on "
        f"{now()[:10]}; each section names its commands (`python -m detector ...`, run from the repository root). "
        f"The runs themselves are in {code_text(f'{work.parent}/<time>/')}.",
        "",
        load_line(work),
        "",
        "## Which strategy should I use?",
        "",
        "The loss alone, forward and backward, on the seed's boxes: the fastest strategy in each situation timed "
        "by `bench losses` below, and what torchvision's loss and torch.nested cost against it.",
        "",
        section(work / "bench" / "losses.md", WHICH_HEADING).partition("\n")[2].strip(),
        "",
        "## The training step of each strategy",
        "",
        *code_block(
            [p.command() for p in parts if p.args[0] in ("profile", "compare") and p.done.parent.name != "synced"]
        ),
        "",
    ]
    if skipped:
        lines += ["Not profiled here:", "", *(f"- {cell_text(n)}: {cell_text(why)}" for n, why in skipped.items()), ""]
    lines += [f"![{c}]({slug}/{c})" for c in CHARTS if (work / "compare" / c).exists()]
    lines += ["", demote(section(work / "compare" / "compare.md", "## mode=train")), *warned(unread)]
    commands = code_block([p.command() for p in parts if p.args[0] == "train"])
    lines += ["", "## The profile against training", "", *commands, ""]
    lines += [profile_vs_training(work, compare, cfg.report.train_strategies)]
    synced = [p for p in parts if "profile.sync_regions=true" in p.args]
    if synced:
        lines += ["", "## The article's protocol: a synchronize after each region", ""]
        lines += [*code_block([synced[0].command()]), "", synced_section(work, compare)]
    for part in (p for p in parts if p.args[0] == "bench"):
        lines += ["", f"## {part.title}", "", *code_block([part.command()]), "", demote(part.done.read_text().strip())]
    scaling = sorted((work / "scaling").glob(f"{slug}-x*.md"))  # the scaling part's document, copied beside
    if scaling:
        lines += ["", "## Several GPUs", "", "Each train.shard_optimizer against one GPU, with its commands:"]
        lines += ["", *(f"- [{doc.name}]({doc.name})" for doc in scaling)]
    out_dir.mkdir(parents=True, exist_ok=True)
    for doc in scaling:
        if doc.parent != out_dir:
            shutil.copy(doc, out_dir / f".{doc.name}.new")
            os.replace(out_dir / f".{doc.name}.new", out_dir / doc.name)
    fresh = charts.with_name(f".{slug}.new")
    shutil.rmtree(fresh, ignore_errors=True)  # our own leftover from a failed write
    fresh.mkdir()
    for chart in CHARTS:
        if (work / "compare" / chart).exists():
            shutil.copy(work / "compare" / chart, fresh / chart)
    temp = path.with_name(f".{path.name}.new")
    temp.write_text("\n".join(lines) + "\n")
    old = charts.with_name(f".{slug}.old")
    if charts.exists():
        os.replace(charts, old)
    os.replace(fresh, charts)
    os.replace(temp, path)
    shutil.rmtree(old, ignore_errors=True)  # replaced: the new charts and document are in place
    return path


def comparison(work: Path) -> tuple[ComparisonRecord, list[str]]:
    """The report's compare.json and the warnings of reading it; where it cannot be read, an empty comparison and
    the one line that says why."""
    try:
        found = read_comparison(work / "compare")
    except RecordError as err:
        return ComparisonRecord("", ""), [str(err)]
    return found, found.left_out


def warned(warnings: list[str]) -> list[str]:
    """The document's lines of ``warnings``: each its paragraph."""
    return [line for warning in warnings for line in ("", f"**warning**: {cell_text(warning)}")]


def section(path: Path, heading: str) -> str:
    """The part of a markdown file from ``heading`` to the next heading of the same level."""
    text = path.read_text()
    start = text.find(heading)
    if start < 0:
        return ""
    level = heading.split(" ")[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end >= 0 else len(text)].strip()


def demote(markdown: str) -> str:
    """Each heading one level down, to sit under a section of the report."""
    return re.sub(r"^(#+) ", r"#\1 ", markdown, flags=re.MULTILINE)


def training_step(work: Path, name: str, warnings: list[str]) -> float | None:
    """The median step (ms) of the report's training run of ``name``; None where there is none, it timed no step, or
    its summary cannot be read (said in ``warnings``, with each value left out of it)."""
    found = sorted((work / "train" / name).glob("*/*/summary.json"))
    if not found:
        return None
    try:
        record = summary.read(found[-1])
    except RecordError as err:
        warnings.append(str(err))
        return None
    warnings += record.left_out
    return record.step_ms or None  # 0 ms: no step timed either


def profile_vs_training(work: Path, compare: ComparisonRecord, names: list[str]) -> str:
    """Per strategy: training's median step against the profiled step (host and, on a GPU, device) and the
    steps the profile timed without the profiler."""
    mode = compare.modes.get("train") or ModeComparison([], None, {})
    rows, trained, ratios, warnings = [], {}, [], []
    for name in names:
        train_ms = training_step(work, name, warnings)
        if train_ms is None and not mode.step(name):
            continue
        if train_ms:
            trained[name] = train_ms
        row = [name, ms(train_ms)]
        for stats in (mode.step(name), mode.step(name, "device_step_ms"), mode.timed.get(name)):
            stats = stats if stats and stats.median else None
            ratio = stats.median / train_ms if stats and train_ms else None
            row += [spread_cell(stats), "—" if ratio is None else f"{ratio:.3f}"]
            ratios += [] if ratio is None else [ratio]
        rows.append(row)
    if not rows:
        return "\n".join(["(no strategy both trained and profiled)", *warned(warnings)])
    headers = ["strategy", "train step ms", "profiled step ms (host)", "/ train", "profiled, on the device", "/ train"]
    headers += ["timed ms", "/ train"]
    text = [
        "`train step ms`: the median wall time per step that `make train` reports. `profiled step ms (host)`: "
        "the median [q1–q3] ProfilerStep of `make profile`; `on the device`: its steps from one step's first "
        "kernel to the next's (GPU only); `timed`: the steps `make profile` times after the profiler's window, "
        "with neither profiler nor regions.",
        "",
        markdown_table(headers, rows),
    ]
    if ratios:
        text += [
            "",
            f"Every profiled and timed step is within {100 * max(abs(r - 1) for r in ratios):.1f} % of training's.",
        ]
    if len(trained) > 1:
        first, *others = trained
        base = mode.labels[0] if mode.baseline else None
        for other in others:
            verdict = mode.step_verdicts.get(other) if base == first else None
            text += [
                "",
                f"{cell_text(other)} against {cell_text(first)}: training's steps give "
                f"{trained[first] / trained[other]:.3f}× ({cell_text(first)}'s step / {cell_text(other)}'s); the "
                f"profile's verdict on the step is {times(verdict)} "
                "(≈ where the interquartile ranges of the profiled steps overlap).",
            ]
    return "\n".join(text + warned(warnings))


def synced_section(work: Path, compare: ComparisonRecord) -> str:
    """padded profiled with synchronised regions, against its profile as training runs it."""
    found = sorted((work / "synced").glob(f"{SYNCED}/*/summary.json"))
    free = compare.modes["train"].step(SYNCED) if "train" in compare.modes else None
    if not found or not free:
        return "(no synchronised profile)"
    try:
        record = read_summary(found[-1])
    except RecordError as err:
        return f"(no synchronised profile: {cell_text(str(err))})"
    rows = [
        ["regions as training runs them", spread_cell(free), "—"],
        ["regions synchronised", spread_cell(record.stats("step")), spread_cell(record.stats("step", "sync_wait_ms"))],
    ]
    table = markdown_table([f"{SYNCED}, profiled", "step ms", "host waiting in the lab's syncs, ms"], rows)
    return "\n".join([table, "", profiler_note(record), *warned(record.left_out)])
