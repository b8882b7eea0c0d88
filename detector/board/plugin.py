"""TensorBoard's "Traces" tab: profiled steps of several runs as lanes on one time axis, offline.

A dynamic TensorBoard plugin (registered through the ``tensorboard_plugins`` entry point in
pyproject.toml, so plain ``tensorboard --logdir runs`` shows it once the package is installed). The
frontend is one ES module shipped in the package, ``static/index.js``: no CDN, no network. It reads each
profile run's record and per-step extract (detector/lab/record.py, detector/lab/extract.py), not the trace.

Routes, under ``/data/plugin/traces/``:

- ``index.js``: the frontend;
- ``runs``: the profile runs under the log directory (a run is a folder with a `make profile`
  summary.json), each with its strategy, mode, device, steps and representative step; the runs that
  cannot be shown, each with a one-line reason; the lanes' colours and the measures' names and meanings;
- ``step?run=<run>&step=<N>``: one step's extract, and the names it refers to. A run without an
  extract is converted from its trace on first read.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from pathlib import Path

from tensorboard.plugins import base_plugin
from werkzeug import Response, wrappers

from detector.lab import extract
from detector.lab.measures import MEASURES, WHY
from detector.lab.record import EXTRACT, SUMMARY, RecordError, read_summary
from detector.lab.timeline import LAUNCH_COLOR, REGION_COLORS, SYNC_COLOR

PLUGIN_NAME = "traces"
SCRIPT = Path(__file__).with_name("static") / "index.js"
LISTING_SECONDS = 5.0  # how long a scan of the log directory is reused
CACHED_EXTRACTS = 16


class TracesPlugin(base_plugin.TBPlugin):
    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self.logdir = Path(context.logdir or ".")
        self.lock = threading.Lock()
        self.listing: tuple[float, dict] | None = None
        self.extracts: OrderedDict = OrderedDict()  # (run folder, mtime) -> extract

    def get_plugin_apps(self):
        return {"/index.js": self.serve_script, "/runs": self.serve_runs, "/step": self.serve_step}

    def is_active(self) -> bool:
        return bool(self.scan()["runs"])

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Traces", disable_reload=True)

    # ------------------------------------------------------------------------- routes

    @wrappers.Request.application
    def serve_script(self, request):
        return Response(SCRIPT.read_bytes(), content_type="text/javascript; charset=utf-8")

    @wrappers.Request.application
    def serve_runs(self, request):
        return json_response(self.scan(fresh=request.args.get("fresh") == "1"))

    @wrappers.Request.application
    def serve_step(self, request):
        run, step = request.args.get("run", ""), request.args.get("step", "")
        known = {r["run"]: r for r in self.scan()["runs"]}
        if run not in known:
            return json_response({"error": f"no profile run {run!r} under {self.logdir}"}, 404)
        try:
            found = self.extract(self.logdir / run)
        except (RecordError, ValueError) as err:
            return json_response({"error": str(err)}, 422)
        if step not in found["steps"]:
            steps = ", ".join(found["steps"])
            return json_response({"error": f"run {run!r} has no step {step!r} (its steps: {steps})"}, 404)
        return json_response(
            {"run": run, "step": int(step), "gpu": found["gpu"], "names": found["names"]} | found["steps"][step]
        )

    # ------------------------------------------------------------------------- data

    def scan(self, fresh: bool = False) -> dict:
        """The profile runs under the log directory and those that cannot be shown (cached a few seconds)."""
        with self.lock:
            if not fresh and self.listing and time.monotonic() - self.listing[0] < LISTING_SECONDS:
                return self.listing[1]
        runs, skipped = [], []
        for path in sorted(self.logdir.rglob(SUMMARY)) if self.logdir.is_dir() else []:
            run = path.parent.relative_to(self.logdir).as_posix()
            try:
                record = read_summary(path)
            except RecordError as err:
                if "not written by" not in str(err):  # a training run's summary or a comparison's: not a profile
                    skipped.append({"run": run, "reason": str(err).removeprefix(f"{path}: ")})
                continue
            reason = unshowable(path.parent, record)
            if reason:
                skipped.append({"run": run, "reason": reason})
                continue
            analysis = record.analysis
            runs.append(
                {
                    "run": run,
                    "strategy": record.strategy,
                    "mode": record.mode,
                    "device": record.device,
                    "torch": record.torch,
                    "batch_size": record.batch_size,
                    "created": record.created,
                    "steps": analysis.step_numbers,
                    "representative": analysis.representative_step,
                    "gpu": analysis.gpu,
                    "extract": (path.parent / EXTRACT).is_file(),
                }
            )
        runs.sort(key=lambda r: r["created"], reverse=True)  # newest first within a strategy: the tab ticks it
        runs.sort(key=lambda r: (r["mode"] != "train", r["strategy"] != "padded", r["strategy"]))
        listing = {
            "logdir": str(self.logdir),
            "runs": runs,
            "skipped": skipped,
            "colors": {"regions": REGION_COLORS, "launch": LAUNCH_COLOR, "sync": SYNC_COLOR},
            "measures": {
                name: {"header": m.header, "unit": m.unit, "meaning": m.meaning} for name, m in MEASURES.items()
            },
            "why": ["wall_ms", "gpu_ms", *WHY],
        }
        with self.lock:
            self.listing = (time.monotonic(), listing)
        return listing

    def extract(self, folder: Path) -> dict:
        """A run's extract, kept in memory while its file is unchanged (the last few runs read)."""
        path = folder / EXTRACT
        key = (folder, path.stat().st_mtime_ns if path.is_file() else None)
        with self.lock:
            if key in self.extracts:
                self.extracts.move_to_end(key)
                return self.extracts[key]
        found = extract.load(folder, read_summary(folder)).to_json()
        key = (folder, path.stat().st_mtime_ns if path.is_file() else None)
        with self.lock:
            self.extracts[key] = found
            while len(self.extracts) > CACHED_EXTRACTS:
                self.extracts.popitem(last=False)
        return found


def unshowable(folder: Path, record) -> str | None:
    """Why a profile run's steps cannot be drawn, or None (an older run without an extract is converted
    from its trace on first read)."""
    if (folder / EXTRACT).is_file():
        return None
    if not record.trace or not (folder / record.trace).is_file():
        return f"no {EXTRACT} and no trace to build one from"
    return None


def json_response(payload: dict, status: int = 200) -> Response:
    return Response(json.dumps(payload, separators=(",", ":")), status=status, content_type="application/json")
