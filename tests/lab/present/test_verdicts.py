"""Verdicts (detector/lab/present/verdicts.py) on synthetic records: the counts no load changes lead, the time follows
by the speed-up rule, a noisy run's times are not judged, and where the profile disagrees with training the line says
what the profiler added to each side."""

import pytest

from detector.lab.present.verdicts import (
    count_diffs,
    growth,
    judge,
    judge_all,
    moved_most,
    profiler_note,
    verdict_lines,
)
from detector.lab.record.noise import Noise
from detector.lab.record.run import Analysis, ProfileRecord, StepMeasures, Timed
from detector.lab.record.spread import Spread

QUIET = Noise(cores=2, load_before=0.0, load_during=0.03, load_after=0.0, timed_spread=0.02)
BUSY = Noise(cores=2, load_before=1.9, load_during=1.95, load_after=1.9, timed_spread=0.3)


def spread(median: float, width: float = 0.01) -> Spread:
    return Spread(median, median * (1 - width), median * (1 + width), median * (1 - width), median * (1 + width), 10)


def record(
    strategy: str,
    regions: dict[str, dict[str, float]],
    timed_ms: float | None,
    noise: Noise | None = QUIET,
    idle: float | None = None,
    device_step: float | None = None,
    batch: int = 128,
    width: float = 0.01,
) -> ProfileRecord:
    """A CPU (or, with ``device_step``, GPU) record whose regions have the medians given, ±``width``; the step is
    their sum."""
    regions = {name: dict(measures) for name, measures in regions.items()}
    step = {m: sum(r.get(m, 0.0) for r in regions.values()) for m in ("wall_ms", "ops", "slices", "gpu_ms")}
    if idle is not None:
        step["gpu_idle_share"] = idle
    if device_step is not None:
        step["device_step_ms"] = device_step
    regions["step"] = step
    spreads = {name: {m: spread(v, width) for m, v in measures.items()} for name, measures in regions.items()}
    per_step = [StepMeasures(n, 0.0, regions) for n in range(10)]
    analysis = Analysis("t.json", device_step is not None, 5, 10, list(range(10)), spreads)
    timed = Timed(spread(timed_ms, width), [timed_ms] * 10) if timed_ms else None
    return ProfileRecord(strategy, "train", "cpu", "2.13", batch, 16, 64, analysis, per_step, timed, noise)


PADDED = {
    "calc loss": {"wall_ms": 1.0, "ops": 129, "slices": 10},
    "backward": {"wall_ms": 7.0, "ops": 276, "slices": 8},
}
CONCAT = {
    "calc loss": {"wall_ms": 1.8, "ops": 603, "slices": 266},
    "backward": {"wall_ms": 9.0, "ops": 2694, "slices": 518},
}


def test_a_verdict_leads_with_the_counts_and_then_the_time():
    line = judge(record("padded", PADDED, 10.0), record("concat", CONCAT, 12.0), "concat").line()
    assert line.startswith(
        "- **concat** — backward: 65× the slices (518 against 8), 9.8× the operators (2694 against 276); "
        "calc loss: 27× the slices (266 against 10), 4.7× the operators (603 against 129). "
        "As training runs it: 1.2× slower (concat 12 [11.9–12.1] ms against padded's 10 [9.9–10.1])"
    )
    assert line.endswith("most of it in backward (+2 ms). Traces tab: align on *backward*.")


def test_a_noisy_run_keeps_its_counts_and_says_its_times_cannot_be_judged():
    """Both cores busy with other work: the times spread and overlap, the counts are what they always are."""
    base = record("padded", PADDED, 10.0, noise=BUSY, width=0.3)
    run = record("concat", CONCAT, 14.0, noise=BUSY, width=0.3)
    line = judge(base, run, "concat").line()
    assert "calc loss: 27× the slices (266 against 10), 4.7× the operators (603 against 129)" in line
    assert (
        "Times as training runs it not judged, the noise check flags them — padded's run: other processes kept "
        "1.9 of 2 " in line
    )
    assert "its timed steps spread ±15 % around their median" in line
    assert "(concat 14 [9.8–18.2] ms against padded's 10 [7–13])" in line
    assert "Traces tab: align on *backward*." in line  # where the counts differ most: the times cannot tell


