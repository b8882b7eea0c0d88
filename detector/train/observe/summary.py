"""A training run's summary.json: one typed, versioned record, ``TrainingSummary``, that `make train` writes
(run/training_loop.py ``summarise``) and every reader reads through ``read``: the lab (curves, the strategy sweep, the
report), the scaling table (detector/bench/sharding.py) and the run folders (run/folder.py). It holds what the run
trained, its final loss and metrics, its step times and images/s, the loss of every step, where the wall clock went
(wallclock.py), the checkpoints' times (checkpoints/writer.py) and train.strategy=auto's choice (choice.py);
``done_line`` is the run's last line.

``read`` raises RecordError, one line naming the file and the field, for a file that is not such a record. Version 1
(no ``version`` key: written before the record was typed) is read as it is: what it lacks (the wall clock, the
checkpoints, the memory peak, ...) is None, as is ``auto`` in a file written before it. Its measures (times, rates,
bytes, counts; the losses may be NaN: a run whose loss went non-finite) are checked by value: a damaged one is None, a
damaged value in the wall clock, the checkpoints or the choice leaves that part out (None), a damaged history point that
point, each with a warning in ``left_out``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from detector.checked import (
    LeftOut,
    RecordError,
    measure,
    measured,
    need,
    optional,
    read_json,
    short,
    versioned,
    write_atomically,
)
from detector.train.choice import Choice
from detector.train.observe.wallclock import Account

VERSION = 2  # 1: no "version" key
SUMMARY = "summary.json"
SUMMARY_BYTES = 64 * 2**20  # the loss of every step of a long run is a few MB; a larger file is not one
Metrics = dict[str, float]  # an evaluation's (detector/train/evaluate/metrics.py): mean_iou, recall50, loss, boxes, ...


@dataclass
class Save:
    """One committed checkpoint: its step, bytes (every process's), the step's wait and the seconds to commit."""

    step: int
    bytes: int
    blocked_s: float
    written_s: float | None


@dataclass
class Checkpoints:
    """What the run's summary keeps of its checkpoints (``Checkpointer.record``, process 0's)."""

    saves: list[Save]
    disk_bytes_per_s: float | None = None
    staging_bytes: int = 0
    staging_pinned: bool = False
    pin_s: float | None = None
    host_peak_bytes: int | None = None  # this process's peak resident memory over the whole run

    @classmethod
    def parse(cls, data, where: str) -> Checkpoints:
        """RecordError for a part of another shape, Damaged for a value no field of its kind holds."""
        need(data, dict, where)
        saves = []
        for i, save in enumerate(need(data.get("saves", []), list, f"{where}.saves")):
            at = f"{where}.saves[{i}]"
            need(save, dict, at)
            saves.append(
                Save(
                    step=measure(save.get("step"), f"{at}.step", kind=int),
                    bytes=measure(save.get("bytes"), f"{at}.bytes", kind=int),
                    blocked_s=measure(save.get("blocked_s"), f"{at}.blocked_s"),
                    written_s=measured(save, "written_s", at),
                )
            )
        return cls(
            saves=saves,
            disk_bytes_per_s=measured(data, "disk_bytes_per_s", where),
            staging_bytes=measured(data, "staging_bytes", where, kind=int, default=0),
            staging_pinned=optional(data, "staging_pinned", bool, where, False),
            pin_s=measured(data, "pin_s", where),
            host_peak_bytes=measured(data, "host_peak_bytes", where, kind=int),
        )


@dataclass
class TrainingSummary:
    """summary.json of a `make train` run. Times in ms, by the wall clock (data waits included) and, on a GPU, by the
    device, medians over the steps past the first ones (progress.py ``throughput``); None where none was timed."""

    history: list[tuple[int, float]]  # (step, the mean loss of the log window ending there)
    losses: list[float] = field(default_factory=list)  # every step's, from the first
    experiment: str = ""
    run: str = ""
    strategy: str = "?"
    device: str = "?"
    world_size: int = 1
    global_batch: int = 0
    steps: int = 0
    resumed_at: int = 0
    final_loss: float = math.nan
    eval: Metrics = field(default_factory=dict)  # the last evaluation's
    evals: list[tuple[int, Metrics]] = field(default_factory=list)
    step_ms: float | None = None
    device_step_ms: float | None = None
    device_idle_ms: float | None = None
    data_wait_ms: float | None = None
    images_per_s: float | None = None
    device_images_per_s: float | None = None
    timed_steps: int = 0
    peak_memory_gib: float | None = None  # the GPU's peak of allocated memory (rank 0's); None on the CPU
    checkpoint_step: int = -1
    eval_step: int = 0
    wall_clock: Account | None = None
    checkpoints: Checkpoints | None = None
    auto: Choice | None = None  # train.strategy=auto's choice (train/choice.py); None: the strategy was named
    version: int = VERSION
    left_out: list[str] = field(default_factory=list, compare=False)  # damaged values, when it was read (not written)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("left_out")
        return data

    def write(self, path: Path) -> None:
        """``path`` holds this summary or what it held before, whenever the process is stopped (Ctrl-C, kill)."""
        write_atomically(path, json.dumps(self.to_json(), indent=2).encode())

    @classmethod
    def parse(cls, data, where: str) -> TrainingSummary:
        """The record of parsed JSON; RecordError naming ``where`` and the first field of the wrong shape."""
        versioned(data, where, VERSION)
        if "history" not in data:
            raise RecordError(f"{where}: no loss curve (history): not written by make train")
        found = LeftOut(where)
        wall, saves, auto = data.get("wall_clock"), data.get("checkpoints"), data.get("auto")
        evals = pairs(data.get("evals", []), f"{where}.evals", found)

        def number(key: str) -> float | None:
            return found.measure(data, key, where)

        def count(key: str, default: int, low: int = 0) -> int:
            return found.measure(data, key, where, low, kind=int, default=default)

        return cls(
            history=pairs(data["history"], f"{where}.history", found, (int, float)),
            losses=[need(v, (int, float), f"{where}.losses") for v in optional(data, "losses", list, where, [])],
            experiment=optional(data, "experiment", str, where, ""),
            run=optional(data, "run", str, where, ""),
            strategy=optional(data, "strategy", str, where, "?"),
            device=optional(data, "device", str, where, "?"),
            world_size=count("world_size", 1, low=1),
            global_batch=count("global_batch", 0),
            steps=count("steps", 0),
            resumed_at=count("resumed_at", 0),
            final_loss=optional(data, "final_loss", (int, float), where, math.nan),
            eval=metrics(optional(data, "eval", dict, where, {}), f"{where}.eval"),
            evals=[(step, metrics(m, f"{where}.evals")) for step, m in evals],
            step_ms=number("step_ms"),
            device_step_ms=number("device_step_ms"),
            device_idle_ms=number("device_idle_ms"),
            data_wait_ms=number("data_wait_ms"),
            images_per_s=number("images_per_s"),
            device_images_per_s=number("device_images_per_s"),
            timed_steps=count("timed_steps", 0),
            peak_memory_gib=number("peak_memory_gib"),
            checkpoint_step=count("checkpoint_step", -1, low=-1),  # -1: none
            eval_step=count("eval_step", 0),
            wall_clock=None if wall is None else found.part(Account.parse, wall, f"{where}.wall_clock"),
            checkpoints=None if saves is None else found.part(Checkpoints.parse, saves, f"{where}.checkpoints"),
            auto=None if auto is None else found.part(Choice.parse, auto, f"{where}.auto"),
            left_out=found.warnings,
        )


def pairs(data, where: str, found: LeftOut, kind=dict) -> list[tuple[int, object]]:
    """``[[step, value], ...]`` as (step, value) pairs, each value of ``kind``; a pair whose step is no step is left
    out (``found``)."""
    kept = (found.part(pair, p, f"{where}[{i}]", kind) for i, p in enumerate(need(data, list, where)))
    return [p for p in kept if p is not None]


def pair(data, where: str, kind) -> tuple[int, object]:
    if not isinstance(data, list) or len(data) != 2:
        raise RecordError(f"{where} is {short(data)}, expected [step, value]")
    return measure(data[0], where, kind=int), need(data[1], kind, where)


def metrics(data, where: str) -> Metrics:
    return {name: need(value, (int, float), f"{where}.{name}") for name, value in need(data, dict, where).items()}


def read(path) -> TrainingSummary:
    """The summary of a run folder (or its summary.json); RecordError with the reason otherwise."""
    path = Path(path)
    file = path if path.name == SUMMARY else path / SUMMARY
    return TrainingSummary.parse(read_json(file, SUMMARY_BYTES), str(file))


def done_line(run_dir: Path, summary: TrainingSummary, device: torch.device) -> str:
    """The run's last line: the final loss and the throughput (on a GPU, the device's beside the wall clock's)."""
    line = (
        f"done: {run_dir}  final loss {summary.final_loss:.4f}  median step {summary.step_ms:.1f} ms  "
        f"{summary.images_per_s:.0f} img/s by the wall clock"
    )
    if device.type == "cuda":
        line += (
            f" ({summary.device_images_per_s:.0f} by device time; device idle between steps "
            f"{summary.device_idle_ms:.1f} ms)"
        )
    if summary.wall_clock:
        line += f"\n      {summary.wall_clock.line()}"
    return line
