"""``bench memory`` (``make bench TARGET=memory``): what each strategy costs in memory on this machine, in one command.

Its parts, each a process of its own under a time limit (PART_SECONDS; all of them within TOTAL_SECONDS), in order:

1. ``make profile`` of each strategy (bench.strategies, default STRATEGIES) with the memory measures, on a short
   schedule (the per-image loop shorter still: its trace is the largest);
2. ``make compare`` of them: the verdicts, led by memory, and the memory per region side by side;
3. a child process (detector/bench/ceiling.py) under the default allocator, for a crowd file (detector/bench/crowd.py,
   written here: hundreds of faces an image, data.max_boxes=1024, data.over_max_boxes=fit) and then the synthetic
   faces: the caching allocator under each strategy's dynamic shapes after warm-up, and the ceiling, the largest
   batch each strategy trains at before the device runs out of memory (one model a source serves both, compiled
   once);
4. the allocator again, in a child under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts),
   which finds the graphs the first child compiled in inductor's cache.

A part that fails or runs out of its time is a line in the document, not the end of it: what it measured stays. The
parts run in ``<dir of bench.out>/memory-work/current/`` (traces, the crowd file, the children's results); a run
stopped before its end resumes there with the same configuration, a finished one is renamed after its time. The
proof is a new ``<dir of bench.out>/memory/<time>/`` of six files, each far under 16 MiB: memory.md (every table),
memory.json (every figure), compare.md, memory-train.png (the bytes over each median step), runs.tar.gz (the profiles'
summary.json, extract.json.gz and TensorBoard events, for the Traces tab: ``tar xzf runs.tar.gz && make tensorboard
ARGS="--logdir runs"``) and memory.log (every part's output). On the CPU the ceiling and the allocator's figures say
why they are none: the CPU allocator neither caches, reserves nor runs out of a device's memory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from detector.bench.ceiling import MEASURED, PROBE_STEPS, RESOLUTION, WARMUP, ChildResults, Jobs
from detector.bench.crowd import write_crowd
from detector.checked import RecordError, write_atomically
from detector.config.device import device_name, resolve_device
from detector.config.schema import load_config
from detector.lab.children import Child, run_child
from detector.lab.folders import new_run_dir, prepare_work
from detector.lab.measure.allocator import EXPANDABLE
from detector.lab.present.tables import cell_text, code_block, markdown_table
from detector.lab.record.measures import memory_text
from detector.lab.record.provenance import machine_line, now, run_info
from detector.lab.record.run import SUMMARY
from detector.lab.record.steps import EXTRACT

STRATEGIES = ("padded", "packed", "concat", "loop")  # one of each layout, and the per-image loop beside concat
SHORT = ("loop",)  # seconds a step at seed scale, and the largest trace: the shortest schedule
PROFILE = ["profile.wait=2", "profile.warmup=1", "profile.active=3", "profile.timed=3"]
SHORT_PROFILE = ["profile.wait=1", "profile.warmup=1", "profile.active=2", "profile.timed=2"]
# seconds each part may run (a process start, the model's build and compile included), and all of them: under the
# ten minutes of a GPU call, with time for the document
PART_SECONDS = {"profile": 150, "profile loop": 200, "compare": 90, "default": 330, "expandable": 150}
TOTAL_SECONDS = 570
LAST_PART_SECONDS = 60  # kept for each part still to come when one starts
TOP_LEVEL = ("device", "autocast")  # the config's keys outside its sections (preset: always passed)
SECTIONS = ("data", "model", "train")  # what the profiles and the children take of this command's configuration


def config_args(cfg: DictConfig) -> list[str]:
    """``preset=`` this configuration's, and ``key=value`` of each value of SECTIONS and the top-level keys that
    differs from that preset's defaults on this machine: a child given them runs exactly this configuration."""
    default = load_config([f"preset={cfg.preset}"], announce=None)
    args = [f"preset={cfg.preset}"]
    args += [f"{key}={dotvalue(cfg[key])}" for key in TOP_LEVEL if cfg[key] != default[key]]
    for name in SECTIONS:
        values, defaults = (OmegaConf.to_container(c[name], resolve=True) for c in (cfg, default))
        args += [f"{name}.{key}={dotvalue(v)}" for key, v in values.items() if v != defaults.get(key)]
    return args


