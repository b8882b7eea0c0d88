"""A profile run's record: summary.json, what `make profile` writes and every reader reads (compare, report,
TensorBoard, the Traces tab), as typed, versioned dataclasses. One schema, checked once, where a file is read.

    summary.json     ``ProfileRecord``: the run's facts, per region the spread of every measure over the
                     active steps (detector/lab/record/measures.py), each step's measures, the steps timed without
                     the profiler, the machine's noise, the analysis' warnings, where the run's wall clock went
    extract.json.gz  beside it: each active step as the lab models it (steps.py)

``read_summary`` returns the record or raises ``RecordError``, one line naming the file and what is wrong in it (a
field of the wrong type, a version this code does not read, a file too large). A summary of version 1 (written
before the noise was recorded) is converted: its noise is unknown. A value no measure can take (not finite,
negative, beyond 10^15) is left out with the part that holds it (a spread, a profiled step, the timed steps, the
noise), as if not measured, with a warning in ``left_out`` (detector/checked.py ``LeftOut``); but a profiled step's
wall time that is not such a value, or no usable profiled step, is refused: every reader times the run by its steps.
(A `make train` run's summary.json is detector/train/observe/summary.py's ``TrainingSummary``.)

A run is *loader-paced* (``ProfileRecord.loader_paced``) where its step waited for the loader at least
LOADER_PACED_SHARE of its time and, on a GPU, the device idled as long a share of it: the loader, not the step's
own work, set its time, and compare does not judge it against a run the loader did not pace.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from detector.checked import (
    CLOCK,
    LeftOut,
    RecordError,
    measure,
    measured,
    need,
    optional,
    read_json,
    short,
    usable,
    versioned,
    write_atomically,
)
from detector.lab.record.measures import format_value
from detector.lab.record.noise import DEVICE_BOUND_IDLE, Noise
from detector.lab.record.source import DataSource
from detector.lab.record.spread import Spread
from detector.regions import DATA_WAIT, STEP

VERSION = 2  # of summary.json; 1: no "version" key and no noise
SUMMARY = "summary.json"
MODES = ("train", "forward")
SUMMARY_BYTES = 64 * 2**20  # a summary of 10 steps is tens of kB; a larger file is not one
# A step that waits for its batch this share of its time or more is loader-paced (and on a GPU only where the device
# idles as long a share: a host that waits in the loader while the device still runs queued work costs the step
# nothing). 5 %: the spread beyond which a device-paced step is not a quiet machine's (noise.py NOISY_SPREAD), and the
# most by which a profile may differ from `make train`'s step; a loader that keeps ahead of a GPU leaves the device
# idle under DEVICE_BOUND_IDLE (the same 5 %). On the CPU the loader's own cost of handing over a batch counts too:
# it alone paces a step of a few milliseconds
LOADER_PACED_SHARE = 0.05


Measures = dict[str, dict[str, float | None]]  # region -> measure -> value of one step


@dataclass
class StepMeasures:
    """One active step: ProfilerStep#``step``, its start on the host (µs, the trace's clock) and every measure
    of each region (None: a GPU measure of a run without GPU events)."""

    step: int
    start_us: float
    regions: Measures

    @classmethod
    def parse(cls, data, where: str) -> StepMeasures:
        """RecordError unless every region has a wall time a step can take; Damaged for another measure that is no
        measure's value (a reader leaves the step out)."""
        need(data, dict, where)
        regions = need(data.get("regions"), dict, f"{where}.regions")
        if not isinstance(regions.get("step"), dict) or "wall_ms" not in regions["step"]:
            raise RecordError(f"{where}.regions.step has no wall_ms: a profiled step without its time")
        for name, measures in regions.items():
            need(measures, dict, f"{where}.regions.{name}")
            wall = measures.get("wall_ms", 0.0)
            if wall is None or not usable(wall):
                raise RecordError(f"{where}.regions.{name}.wall_ms is {short(wall)}: not a step's time in ms")
            for m in measures:
                measured(measures, m, f"{where}.regions.{name}")
        start = measured(data, "start_us", where, high=CLOCK, default=0.0)
        return cls(need(data.get("step"), int, f"{where}.step"), start, regions)


