"""TensorBoard's "Traces" tab: profiled steps of several runs as lanes on one time axis, offline.

A dynamic TensorBoard plugin (registered through the ``tensorboard_plugins`` entry point in
pyproject.toml, so plain ``tensorboard --logdir runs`` shows it once the package is installed). The
frontend is a handful of ES modules shipped in the package, ``static/*.js``: no CDN, no network. It reads each
profile run's record and per-step extract (detector/lab/record/run.py, detector/lab/measure/extract.py), not the trace.

Routes, under ``/data/plugin/traces/``:

- ``index.js`` and the modules it imports: each file of static/ by its exact name, nothing else;
- ``runs``: the profile runs under the log directory (a run is a folder with a `make profile`
  summary.json), each with its strategy, mode, device, steps and representative step, the clock its steps are
  timed by (``clock``: "device" where the GPU paced the step, else "wall") and each step's time on it (``step_ms``),
  what paced it (``paced``), and the warnings of what its summary and extract left out (a damaged value:
  detector/checked.py); the runs that cannot be shown, each with a one-line reason; the lanes' colours and the
  measures' names and meanings;
- ``step?run=<run>&step=<N>``: one step's extract, and the names it refers to. A run without an
  extract is converted from its trace on first read.

What it reads and writes stays in the log directory: every path goes through ``inside``, which resolves links,
so a linked summary or extract that leads out of it, or a summary whose trace lies outside its run folder, is
not read; a built extract is written only into the run's own folder, through no link. Each file is read under
the record's cap on its decompressed size. Bad input is a 4xx with ``{"error": reason}``; a run that cannot be
read is listed among ``skipped`` with its reason, beside the others. Every answer is strict JSON (no NaN or
Infinity, which a browser cannot parse): the records' readers leave such values out.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from tensorboard.plugins import base_plugin
from werkzeug import Response, wrappers

from detector.checked import RecordError
from detector.lab.measure import extract
from detector.lab.measure.trace import COLLECTIVE_PREFIXES
from detector.lab.present.timeline import LAUNCH_COLOR, REGION_COLORS, SYNC_COLOR
from detector.lab.record.measures import MEASURES, MEMORY, WHY
from detector.lab.record.run import SUMMARY, ProfileRecord, read_summary, representative_step
from detector.lab.record.steps import EXTRACT, read_extract
from detector.regions import STEP as WHOLE_STEP

PLUGIN_NAME = "traces"
STATIC = Path(__file__).with_name("static")
# The page's modules by their exact names, fixed when the plugin loads: no part of a request reaches the file system.
MODULES = {f"/{path.name}": path for path in sorted(STATIC.glob("*.js"))}
NOSNIFF = {"X-Content-Type-Options": "nosniff"}  # a browser takes each answer as the type it says it is
LISTING_SECONDS = 5.0  # how long a scan of the log directory is reused
ANSWER_BYTES = 64 * 2**20  # the steps' answers kept in memory, the last runs read first
STEP = re.compile(r"[0-9]{1,12}")
RANK = re.compile(r"rank([0-9]{1,6})")  # a rank's folder in a run of several processes (lab/profile.py)


class TracesPlugin(base_plugin.TBPlugin):
    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self.logdir = Path(context.logdir or ".")
        self.lock = threading.Lock()
        self.listing: tuple[float, dict, dict[str, Path]] | None = None  # (when, what /runs says, run -> summary)
        self.answers: OrderedDict = OrderedDict()  # (run folder, extract's stat) -> {step: JSON bytes}
        self.left_out: dict[tuple, list[str]] = {}  # (run folder, extract's stat) -> what reading it left out

    def get_plugin_apps(self):
        modules = {route: module_app(path) for route, path in MODULES.items()}
        return modules | {"/runs": self.serve_runs, "/step": self.serve_step}

    def is_active(self) -> bool:
        return bool(self.scan()["runs"])

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Traces", disable_reload=True)

    # ------------------------------------------------------------------------- routes

    @wrappers.Request.application
    def serve_runs(self, request):
        return json_response(self.scan(fresh=request.args.get("fresh") == "1"))

    @wrappers.Request.application
    def serve_step(self, request):
        run, step = request.args.get("run", ""), request.args.get("step", "")
        if not run:
            return json_response({"error": "run: missing, expected ?run=<a run listed by ./runs>&step=<N>"}, 400)
        if not STEP.fullmatch(step):
            return json_response({"error": f"step: {step[:40]!r} is not a step number, expected ?step=<N>"}, 400)
        summary = self.summary(run)
        if summary is None:
            return json_response({"error": f"no profile run {run[:200]!r} under {self.logdir}"}, 404)
        try:
            steps = self.steps(run, summary)
        except Exception as err:  # whatever is wrong in a run's files: a reason, not a 500
            return json_response({"error": self.reason(err, run)}, 422)
        key = str(int(step))
        if key not in steps:
            known = ", ".join(steps) or "none"
            return json_response({"error": f"run {run!r} has no step {step!r} (its steps: {known})"}, 404)
        return Response(steps[key], content_type="application/json", headers=NOSNIFF)

    # ------------------------------------------------------------------------- data

    def scan(self, fresh: bool = False) -> dict:
        """The profile runs under the log directory and those that cannot be shown (cached a few seconds)."""
        with self.lock:
            if not fresh and self.listing and time.monotonic() - self.listing[0] < LISTING_SECONDS:
                return self.listing[1]
        runs, skipped, summaries = [], [], {}
        for path in sorted(self.logdir.rglob(SUMMARY)) if self.logdir.is_dir() else []:
            run = path.parent.relative_to(self.logdir).as_posix()
            try:
                record, files = run_files(self.logdir, path)
                reason = unshowable(record, files)
            except Exception as err:  # whatever is wrong in one run's files: that run is skipped, not the list
                if "not written by" not in str(err):  # a training run's summary or a comparison's: not a profile
                    skipped.append({"run": run, "reason": self.reason(err, run)})
                continue
            if reason:
                skipped.append({"run": run, "reason": reason})
                continue
            warnings = record.left_out + self.extract_left_out(files.folder)
            runs.append(listed(run, record, files) | {"warnings": [self.relative(w, run) for w in warnings]})
            summaries[run] = path
        ranks = Counter(run["group"] for run in runs)  # a run of one process is a group of one
        newest = {}  # a run of several ranks is as new as its last rank's record
        for run in runs:
            run["ranks"] = ranks[run["group"]] if run["rank"] is not None else None
            newest[run["group"]] = max(newest.get(run["group"], ""), run["created"])
        # newest first within a strategy (the tab ticks it), a run's ranks in order
        runs.sort(key=lambda r: (newest[r["group"]], r["group"], -(r["rank"] or 0)), reverse=True)
        # a run under profile.sync_regions (the article's protocol, which make report adds) after the strategy's
        # runs as training runs it: the tab ticks what training runs
        runs.sort(key=lambda r: (r["mode"] != "train", r["strategy"] != "padded", r["strategy"], r["synced"]))
        listing = {
            "logdir": str(self.logdir),
            "runs": runs,
            "skipped": skipped,
            "colors": {"regions": REGION_COLORS, "launch": LAUNCH_COLOR, "sync": SYNC_COLOR},
            "collectives": list(COLLECTIVE_PREFIXES),  # a GPU stream of these kernels alone is labelled so
            "measures": {
                name: {"header": m.header, "unit": m.unit, "meaning": m.meaning} for name, m in MEASURES.items()
            },
            "why": ["wall_ms", "gpu_ms", *WHY, *MEMORY],
        }
        with self.lock:
            self.listing = (time.monotonic(), listing, summaries)
        return listing

    def extract_left_out(self, folder: Path) -> list[str]:
        """What reading a run's extract left out (read again only when it changes); nothing where it has none yet, or
        one that cannot be read: its steps' requests say why."""
        key = version(folder)
        with self.lock:
            if key in self.left_out:
                return self.left_out[key]
        try:
            found = read_extract(folder / EXTRACT).left_out if key[1] is not None else []
        except RecordError:
            found = []
        with self.lock:
            self.left_out[key] = found
        return found

    def summary(self, run: str) -> Path | None:
        """The summary.json of a run the listing shows: a request's run is looked up, never made into a path."""
        self.scan()
        with self.lock:
            return self.listing[2].get(run)

    def steps(self, run: str, summary: Path) -> dict[str, bytes]:
        """A run's steps as /step answers them, kept while its extract is unchanged (the last runs read, within
        ANSWER_BYTES). Its files are checked again: the listing is a few seconds old."""
        record, files = run_files(self.logdir, summary)
        key = version(files.folder)
        with self.lock:
            if key in self.answers:
                self.answers.move_to_end(key)
                return self.answers[key]
        found = extract.load(files.folder, record, files.trace, keep=files.keep)
        head = {"run": run, "gpu": found.gpu, "names": found.names}
        steps = {n: strict_json(head | {"step": int(n)} | step.to_json()) for n, step in found.steps.items()}
        with self.lock:
            self.answers[version(files.folder)] = steps  # the extract just written, where it was
            while len(self.answers) > 1 and sum(map(answer_bytes, self.answers.values())) > ANSWER_BYTES:
                self.answers.popitem(last=False)
        return steps

    def reason(self, err: Exception, run: str) -> str:
        """One line of why a run cannot be shown, its paths relative to the log directory."""
        text = str(err) if isinstance(err, RecordError) else f"cannot be read ({type(err).__name__}: {err})"
        text = self.relative(text, run)
        return text.removeprefix(f"{SUMMARY}: ").splitlines()[0] if text else type(err).__name__

    def relative(self, text: str, run: str) -> str:
        """``text`` with the paths of ``run``'s files relative to its folder, the others' to the log directory."""
        for root in {str(self.logdir.resolve()), str(self.logdir)}:
            text = text.replace(f"{root}/{run}/", "").replace(f"{root}/", "")
        return text