def dotvalue(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(dotvalue(v) for v in value) + "]"
    return str(value)


def plan(cfg: DictConfig, device, work: Path, strategies: list[str], crowd: Path) -> list[Child]:
    """The bench's parts (see the module docstring), with what each runs."""
    args = config_args(cfg)
    parts = []
    for name in strategies:
        schedule = SHORT_PROFILE if name in SHORT else PROFILE
        profile = ["-m", "detector", "profile", f"profile.strategy={name}", f"profile.out_dir={work / 'profile'}"]
        seconds = PART_SECONDS["profile loop" if name in SHORT else "profile"]
        profile += ["profile.profile_memory=true", *schedule, *args]
        parts.append(Child(f"profile {name}", profile, seconds, done=work / "profile" / name / "done"))
    compare = ["-m", "detector", "compare", "--dir", str(work / "profile"), "--out", str(work / "compare")]
    parts.append(Child("compare", compare, PART_SECONDS["compare"], done=work / "compare" / "compare.json"))
    sources = {"crowd": f"crowd:{crowd}", "synthetic": "synthetic"}  # the crowd first: its shapes change most
    allocator = {s: [[sources[s], n, "allocator"] for n in strategies] for s in sources}
    ceiling = {s: [[sources[s], n, "ceiling"] for n in strategies] for s in sources}
    children = {
        "default": (allocator["crowd"] + ceiling["crowd"] + allocator["synthetic"] + ceiling["synthetic"], None)
    }
    if device.type == "cuda":  # the CPU's allocator has no setting to compare
        children["expandable"] = (allocator["crowd"] + allocator["synthetic"], EXPANDABLE)
    for name, (jobs, conf) in children.items():
        jobs_file = work / f"jobs-{name}.json"
        Jobs(jobs).write(jobs_file)
        child = ["-m", "detector", "ceiling", f"--out={work / f'{name}.json'}", f"--jobs={jobs_file}", *args]
        title = "allocator and ceiling, default allocator" if name == "default" else f"allocator, {EXPANDABLE}"
        parts.append(Child(title, child, PART_SECONDS[name], {"PYTORCH_CUDA_ALLOC_CONF": conf}, work / f"{name}.done"))
    return parts


def run_part(part: Child, log, seconds: float) -> dict:
    """Run one part within ``seconds`` (lab/children.py), its output into ``log``; what became of it."""
    args = part.args
    if args[:3] == ["-m", "detector", "ceiling"]:  # the child shares its time among its jobs: it is told how much
        args = args[:5] + [f"--seconds={max(10.0, seconds - 30):.0f}"] + args[5:]  # its last write within the limit
    ran = run_child(replace(part, args=args, seconds=seconds), log)
    return {"title": ran.title, "command": ran.command, "state": ran.state, "seconds": ran.seconds}


def run_bench(cfg: DictConfig) -> dict:
    device = resolve_device(cfg)
    strategies = list(cfg.bench.strategies) or list(STRATEGIES)
    root = Path(cfg.bench.out).parent
    work = prepare_work(root / "memory-work", config_args(cfg))
    crowd = work / "crowd_bbx_gt.txt"
    if not crowd.exists():
        write_crowd(crowd)
    parts = plan(cfg, device, work, strategies, crowd)
    deadline = time.monotonic() + TOTAL_SECONDS
    ran = []
    # the device is named only once the children are done: this process holds no CUDA context while they measure
    print(f"bench memory on {device}: {len(parts)} parts, at most {TOTAL_SECONDS} s in all, in {work}/")
    with open(work / "memory.log", "a") as log:
        for i, part in enumerate(parts):
            if part.done is not None and part.done.exists():
                ran.append({"title": part.title, "state": "done in an earlier run", "seconds": 0.0, "command": ""})
                continue
            later = LAST_PART_SECONDS * sum(1 for p in parts[i + 1 :] if not (p.done and p.done.exists()))
            seconds = min(part.seconds, deadline - time.monotonic() - later)
            if seconds < 10:
                ran.append({"title": part.title, "state": "not run: no time left", "seconds": 0.0, "command": ""})
                continue
            print(f"[{i + 1}/{len(parts)}] {part.title} (at most {seconds:.0f} s) ...", flush=True)
            ran.append(run_part(part, log, seconds))
            print(
                f"[{i + 1}/{len(parts)}] {part.title}: {ran[-1]['state']} after {ran[-1]['seconds']:.0f} s", flush=True
            )
    return finish(cfg, device, work, root, strategies, ran)


# ----------------------------------------------------------------------------- the document


def finish(cfg: DictConfig, device, work: Path, root: Path, strategies: list[str], ran: list[dict]) -> dict:
    """The proof folder (see the module docstring); the work folder renamed after its time once every part is done."""
    results = {**run_info(device), "target": "memory", "created": now(), "parts": ran, "strategies": strategies}
    results["children"] = {s: read_child(work / f"{s}.json") for s in ("default", "expandable")}
    out = new_run_dir(root / "memory")
    compare = work / "compare"
    for name in ("compare.md", "memory-train.png"):
        if (compare / name).exists():
            shutil.copy(compare / name, out / name)
    pack_runs(work / "profile", out / "runs.tar.gz")
    text = document(cfg, device, work, results)
    (out / "memory.md").write_text(text + "\n")
    # every value is JSON's own (strings, numbers, the children's records as read): no ``default`` to hide another
    write_atomically(out / "memory.json", json.dumps(results, indent=1).encode())
    shutil.copy(work / "memory.log", out / "memory.log")
    print(text)
    if all(p["state"].startswith("done") for p in ran):
        final = new_run_dir(work.parent)
        os.replace(work, final)  # onto the new, empty folder: its time's name, and no other run's
        work = final
    sizes = ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in sorted(out.iterdir()))
    print(f"\nbench memory: {out}/ ({sizes}); its work in {work}/")
    return results