def device_paced(steps: list[StepMeasures]) -> bool:
    """Whether the device paced these steps: GPU steps whose median idle share is under DEVICE_BOUND_IDLE."""
    idle = [s.regions[STEP].get("gpu_idle_share") for s in steps]
    return bool(idle) and None not in idle and statistics.median(idle) < DEVICE_BOUND_IDLE


def representative_step(steps: list[StepMeasures]) -> StepMeasures:
    """The step whose wall time is the median (the lower of the two middle ones for an even count). Where the device
    paced the steps (``device_paced``), the host's steps jitter with the launch queue while the device's barely move:
    the step closest to both medians, the device step's and the wall time's (relative distances summed)."""
    walls = [s.regions[STEP]["wall_ms"] for s in steps]
    devices = [s.regions[STEP].get("device_step_ms") for s in steps]
    if not device_paced(steps) or not all(devices):
        return steps[walls.index(statistics.median_low(walls))]
    wall, device = statistics.median_low(walls), statistics.median_low(devices)
    distance = [abs(w - wall) / wall + abs(d - device) / device for w, d in zip(walls, devices, strict=True)]
    return steps[distance.index(min(distance))]


@dataclass
class Analysis:
    """What the trace says (detector/lab/measure/analysis.py): per region, the spread of each measure over the active
    steps; the step whose wall time is the median; the checks' warnings."""

    trace: str
    gpu: bool
    representative_step: int
    steps: int
    step_numbers: list[int]
    regions: dict[str, dict[str, Spread]]
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, data, where: str, found: LeftOut) -> Analysis:
        need(data, dict, where)
        regions = need(data.get("regions"), dict, f"{where}.regions")
        if not isinstance(regions.get("step"), dict) or "wall_ms" not in regions["step"]:
            raise RecordError(f"{where}.regions has no step wall time")
        parsed = {
            name: {
                m: found.part(Spread.parse, s, f"{where}.regions.{name}.{m}") or Spread()
                for m, s in need(ms, dict, name).items()
            }
            for name, ms in regions.items()
        }
        warnings = optional(data, "warnings", list, where, [])
        return cls(
            trace=optional(data, "trace", str, where, ""),
            gpu=optional(data, "gpu", bool, where, False),
            representative_step=need(data.get("representative_step"), int, f"{where}.representative_step"),
            steps=need(data.get("steps"), int, f"{where}.steps"),
            step_numbers=[
                need(n, int, f"{where}.step_numbers") for n in optional(data, "step_numbers", list, where, [])
            ],
            regions=parsed,
            warnings=[need(w, str, f"{where}.warnings") for w in warnings],
        )


@dataclass
class Timed:
    """The steps timed after the profiler's window with neither profiler nor regions: the step as training runs
    it (CUDA events on a GPU, the wall clock on the CPU)."""

    step_ms: Spread
    wall_ms: list[float]

    @classmethod
    def of(cls, values: list[float]) -> Timed:
        return cls(Spread.of(values), list(values))

    @classmethod
    def parse(cls, data, where: str) -> Timed:
        """RecordError for no object, Damaged for a time that is none (a reader leaves the timed steps out)."""
        need(data, dict, where)
        values = optional(data, "wall_ms", list, where, [])
        return cls(
            Spread.parse(data.get("step_ms", {}), f"{where}.step_ms"),
            [measure(v, f"{where}.wall_ms[{i}]") for i, v in enumerate(values)],
        )