# ----------------------------------------------------------------------------- a run's files


def inside(root: Path, path: Path) -> Path | None:
    """``path`` with its links resolved if it lies in ``root`` (resolved too), else None: the one rule for every
    file the tab reads or writes, so that neither a link nor an absolute or ``../`` path leads out of ``root``."""
    try:
        real, top = Path(path).resolve(), Path(root).resolve()
    except (OSError, RuntimeError):  # a loop of links
        return None
    return real if real.is_relative_to(top) else None


@dataclass(frozen=True)
class RunFiles:
    """A profile run's files, their links resolved: its folder (inside the log directory); its trace, inside
    that folder (None: it names none, or one outside the folder, ``trace_outside``, which is not read); whether
    an extract built from it may be written there."""

    folder: Path
    trace: Path | None
    trace_outside: bool
    keep: bool


def run_files(logdir: Path, summary: Path) -> tuple[ProfileRecord, RunFiles]:
    """The record of the run whose summary.json is ``summary``, and its files; RecordError with the reason the
    tab may not read them."""
    folder, real = inside(logdir, summary.parent), inside(logdir, summary)
    if folder is None or real is None:
        raise RecordError(f"its {SUMMARY} is a link that leads out of the log directory: not read")
    if inside(logdir, folder / EXTRACT) is None:
        raise RecordError(f"its {EXTRACT} is a link that leads out of the log directory: not read")
    record = read_summary(real)
    trace = inside(folder, folder / record.trace) if record.trace else None
    return record, RunFiles(folder, trace, bool(record.trace) and trace is None, writable(folder))