def read_child(path: Path) -> dict | None:
    """A child's results (``ChildResults``), None where it wrote none; one that cannot be read is a warning naming the
    file and the field, and none."""
    if not path.exists():
        return None
    try:
        return ChildResults.read(path).to_json()
    except RecordError as err:
        print(f"warning: {err}: left out", file=sys.stderr)
        return None


def pack_runs(profiles: Path, path: Path) -> None:
    """The profiles' records, extracts and TensorBoard events (no traces: they are the large files) as
    ``runs/profile/<strategy>/<time>/...`` in a gzipped tar."""
    with tarfile.open(path, "w:gz") as tar:
        for summary in sorted(profiles.glob(f"*/*/{SUMMARY}")):
            run = summary.parent
            for file in [summary, run / EXTRACT, *run.glob("events.out.*")]:
                if file.exists():
                    tar.add(file, arcname=f"runs/profile/{file.relative_to(profiles)}")


def document(cfg: DictConfig, device, work: Path, results: dict) -> str:
    """memory.md: the machine, the parts and their times, the verdicts and memory tables of the profiles, the ceiling
    and the allocator tables."""
    lines = [
        f"# Memory on {device_name(device)}",
        "",
        cell_text(machine_line(device)),
        "",
        f"Written by `python -m detector bench memory` on {now()[:10]}, at most {TOTAL_SECONDS} s in all; its parts:",
        "",
        markdown_table(
            ["part", "state", "s"],
            [[p["title"], p["state"], f"{p['seconds']:.0f}"] for p in results["parts"]],
            "llr",
        ),
        "",
        "Its commands:",
        "",
        *code_block([p["command"] for p in results["parts"] if p["command"]]),
    ]
    compare = work / "compare" / "compare.md"
    if compare.exists():
        text = compare.read_text()
        lines += ["", "## The profiles: verdicts", "", section_body(text, "### Verdicts")]
        lines += ["", "## The profiles: memory per region", "", section_body(text, "### Memory")]
        lines += ["", "![the bytes allocated over each strategy's median step](memory-train.png)"]
    children = results["children"]
    default, expandable = children["default"], children["expandable"]
    lines += ["", "## The ceiling: the largest batch that trains", ""] + ceiling_lines(default, cfg)
    lines += ["", "## The allocator under dynamic shapes", ""] + allocator_lines(default, expandable, device)
    return "\n".join(lines)


def section_body(text: str, heading: str) -> str:
    """The first section of ``text`` whose heading line starts with ``heading`` (to the next heading of its level),
    without its heading line."""
    start = text.find(f"\n{heading}")
    if start < 0:
        return "(not in compare.md)"
    body = text.index("\n", start + 1)
    end = text.find(f"\n{heading.split(' ')[0]} ", body)
    return text[body : end if end >= 0 else len(text)].strip()


def jobs_of(child: dict | None, part: str) -> list[dict]:
    return [j for j in (child or {}).get("jobs", []) if j["job"][2] == part]


def source_label(source: str, slots) -> str:
    return f"synthetic faces, {slots} slots" if source == "synthetic" else f"crowd file, {slots} slots (fit)"


