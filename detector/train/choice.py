"""train.strategy=auto's choice as one typed, versioned record, ``Choice``: the candidates it timed in the training
step (each one's step times and peak memory rise), the strategy it chose, by which rule, and what choosing cost. The
choosing itself is run/auto.py's.

The record is kept in three places, each read back through ``read``:

- ``<train.out_dir>/strategy-auto/<key>.json`` (run/auto.py's ``kept_file``), beside the compile cache: the choice
  for these settings, which the next run of them takes at once (the key: the device, torch, the model and data
  configuration, the boxes' source, the speed options and the candidates asked for);
- ``<run>/strategy-auto.json``: the run's own, which a resumed run reports;
- summary.json's ``auto`` (train/observe/summary.py).

``read`` raises RecordError, one line naming the file and the field, for a file that is not such a record.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from detector.checked import RecordError, measure, measured, need, optional, read_json, versioned, write_atomically

VERSION = 1
RUN_FILE = "strategy-auto.json"  # in the run folder
CHOICE_BYTES = 2**20  # a few candidates of a few dozen steps: a few kB
# what the rules are called in the record, and said in the line
FASTER, SMALLER, MEDIAN = "faster", "smaller peak memory", "faster median"
# a peak rise within this factor of the least is as little: at seed scale the step's peak is the model's activations,
# and the candidates' rises differ by kilobytes out of gigabytes, which must not decide
MEMORY_ALIKE = 1.05


@dataclass
class Candidate:
    """One candidate as it was timed: the ms of its timed steps and the step's peak memory rise (bytes allocated at its
    peak above those allocated before the timed steps; None where the device keeps no peak: the CPU)."""

    strategy: str
    step_ms: list[float]
    peak_rise_bytes: int | None = None

    @property
    def quartiles(self) -> tuple[float, float, float]:
        """(q1, median, q3) of the timed steps, by the lab's rule (the inclusive method, as lab/record/spread.py)."""
        if len(self.step_ms) < 2:
            return self.step_ms[0], self.step_ms[0], self.step_ms[0]
        q1, median, q3 = statistics.quantiles(self.step_ms, n=4, method="inclusive")
        return q1, median, q3

    @property
    def median(self) -> float:
        return self.quartiles[1]

    def overlaps(self, other: Candidate) -> bool:
        """Whether the two interquartile ranges share a point: the lab's one rule, which cannot tell them apart then."""
        (a1, _, a3), (b1, _, b3) = self.quartiles, other.quartiles
        return a1 <= b3 and b1 <= a3

    def times(self) -> str:
        """``28.8 [28.7–29.0]``: the median ms and the interquartile range."""
        q1, median, q3 = self.quartiles
        return f"{ms(median)} [{ms(q1)}–{ms(q3)}]"

    @classmethod
    def parse(cls, data, where: str) -> Candidate:
        need(data, dict, where)
        steps = need(data.get("step_ms"), list, f"{where}.step_ms")
        if not steps:
            raise RecordError(f"{where}.step_ms is empty, expected the timed steps' ms")
        return cls(
            strategy=need(data.get("strategy"), str, f"{where}.strategy"),
            step_ms=[measure(v, f"{where}.step_ms[{i}]") for i, v in enumerate(steps)],
            peak_rise_bytes=measured(data, "peak_rise_bytes", where, kind=int),
        )