@dataclass
class LoaderFill:
    """The loader when the profile's first step began (detector/lab/profile.py lets it fill first): its workers, the
    batches drawn and waiting, the most its ring holds, how long the fill took and its bound. 0 workers: each batch
    is drawn in its step, as in training, and there is nothing to fill."""

    workers: int
    waiting: int
    room: int
    seconds: float
    timeout: float

    def describe(self) -> str:
        if not self.workers:
            return "Loader: each batch is drawn in its step (data.num_workers=0), nothing is drawn ahead."
        loader = f"Loader (data.num_workers={self.workers})"
        if self.waiting >= self.room:
            return (
                f"{loader}: the ring was full, {self.waiting} of {self.room} batches waiting, "
                f"{self.seconds:.2f} s after the workers started, before the first step."
            )
        return (
            f"{loader}: {self.waiting} of {self.room} batches waiting when the {self.timeout:g} s bound on filling the "
            "ring ran out, before the first step: the first steps may wait for data."
        )

    @classmethod
    def parse(cls, data, where: str) -> LoaderFill:
        """RecordError for no object, Damaged for a count or time that is none."""
        need(data, dict, where)
        counts = {k: measure(data.get(k), f"{where}.{k}", kind=int) for k in ("workers", "waiting", "room")}
        times = {k: measure(data.get(k), f"{where}.{k}") for k in ("seconds", "timeout")}
        return cls(**counts, **times)


FIRST_STEP = "first step"  # RunTimes' part that the compile cache's note goes with


@dataclass
class RunTimes:
    """Where a profile run's wall clock went (detector/lab/profile.py): seconds by part, in the order the run first met
    each, one part after the other (so they sum to the run's, its TensorBoard events and the lines it prints aside);
    and what the first step found in the compiled step's cache (detector/train/run/speed_options.py), None where nothing
    compiles."""

    seconds: dict[str, float]
    compile_cache: str | None = None

    def describe(self) -> str:
        """``..., first step 12.3 s (compile cache 5 MiB loaded), 19 more steps 0.9 s, profiler stop 4 ms, trace
        written 2.1 s, ...``: every part, under 0.1 s in ms."""
        parts = []
        for name, seconds in self.seconds.items():
            took = f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1e3:.0f} ms"
            note = f" ({self.compile_cache})" if name == FIRST_STEP and self.compile_cache else ""
            parts.append(f"{name} {took}{note}")
        return ", ".join(parts)

    @classmethod
    def parse(cls, data, where: str) -> RunTimes:
        """RecordError for no object, Damaged for a part whose time is none."""
        need(data, dict, where)
        seconds = need(data.get("seconds"), dict, f"{where}.seconds")
        return cls(
            {name: measure(value, f"{where}.seconds.{name}") for name, value in seconds.items()},
            optional(data, "compile_cache", str, where),
        )