def writable(folder: Path) -> bool:
    """Whether an extract may be written into ``folder``: neither its name nor that of the file record.write_extract
    writes first and renames is a link, which would carry the write elsewhere."""
    return all(inside(folder, folder / name) == folder / name for name in (EXTRACT, f".{EXTRACT}.new"))


def unshowable(record: ProfileRecord, files: RunFiles) -> str | None:
    """Why a profile run's steps cannot be drawn, or None (an older run without an extract is converted
    from its trace on first read)."""
    if (files.folder / EXTRACT).is_file():
        return None
    if files.trace_outside:
        return f"no {EXTRACT}, and its trace {record.trace[:200]!r} lies outside the run's folder: not read"
    if files.trace is None or not files.trace.is_file():
        return f"no {EXTRACT} and no trace to build one from"
    return None


def listed(run: str, record: ProfileRecord, files: RunFiles) -> dict:
    """A run as /runs lists it; one rank's of a run of several processes (``<run>/rank<N>``) names its ``rank``
    and the ``group`` of the ranks it ran with, whose steps the tab draws on one axis. Its steps are timed as the
    lab's tables lead (``ProfileRecord.leading_time``): by the device where the GPU paced the step (each step's
    ``device_step_ms``, from its first kernel to the next step's; the host ran ahead, launching), else by the wall
    clock (the host's ProfilerStep)."""
    analysis = record.analysis
    parent, _, name = run.rpartition("/")
    rank = RANK.fullmatch(name)
    steps = {s.step: s.regions.get(WHOLE_STEP, {}) for s in record.per_step}
    device = record.leading_time() == "gpu_ms" and all(m.get("device_step_ms") for m in steps.values())
    clock, measure = ("device", "device_step_ms") if device else ("wall", "wall_ms")
    times = {n: m[measure] for n, m in steps.items() if m.get(measure) is not None}
    # the step the card's timeline and compare's chart show (on a device-paced run the step nearest the medians of the
    # device step and the wall time: the first of equal device steps may be one the host rushed through)
    representative = representative_step(record.per_step).step if record.per_step else analysis.representative_step
    return {
        "run": run,
        "rank": int(rank.group(1)) if rank else None,
        "group": parent if rank else run,
        "strategy": record.strategy,
        "mode": record.mode,
        "device": record.device,
        "torch": record.torch,
        "batch_size": record.batch_size,
        "created": record.created,
        "steps": analysis.step_numbers,
        "representative": representative,
        "clock": clock,
        "step_ms": {str(n): ms for n, ms in times.items()},
        "paced": record.pacing_text(),
        "gpu": analysis.gpu,
        "synced": record.sync_regions,
        "extract": (files.folder / EXTRACT).is_file(),
    }


def version(folder: Path) -> tuple:
    """Which extract a run folder holds: it changes when the extract is written again."""
    try:
        stat = (folder / EXTRACT).stat()
    except OSError:
        return (folder, None, None)  # none: built from the trace on each read where it cannot be kept
    return (folder, stat.st_size, stat.st_mtime_ns)


def answer_bytes(steps: dict[str, bytes]) -> int:
    return sum(len(body) for body in steps.values())


# ----------------------------------------------------------------------------- responses


def module_app(path: Path):
    """The WSGI app of one of the page's modules."""

    @wrappers.Request.application
    def serve(request):
        return Response(path.read_bytes(), content_type="text/javascript; charset=utf-8", headers=NOSNIFF)

    return serve


def strict_json(payload: dict) -> bytes:
    """``payload`` as JSON a browser parses: a value that is not finite is a ValueError here, not NaN there."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def json_response(payload: dict, status: int = 200) -> Response:
    return Response(strict_json(payload), status=status, content_type="application/json", headers=NOSNIFF)
