"""compare.json: what `make compare` found (detector/lab/compare.py writes it; `make report` reads it again), as one
typed, versioned record. Per mode: the runs' column labels, every measure's spread per region and run, the steps
timed without the profiler, the speed-ups against ``padded``, the verdicts and the runs' warnings; and each run
compared, with where it came from.

``read_comparison`` returns the ``ComparisonRecord`` or raises ``RecordError``, one line naming the file and the
field; a spread or speed-up that is no measure's value is left out, with a warning in ``left_out``. Version 1 (no
``version`` key: written before the record was typed) has the same fields, less the ones added later
(``loader_paced``), which are read as absent.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from detector.checked import LeftOut, RecordError, need, optional, read_json, versioned, write_atomically
from detector.lab.record.source import DataSource
from detector.lab.record.spread import Spread

VERSION = 2  # 1: no "version" key
COMPARISON = "compare.json"
COMPARISON_BYTES = 64 * 2**20  # a comparison of every strategy in both modes is a few hundred kB


@dataclass
class ComparedRun:
    """One run of the comparison: its column's label, what it ran, where its folder is, and what flags it."""

    label: str
    strategy: str
    mode: str
    run: str = ""
    dir: str = ""
    noisy: bool | None = None  # None: its noise was not recorded
    noise: list[str] | None = None  # why it is noisy
    loader_paced: str | None = None  # why the loader set its time (None: it did not)
    max_boxes: int | None = None
    data: DataSource | None = None  # where its boxes came from, what its slots cut

    @classmethod
    def parse(cls, data, where: str, found: LeftOut) -> ComparedRun:
        need(data, dict, where)
        noise, source = data.get("noise"), data.get("data")
        return cls(
            label=need(data.get("label"), str, f"{where}.label"),
            strategy=need(data.get("strategy"), str, f"{where}.strategy"),
            mode=need(data.get("mode"), str, f"{where}.mode"),
            run=optional(data, "run", str, where, ""),
            dir=optional(data, "dir", str, where, ""),
            noisy=optional(data, "noisy", bool, where),
            noise=None if noise is None else [need(n, str, f"{where}.noise") for n in need(noise, list, where)],
            loader_paced=optional(data, "loader_paced", str, where),
            max_boxes=found.measure(data, "max_boxes", where, kind=int),
            data=None if source is None else found.part(DataSource.parse, source, f"{where}.data"),
        )