def test_a_gap_wider_than_any_noise_is_judged_on_a_busy_machine_and_says_the_machine_was_flagged():
    """The loop's step is 60× padded's: two busy loops spread a run by 60 %, they cannot make that."""
    base = record("padded", PADDED, 10.0, noise=BUSY, width=0.3)
    run = record("loop", CONCAT, 600.0, noise=BUSY, width=0.3)
    line = judge(base, run, "loop").line()
    assert "As training runs it: 60× slower (loop 600 [420–780] ms against padded's 10 [7–13])" in line
    assert "; a gap beyond the noise the check flags — padded's run: other processes kept 1.9 of 2 cores" in line
    # at 1.9× the quartiles' gap (13 against 24.5) noise could still explain it
    slower = judge(base, record("concat", CONCAT, 35.0, noise=BUSY, width=0.3), "concat").line()
    assert "Times as training runs it not judged, the noise check flags them" in slower


def test_a_gpu_step_paced_by_the_host_is_held_to_the_hosts_spread():
    """concat on a quiet GPU: the device idles 83 % of the step while Python launches; its CUDA-event times spread
    with the host's scheduling (±4 %), which is no busy machine. padded keeps the device busy and is held to 5 %."""
    uneven = Noise(cores=16, load_before=0.0, load_during=0.02, load_after=0.0, timed_spread=0.08, timed_by="device")
    concat = record("concat", CONCAT, 124.0, noise=uneven, idle=0.83, device_step=124.0)
    padded = record("padded", PADDED, 29.4, noise=uneven, idle=0.01, device_step=29.4)
    assert concat.paced_by() == "host" and not concat.noisy and concat.noise_reasons() == []
    assert padded.paced_by() == "device" and padded.noise_reasons() == [
        "its timed steps spread ±4 % around their median"
    ]
    cpu = record("concat", CONCAT, 12.0, noise=Noise(cores=2, timed_spread=0.2))  # no GPU: the host's threshold
    assert cpu.paced_by() == "host" and not cpu.noisy


def test_times_the_rule_cannot_tell_apart_are_called_so_with_their_spreads():
    base = record("padded", PADDED, 10.0, width=0.2)
    line = judge(base, record("concat", CONCAT, 11.0, width=0.2), "concat").line()
    assert (
        "As training runs it: not distinguishable on this machine (concat 11 [8.8–13.2] ms against padded's 10 [8–12])."
        in line
    )


def test_where_the_profile_disagrees_the_training_verdict_leads_and_the_profilers_cost_is_said():
    """As training runs it the two are the same; profiled, the strategy that dispatches more operators is slower:
    the profiler added more to it."""
    base = record("packed", {"calc loss": {"wall_ms": 1.0, "ops": 445}}, 24.5)
    run = record("padded", {"calc loss": {"wall_ms": 1.5, "ops": 699}}, 24.6)
    line = judge(base, run, "padded").line()
    assert "As training runs it: not distinguishable on this machine" in line
    assert "Profiled: 1.5× slower, because the profiler added" in line
    assert "the training verdict stands." in line
    base_cost, run_cost = judge(base, run, "padded").costs
    assert base_cost == pytest.approx(1.0 / 24.5 - 1) and run_cost == pytest.approx(1.5 / 24.6 - 1)


def test_counts_that_barely_differ_are_not_named():
    base = record("padded", {"calc loss": {"wall_ms": 1.0, "ops": 129, "slices": 10}}, 10.0)
    run = record("triton", {"calc loss": {"wall_ms": 1.0, "ops": 132, "slices": 0}}, 10.0)
    diffs = count_diffs(base, run)
    assert [(d.region, d.measure, d.text()) for d in diffs] == [("calc loss", "slices", "no slices against 10")]


def test_a_busy_device_is_explained_by_its_gpu_time_in_the_verdicts_direction():
    """Both steps keep the device busy: the host waited on a full launch queue in the backward (its wall time
    there doubled) while the loss's kernels got faster. The verdict is faster, so the explanation names the
    region that gained, by GPU ms, not the one whose host wall time grew."""
    base = record(
        "padded",
        {"calc loss": {"wall_ms": 2.0, "gpu_ms": 0.12}, "backward": {"wall_ms": 7.0, "gpu_ms": 11.2}},
        29.4,
        idle=0.01,
        device_step=29.4,
    )
    run = record(
        "packed",
        {"calc loss": {"wall_ms": 0.25, "gpu_ms": 0.013}, "backward": {"wall_ms": 13.5, "gpu_ms": 11.0}},
        29.0,
        idle=0.01,
        device_step=29.0,
    )
    assert moved_most(base, run, faster=True) == ("backward", pytest.approx(-0.2))
    assert moved_most(base, run, faster=False) is None  # no region lost GPU time: nothing to blame
    # a host-bound run (the device idles a fifth of its step): its wall time counts, and the loss region lost most
    host = record(
        "torchvision",
        {"calc loss": {"wall_ms": 8.6, "gpu_ms": 0.17}, "backward": {"wall_ms": 7.5, "gpu_ms": 11.3}},
        34.3,
        idle=0.2,
        device_step=34.3,
    )
    assert moved_most(base, host, faster=False) == ("calc loss", pytest.approx(6.6))