@dataclass
class Choice:
    """What train.strategy=auto chose and why. ``source``: how this run came by it: ``measured`` (here), ``kept``
    (the file of these settings, ``file``), or ``resumed`` (the run's own checkpoint, at ``resumed_at``)."""

    strategy: str
    rule: str  # FASTER; SMALLER (its [q1–q3] overlaps the fastest's); MEDIAN (it does, and memory cannot decide)
    candidates: list[Candidate]  # in the order they were timed: the ranking's
    ranking: str  # where the candidates came from: train.auto_candidates, or `make shapes`' prediction
    timed_steps: int  # per candidate, after its warm-up steps
    warm_steps: int
    short_run: bool  # fewer timed steps than a full measure: the run is short (auto.py's budget)
    seconds: float  # choosing, all of it: the ranking, each candidate's step built, warmed and timed
    ranking_seconds: float  # of which the ranking (make shapes' prediction: its cheap timing of each strategy)
    device: str
    torch: str
    source: str = "measured"
    file: str | None = None
    resumed_at: int | None = None
    left_out: list[str] = field(default_factory=list)  # candidates that could not be timed, and why: out of memory
    # of ``seconds``, the step's first call (the first candidate's): its compile, which the run then takes over (its
    # own first step compiles nothing more), and which a run of the chosen strategy pays as well
    compile_seconds: float = 0.0
    version: int = VERSION

    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.strategy == self.strategy), None)

    def line(self) -> str:
        """The line a run starts with: what auto chose and why, or where it came from."""
        start = f"strategy auto: {self.strategy}"
        if self.source == "resumed":
            return f"{start}, as this run chose at its start (its checkpoint at step {self.resumed_at})"
        if self.source == "kept":
            return f"{start}, kept for these settings in {self.file} (delete it to measure again): {self.why()}"
        return f"strategy auto: {self.why()}"

    def why(self) -> str:
        """``packed — 28.8 [28.7–28.9] ms a step against padded 29.1 [29.1–29.2]; 10 timed steps each, chosen in
        6.1 s``, with the rule where the spreads overlap."""
        if self.chosen() is None:  # a record without its measure: its strategy alone
            return self.strategy
        left = f"; left out: {', '.join(self.left_out)}" if self.left_out else ""
        short = " (fewer: a short run)" if self.short_run else ""
        steps = f"{self.timed_steps} timed steps each{short}; chosen in {self.seconds:.1f} s{self.cost()}"
        return f"{reason(self.candidates, self.strategy, self.rule, self.device)}{left}; {steps}"

    def cost(self) -> str:
        """``: 4.1 s ranking, 35.2 s the step's first call (its compile, which a run pays anyway), 8.0 s timing``
        (the parts that were measured; the timing: the rest, the step's build and the candidates' rings included)."""
        parts = [f"{self.ranking_seconds:.1f} s ranking"] if self.ranking_seconds > 0 else []
        if self.compile_seconds > 0:  # 0: a record from before this part was measured
            parts.append(f"{self.compile_seconds:.1f} s the step's first call (its compile, which a run pays anyway)")
        rest = self.seconds - self.ranking_seconds - self.compile_seconds
        return f": {', '.join(parts)}, {rest:.1f} s timing" if parts else ""

    def table(self) -> str:
        """The candidates as a markdown table, the chosen first, with the line: TensorBoard's Text tab."""
        rows = [
            "| candidate | step ms, median | [q1–q3] | min–max | steps | peak rise |",
            "|---|---|---|---|---|---|",
        ]
        for c in sorted(self.candidates, key=lambda c: (c.strategy != self.strategy, c.median)):
            q1, median, q3 = c.quartiles
            name = f"**{c.strategy}** (chosen)" if c.strategy == self.strategy else c.strategy
            peak = size(c.peak_rise_bytes) if c.peak_rise_bytes is not None else "not measured"
            rows.append(
                f"| {name} | {ms(median)} | {ms(q1)}–{ms(q3)} | {ms(min(c.step_ms))}–{ms(max(c.step_ms))} | "
                f"{len(c.step_ms)} | {peak} |"
            )
        notes = [
            self.line(),
            f"Candidates: {self.ranking}. Each timed in the training step after {self.warm_steps} warm-up steps, "
            f"on {self.device}, torch {self.torch}.",
        ]
        return "\n".join(rows) + "\n\n" + "\n\n".join(notes)

    def to_json(self) -> dict:
        return asdict(self)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.to_json(), indent=2).encode())

    @classmethod
    def parse(cls, data, where: str) -> Choice:
        versioned(data, where, VERSION)
        rows = need(data.get("candidates"), list, f"{where}.candidates")
        rule = need(data.get("rule"), str, f"{where}.rule")
        if rule not in (FASTER, SMALLER, MEDIAN):
            raise RecordError(f"{where}.rule is {rule!r}, expected one of {FASTER}, {SMALLER}, {MEDIAN}")
        return cls(
            strategy=need(data.get("strategy"), str, f"{where}.strategy"),
            rule=rule,
            candidates=[Candidate.parse(c, f"{where}.candidates[{i}]") for i, c in enumerate(rows)],
            ranking=need(data.get("ranking"), str, f"{where}.ranking"),
            timed_steps=measure(data.get("timed_steps"), f"{where}.timed_steps", kind=int),
            warm_steps=measure(data.get("warm_steps"), f"{where}.warm_steps", kind=int),
            short_run=need(data.get("short_run"), bool, f"{where}.short_run"),
            seconds=measure(data.get("seconds"), f"{where}.seconds"),
            ranking_seconds=measure(data.get("ranking_seconds"), f"{where}.ranking_seconds"),
            device=need(data.get("device"), str, f"{where}.device"),
            torch=need(data.get("torch"), str, f"{where}.torch"),
            source=optional(data, "source", str, where, "measured"),
            file=optional(data, "file", str, where),
            resumed_at=measured(data, "resumed_at", where, kind=int),
            left_out=[need(v, str, f"{where}.left_out") for v in optional(data, "left_out", list, where, [])],
            compile_seconds=measured(data, "compile_seconds", where, default=0.0),
        )