@dataclass
class ModeComparison:
    """compare.json's part for one mode (train or forward). Every table is keyed by the runs' labels."""

    labels: list[str]
    baseline: str | None  # the padded run the others are judged against (None: no padded run)
    regions: dict[str, dict[str, dict[str, Spread]]]  # region -> label -> measure -> spread over the active steps
    timed: dict[str, Spread | None] = field(default_factory=dict)  # label -> the steps timed without the profiler
    speedups_vs_padded: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)  # measure, region
    step_verdicts: dict[str, float | None] = field(default_factory=dict)  # label -> the profiled step's speed-up
    timed_verdicts: dict[str, float | None] = field(default_factory=dict)  # label -> the timed step's speed-up
    verdicts: list[str] = field(default_factory=list)
    warnings: dict[str, list[str]] = field(default_factory=dict)
    noisy: dict[str, bool] = field(default_factory=dict)
    loader_paced: dict[str, str | None] = field(default_factory=dict)

    def step(self, label: str, measure: str = "wall_ms") -> Spread | None:
        """The spread of ``label``'s profiled step in ``measure`` (None where it has none)."""
        found = self.regions.get("step", {}).get(label, {}).get(measure)
        return found if found else None

    @classmethod
    def parse(cls, data, where: str, found: LeftOut) -> ModeComparison:
        need(data, dict, where)

        def spread(value, at: str) -> Spread | None:
            return None if value is None else found.part(Spread.parse, value, at) or Spread()

        def labelled(key: str, kind) -> dict:
            values = optional(data, key, dict, where, {})
            return {label: optional(values, label, kind, f"{where}.{key}") for label in values}

        def speedups(values, at: str) -> dict[str, float | None]:
            return {label: found.measure(values, label, at) for label in need(values, dict, at)}

        regions = {
            region: {
                label: {
                    m: spread(s, f"{where}.regions.{region}.{label}.{m}")
                    for m, s in need(ms, dict, f"{where}.regions.{region}.{label}").items()
                }
                for label, ms in need(runs, dict, f"{where}.regions.{region}").items()
            }
            for region, runs in need(data.get("regions"), dict, f"{where}.regions").items()
        }
        by_measure = {
            measure: {
                region: speedups(values, f"{where}.speedups_vs_padded.{measure}.{region}")
                for region, values in need(by_region, dict, f"{where}.speedups_vs_padded.{measure}").items()
            }
            for measure, by_region in optional(data, "speedups_vs_padded", dict, where, {}).items()
        }
        timed = optional(data, "timed", dict, where, {})
        return cls(
            labels=[need(label, str, f"{where}.labels") for label in need(data.get("labels"), list, f"{where}.labels")],
            baseline=optional(data, "baseline", str, where),
            regions=regions,
            timed={label: spread(s, f"{where}.timed.{label}") for label, s in timed.items()},
            speedups_vs_padded=by_measure,
            step_verdicts=speedups(optional(data, "step_verdicts", dict, where, {}), f"{where}.step_verdicts"),
            timed_verdicts=speedups(optional(data, "timed_verdicts", dict, where, {}), f"{where}.timed_verdicts"),
            verdicts=[need(v, str, f"{where}.verdicts") for v in optional(data, "verdicts", list, where, [])],
            warnings={
                label: [need(w, str, f"{where}.warnings.{label}") for w in need(ws, list, f"{where}.warnings.{label}")]
                for label, ws in optional(data, "warnings", dict, where, {}).items()
            },
            noisy=labelled("noisy", bool),
            loader_paced=labelled("loader_paced", str),
        )


@dataclass
class ComparisonRecord:
    """compare.json: when and where the comparison was made, each mode's part, the runs compared and the files."""

    created: str
    out_dir: str
    modes: dict[str, ModeComparison] = field(default_factory=dict)
    runs: list[ComparedRun] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    version: int = VERSION
    left_out: list[str] = field(default_factory=list, compare=False)  # damaged values, when it was read (not written)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("left_out")
        return data

    @classmethod
    def parse(cls, data, where: str) -> ComparisonRecord:
        versioned(data, where, VERSION)
        if "modes" not in data:
            raise RecordError(f"{where}: no modes: not written by make compare")
        modes, runs = need(data["modes"], dict, f"{where}.modes"), optional(data, "runs", list, where, [])
        found = LeftOut(where)
        return cls(
            created=optional(data, "created", str, where, ""),
            out_dir=optional(data, "out_dir", str, where, ""),
            modes={mode: ModeComparison.parse(part, f"{where}.modes.{mode}", found) for mode, part in modes.items()},
            runs=[ComparedRun.parse(r, f"{where}.runs[{i}]", found) for i, r in enumerate(runs)],
            files=[need(f, str, f"{where}.files") for f in optional(data, "files", list, where, [])],
            left_out=found.warnings,
        )


def read_comparison(path) -> ComparisonRecord:
    """The comparison in a compare folder (or its compare.json); RecordError with the reason otherwise."""
    path = Path(path)
    file = path if path.name == COMPARISON else path / COMPARISON
    return ComparisonRecord.parse(read_json(file, COMPARISON_BYTES), str(file))


def write_comparison(out: Path, record: ComparisonRecord) -> Path:
    path = Path(out) / COMPARISON
    write_atomically(path, json.dumps(record.to_json(), indent=2).encode())
    return path