def test_runs_of_another_setting_are_not_judged_against_padded():
    base = record("padded", PADDED, 10.0)
    other = record("concat", CONCAT, 12.0, batch=256)
    runs = [("padded", base), ("concat", other)]
    assert judge_all(runs, base) == {}
    (line,) = verdict_lines(runs, base, judge_all(runs, base))
    assert line == "- **concat** — no padded run at batch 256, 16 px on cpu: not judged."


def test_growth_with_the_batch_is_said_where_the_runs_show_it():
    small = record("concat", CONCAT, 12.0, batch=128)
    large = record(
        "concat",
        {r: {m: v * (2 if m != "wall_ms" else 1) for m, v in ms.items()} for r, ms in CONCAT.items()},
        20.0,
        batch=256,
    )
    (line,) = growth([("concat b128", small), ("concat b256", large), ("padded", record("padded", PADDED, 10.0))])
    assert line.startswith("- **concat**: calc loss operators grows with the batch (603 at 128, 1206 at 256)")
    assert growth([("padded", record("padded", PADDED, 10.0))]) == []


def test_the_profilers_note_never_calls_noise_an_overhead():
    gpu = record("padded", {"forward": {"wall_ms": 30.1}}, 34.8, device_step=35.1)
    assert "The profiled step on the device is 1.01× that: the profiler adds +1 %." in profiler_note(gpu)
    cpu = record("padded", {"forward": {"wall_ms": 30.1}}, 34.8)  # the CPU: host times both
    note = profiler_note(cpu)
    assert "The profiled step is 0.86× that (14 % shorter: the profiled and the timed steps differ" in note
    assert "adds" not in note


def test_a_difference_under_one_percent_is_said_as_a_share_not_as_one_times():
    """A quiet H100: packed_torch's and padded's steps as training runs them overlap; their profiled device steps,
    0.3 % apart with narrow spreads, do not. The profiler added under 1 % to either: it is not the cause."""
    base = record("padded", PADDED, 29.4, device_step=29.48, width=0.001)
    run = record("packed_torch", CONCAT, 29.4, device_step=29.39, width=0.001)
    line = judge(base, run, "packed_torch").line()
    assert "As training runs it: not distinguishable on this machine" in line
    assert (
        "Profiled: 0.3 % faster, a difference the profiler's window alone shows (it added under 1 % to either step); "
        "the training verdict stands." in line
    )
    assert "1.00×" not in line


def test_a_verdict_leads_with_memory_where_the_two_differ():
    # the padded loss's B·M slots against a per-image loop's tensors: bytes are counts no load changes
    padded = {"calc loss": {"wall_ms": 1.0, "ops": 129, "peak_rise_bytes": 4 * 2**20, "allocs": 57}}
    loop = {"calc loss": {"wall_ms": 3.0, "ops": 1110, "peak_rise_bytes": 1.6 * 2**20, "allocs": 564}}
    line = judge(record("padded", padded, 10.0), record("loop", loop, 30.0), "loop").line()
    assert line.startswith(
        "- **loop** — calc loss: the peak rise 2.5× smaller (1.6 MiB against 4 MiB), 9.9× the allocations (564 "
        "against 57). calc loss: 8.6× the operators (1110 against 129). As training runs it: 3× slower"
    ), line
    # within DIFFERENT (1.2×) the memory is the same: the counts lead as before
    loop["calc loss"] |= {"peak_rise_bytes": 4.4 * 2**20, "allocs": 60}
    line = judge(record("padded", padded, 10.0), record("loop", loop, 30.0), "loop").line()
    assert line.startswith("- **loop** — calc loss: 8.6× the operators"), line