def read(path: Path) -> Choice:
    """The choice in ``path``; RecordError with the reason otherwise."""
    return Choice.parse(read_json(path, CHOICE_BYTES), str(path))


def decide(candidates: list[Candidate]) -> tuple[str, str]:
    """(the strategy to train with, the rule that chose it): the fastest median; where others' [q1–q3] overlap its, the
    one of them whose step rose least in memory; where no memory was measured (the CPU), or several rose as little,
    the fastest median (of those)."""
    group = tied(candidates)
    if len(group) == 1:
        return group[0].strategy, FASTER
    if any(c.peak_rise_bytes is None for c in group):
        return group[0].strategy, MEDIAN
    least = least_memory(group)
    return min(least, key=lambda c: c.median).strategy, SMALLER if len(least) == 1 else MEDIAN


def least_memory(group: list[Candidate]) -> list[Candidate]:
    """The candidates of ``group`` whose step's peak rise is within MEMORY_ALIKE of the least (each one measured)."""
    least = min(c.peak_rise_bytes for c in group)
    return [c for c in group if c.peak_rise_bytes <= MEMORY_ALIKE * least]


def tied(candidates: list[Candidate]) -> list[Candidate]:
    """The fastest median, then the candidates whose [q1–q3] overlaps its: those the timing cannot tell from it."""
    fastest = min(candidates, key=lambda c: c.median)
    return [fastest] + [c for c in candidates if c is not fastest and c.overlaps(fastest)]


def reason(candidates: list[Candidate], strategy: str, rule: str, device: str) -> str:
    """``packed — 28.8 [28.7–28.9] ms a step against padded 29.1 [29.1–29.2]``: the chosen ``strategy``'s times
    against the others', and where ``rule`` is not FASTER, those it could not be told from and what decided."""
    best = next(c for c in candidates if c.strategy == strategy)
    alike = [c for c in tied(candidates) if c is not best] if rule != FASTER else []
    apart = [c for c in candidates if c is not best and c not in alike]
    text = f"{best.strategy} — {best.times()} ms a step"
    if alike:
        text += f", not distinguishable from {listed(alike)} (the [q1–q3] overlap): "
        text += memory_reason(best, alike) if rule == SMALLER else f"the {MEDIAN}, {memory_alike(best, alike, device)}"
    return text + (f"{';' if alike else ''} against {listed(apart)}" if apart else "")


def listed(candidates: list[Candidate]) -> str:
    return ", ".join(f"{c.strategy} {c.times()}" for c in candidates)


def memory_reason(best: Candidate, alike: list[Candidate]) -> str:
    """``the step's peak memory rise 1.3× smaller (1.2 GiB against 1.6 GiB)``: against the least of the others."""
    other = min(alike, key=lambda c: c.peak_rise_bytes)
    mine, theirs = best.peak_rise_bytes, other.peak_rise_bytes
    ratio = f"{theirs / mine:.3g}× smaller" if mine > 0 else "smaller"
    return f"the step's peak memory rise {ratio} ({size(mine)} against {other.strategy}'s {size(theirs)})"


def memory_alike(best: Candidate, alike: list[Candidate], device: str) -> str:
    """Why memory did not decide: not measured, or as little in several."""
    if best.peak_rise_bytes is not None and all(c.peak_rise_bytes is not None for c in alike):
        rises = [c.peak_rise_bytes for c in least_memory([best, *alike])]
        low, high = size(min(rises)), size(max(rises))
        span = low if low == high else f"{low} to {high}: within {MEMORY_ALIKE - 1:.0%} of the least"
        return f"of those whose step's peak memory rise is least ({span})"
    return "as memory is not measured on the CPU" if device == "cpu" else "as memory was not measured"


def ms(x: float) -> str:
    """Milliseconds to three significant figures: ``28.8``, ``1.23``, ``123``."""
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