def ceiling_lines(child: dict | None, cfg: DictConfig) -> list[str]:
    jobs = jobs_of(child, "ceiling")
    if not jobs:
        return ["Not measured: its child left no result (its part above says why)."]
    reasons = {job.get("error") for job in jobs}
    if len(reasons) == 1 and None not in reasons:  # one reason for all (the CPU's): said once
        return [f"None: {cell_text(reasons.pop())}."]
    rows = []
    for job in jobs:
        source, name, _ = job["job"]
        if "error" in job:
            rows.append([source_label(source, job.get("slots", "?")), name, job["error"], "", "", "", ""])
            continue
        found = job["ceiling"]
        probes = found["probes"]
        best = max((p for p in probes if p["fits"]), key=lambda p: p["batch"], default=None)
        largest = (f"≥ {found['largest']:,}" if found["stopped"] else f"{found['largest']:,}") if best else "none"
        failure = f"{found['first_failure']:,}" if found["first_failure"] else "—"
        peak = memory_text(best["peak"]) if best and best.get("peak") else "—"
        seconds = f"{sum(p['seconds'] for p in probes):.1f}"
        note = found["stopped"] or ""
        rows.append([source_label(source, job["slots"]), name, largest, failure, peak, f"{len(probes)}", seconds])
        rows[-1][-1] = f"{seconds}" + (f" ({note})" if note else "")
    headers = ["source", "strategy", "largest batch that trains", "first that did not", "its peak", "probes", "s"]
    return [
        f"Each batch trains {PROBE_STEPS} steps of the configured step (batch {cfg.data.batch_size} first), then the "
        f"next batch is where its bytes per image say the device fills, then halfway between the largest "
        f"that trained and the first that did not, to within {RESOLUTION:.0%}. A batch that ran out of memory is "
        "freed and the search goes on; `≥` where the search's share of the time ran out first.",
        "",
        markdown_table(headers, rows, "llrrrrl"),
    ]


ALLOCATOR_KEYS = ("reserved_free", "device_mallocs", "device_frees", "retries", "peak")


def allocator_lines(default: dict | None, expandable: dict | None, device) -> list[str]:
    rows, by = [], {}
    for child in (default, expandable):
        for job in jobs_of(child, "allocator"):
            source, name, _ = job["job"]
            key = (child["setting"], source, name)
            row = job.get("allocator") or {}
            by[key] = row
            cells = (
                [none_or(row.get(k), k) for k in ALLOCATOR_KEYS] if "allocator" in job else [job["error"], *[""] * 4]
            )
            rows.append([child["setting"], source_label(source, job.get("slots", "?")), name, *cells])
    if not rows:
        return ["Not measured: no child left a result (the parts above say why)."]
    headers = ["PYTORCH_CUDA_ALLOC_CONF", "source", "strategy", "reserved free at the step's end", "device mallocs"]
    headers += ["device frees", "retries", "peak allocated"]
    lines = [
        f"Medians over {MEASURED} steps after {WARMUP} of warm-up at the configured batch, each step on other images "
        "and box counts; the caching allocator's own figures (torch.cuda.memory_stats), per step.",
        "",
        markdown_table(headers, rows, "lllrrrrr"),
    ]
    if device.type != "cuda":
        return lines + ["", "None on the CPU: c10's CPU allocator neither caches, reserves nor retries."]
    return lines + ["", *setting_verdicts(by)]


def none_or(value, key: str) -> str:
    if value is None:
        return "none"
    return memory_text(value) if key in ("reserved_free", "peak") else f"{value:g}"


def setting_verdicts(by: dict) -> list[str]:
    """Per source and strategy measured under both settings: what expandable segments changed; then whether it
    helped everywhere."""
    lines, helped, hurt = [], [], []
    for (setting, source, name), row in by.items():
        other = by.get((EXPANDABLE, source, name))
        if setting != "default" or not other or row.get("reserved_free") is None or other.get("reserved_free") is None:
            continue
        a, b = row["reserved_free"], other["reserved_free"]
        mallocs = f"device mallocs per step {row['device_mallocs']:g} → {other['device_mallocs']:g}"
        lines.append(f"- {name}, {source.split(':')[0]}: reserved free {memory_text(a)} → {memory_text(b)}; {mallocs}.")
        (helped if b < a or other["device_mallocs"] < row["device_mallocs"] else hurt).append(
            f"{name} ({source.split(':')[0]})"
        )
    if not lines:
        return ["(no strategy measured under both settings)"]
    verdict = (
        f"**expandable_segments:True** held less reserved-but-free memory or made fewer device mallocs for "
        f"{', '.join(helped) or 'none'}; not for {', '.join(hurt) or 'none'}."
    )
    return [verdict, "", *lines]