@dataclass
class ProfileRecord:
    """summary.json of a `make profile` run."""

    strategy: str
    mode: str
    device: str
    torch: str
    batch_size: int
    image_size: int | None
    max_boxes: int | None
    analysis: Analysis
    per_step: list[StepMeasures]
    timed: Timed | None = None
    noise: Noise | None = None
    preset: str | None = None
    sync_regions: bool = False
    emulated: str | None = None  # why its times are an emulator's here (triton without a GPU)
    run: str = ""
    created: str = ""
    trace: str = ""  # the trace file, relative to the run folder
    config: dict = field(default_factory=dict)
    data: DataSource | None = None  # where its boxes came from; None in summaries written before data.boxes
    loader_fill: LoaderFill | None = None  # the loader before the first step; None in summaries written before it
    times: RunTimes | None = None  # where the run's wall clock went; None in summaries written before it
    version: int = VERSION
    folder: Path | None = None  # where it was read from (not written)
    left_out: list[str] = field(default_factory=list)  # the damaged values' warnings, when it was read (not written)

    # ------------------------------------------------------------------ reading measures

    def stats(self, region: str, measure: str = "wall_ms") -> Spread | None:
        """The spread of a measure in a region (None where the run has no values there)."""
        found = self.analysis.regions.get(region, {}).get(measure)
        return found if found else None

    def median(self, region: str, measure: str = "wall_ms") -> float:
        found = self.stats(region, measure)
        return found.median if found else 0.0

    def timed_step(self) -> Spread | None:
        """The spread of the steps timed without the profiler, if the run has them."""
        return self.timed.step_ms if self.timed and self.timed.step_ms else None

    def profiled_step(self) -> Spread | None:
        """The profiled step as the one timed without the profiler is measured: by the device on a GPU (its steps
        from one's first kernel to the next's), else the host's ProfilerStep."""
        return self.stats("step", "device_step_ms") or self.stats("step")

    def regions(self) -> list[str]:
        return list(self.analysis.regions)

    def paced_by(self) -> str:
        """What paced the run's step: "device" where the GPU was busy nearly all of it (idle under
        DEVICE_BOUND_IDLE), else "host" (the CPU's step, or a GPU's that waits for Python's launches)."""
        idle = self.stats("step", "gpu_idle_share")
        return "device" if idle and idle.median < DEVICE_BOUND_IDLE else "host"

    def leading_time(self) -> str:
        """The measure that is a region's cost: on a GPU the device paces (``paced_by``), the GPU time of the work the
        region launched ("gpu_ms"): the host runs steps ahead and its wall time in a region is the time it took to
        launch it, or to wait for room in the launch queue. Elsewhere "wall_ms": on the CPU the host is the device,
        and a GPU that waits for the host is paced by the host's time."""
        return "gpu_ms" if self.analysis.gpu and self.paced_by() == "device" else "wall_ms"

    def pacing_text(self) -> str:
        """``paced by the device (GPU idle 0.4 % of the step; the host waited 9.1 ms a step for room in the launch
        queue)``: what paced the step, from the trace, and why."""
        idle, wait = self.stats(STEP, "gpu_idle_share"), self.stats(STEP, "queue_wait_ms")
        if not self.analysis.gpu or idle is None:
            return "paced by the host (no GPU: the host's time is the step's)"
        why = f"GPU idle {format_value('gpu_idle_share', idle.median)} of the step"
        if wait and wait.median:
            why += f"; the host waited {format_value('wall_ms', wait.median)} ms a step for room in the launch queue"
        return f"paced by the {self.paced_by()} ({why})"

    def loader_paced(self) -> str | None:
        """Why the loader paced the run's step (``data wait 14.9 ms, 39 % of the step; GPU idle 28 %``), or None where
        it did not (LOADER_PACED_SHARE): medians over the active steps."""
        wait, step = self.stats(DATA_WAIT), self.stats(STEP)
        if not (wait and step) or step.median <= 0 or wait.median < LOADER_PACED_SHARE * step.median:
            return None
        share = 100 * wait.median / step.median
        why = f"data wait {format_value('wall_ms', wait.median)} ms, {share:.0f} % of the step"
        if not self.analysis.gpu:
            return why
        idle = self.stats(STEP, "gpu_idle_share")
        if not idle or idle.median < LOADER_PACED_SHARE:
            return None
        return f"{why}; GPU idle {100 * idle.median:.0f} %"

    def noise_reasons(self) -> list[str]:
        """Why the run's times are not those of a quiet machine (its noise check; empty where it passes or its noise
        was not recorded). A host-paced step is held to the host's spread, whatever clock timed it."""
        return self.noise.reasons(self.paced_by()) if self.noise else []

    @property
    def noisy(self) -> bool:
        return bool(self.noise_reasons())

    def title(self) -> str:
        """``padded, train, NVIDIA H200, torch 2.11.0, batch 1024``: what a picture or table is of."""
        return f"{self.strategy}, {self.mode}, {self.device}, torch {self.torch}, batch {self.batch_size}"

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict:
        data = asdict(self)
        for key in ("folder", "left_out"):
            data.pop(key)
        data["analysis"]["regions"] = {
            region: {m: asdict(s) for m, s in measures.items()} for region, measures in self.analysis.regions.items()
        }
        return data

    @classmethod
    def parse(cls, data, where: str) -> ProfileRecord:
        """A record from parsed JSON; RecordError naming ``where`` and the first thing wrong."""
        versioned(data, where, VERSION)
        missing = [key for key in ("strategy", "mode", "analysis", "per_step") if key not in data]
        if missing:
            raise RecordError(f"{where}: no {', '.join(missing)}: not written by (this version of) make profile")
        found = LeftOut(where)
        strategy = need(data["strategy"], str, f"{where}: strategy")
        if not strategy:
            raise RecordError(f"{where}: its strategy is empty")
        if data["mode"] not in MODES:
            raise RecordError(f"{where}: mode {short(data['mode'])} is none of {', '.join(MODES)}")
        analysis = Analysis.parse(data["analysis"], f"{where}: analysis", found)
        if not analysis.regions["step"].get("wall_ms") or analysis.regions["step"]["wall_ms"].median <= 0:
            why = "; ".join(w.removeprefix(f"{where}: ") for w in found.warnings) or "no steps"
            raise RecordError(f"{where}: its step wall time is not usable ({why})")
        per_step = need(data["per_step"], list, f"{where}: per_step")
        before = len(found.warnings)
        try:
            steps = [found.part(StepMeasures.parse, s, f"per_step[{i}]") for i, s in enumerate(per_step)]
        except RecordError as err:
            raise RecordError(f"{where}: {err}") from None
        if not any(steps):
            damaged = [w.removeprefix(f"{where}: ") for w in found.warnings[before:]]
            more = f"; {len(damaged) - 1} more steps likewise" if len(damaged) > 1 else ""
            why = f"has no step whose measures are all usable ({damaged[0]}{more})" if per_step else "is empty"
            raise RecordError(f"{where}: per_step {why}: no profiled step to time the run by")
        timed, noise = data.get("timed"), data.get("noise")
        source = data.get("data")  # None in a summary written before data.boxes: the synthetic faces
        fill, times = data.get("loader_fill"), data.get("times")
        return cls(
            strategy=strategy,
            mode=data["mode"],
            device=optional(data, "device", str, where, "?"),
            torch=optional(data, "torch", str, where, "?"),
            batch_size=optional(data, "batch_size", int, where, 0),
            image_size=optional(data, "image_size", int, where),
            max_boxes=optional(data, "max_boxes", int, where),
            analysis=analysis,
            per_step=[s for s in steps if s is not None],
            timed=None if timed is None else found.part(Timed.parse, timed, f"{where}: timed"),
            noise=None if noise is None else found.part(Noise.parse, noise, f"{where}: noise"),
            preset=optional(data, "preset", str, where),
            sync_regions=optional(data, "sync_regions", bool, where, False),
            emulated=optional(data, "emulated", str, where),
            run=optional(data, "run", str, where, ""),
            created=optional(data, "created", str, where, ""),
            trace=optional(data, "trace", str, where, ""),
            config=optional(data, "config", dict, where, {}),
            data=None if source is None else found.part(DataSource.parse, source, f"{where}: data"),
            loader_fill=None if fill is None else found.part(LoaderFill.parse, fill, f"{where}: loader_fill"),
            times=None if times is None else found.part(RunTimes.parse, times, f"{where}: times"),
            left_out=found.warnings,
        )


def summary_path(path: Path) -> Path:
    return path if path.name == SUMMARY else path / SUMMARY


def read_summary(path) -> ProfileRecord:
    """The ProfileRecord of a run folder (or of its summary.json); RecordError with the reason otherwise."""
    file = summary_path(Path(path))
    record = ProfileRecord.parse(read_json(file, SUMMARY_BYTES), str(file))
    record.folder = file.parent
    return record


def write_summary(run_dir: Path, record: ProfileRecord) -> Path:
    path = Path(run_dir) / SUMMARY
    write_atomically(path, json.dumps(record.to_json(), indent=2).encode())
    return path
