"""`make profile NPROC=2` on the CPU (torchrun, gloo): each rank profiles the step `make train NPROC=2` runs and
records its own run in ``<strategy>/<time>/rank<r>/``, which compare reads like any run."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, child_env, fails_after
from lab_helpers import TINY_PROFILE

from detector.lab.compare import run_compare
from detector.lab.record.run import read_summary
from detector.lab.record.steps import read_extract

TINY = TINY_PROFILE + ["profile.timed=2"]


def make_profile(out, *overrides) -> subprocess.CompletedProcess:
    """`make profile NPROC=2` into ``out``, in a session of its own (killed whole if it hangs)."""
    args = " ".join([*TINY, f"profile.out_dir={out}", *overrides])
    command = ["make", "-s", "--no-print-directory", "profile", f"PY={sys.executable}", "NPROC=2", f"ARGS={args}"]
    env = child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        with fails_after(240):
            output = process.communicate()[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # a rendezvous or a collective that never completed
    return subprocess.CompletedProcess(command, process.returncode, output)


@pytest.mark.slow
def test_two_ranks_record_one_run_each_that_compare_reads(tmp_path):
    done = make_profile(tmp_path, "profile.strategy=padded", "train.shard_optimizer=zero")
    assert done.returncode == 0, done.stdout
    (run,) = (tmp_path / "padded").iterdir()  # one run, its two ranks inside
    assert sorted(p.name for p in run.iterdir()) == ["rank0", "rank1"]
    records = [read_summary(run / f"rank{r}") for r in (0, 1)]
    for rank, record in enumerate(records):
        assert record.run == f"rank{rank}" and record.strategy == "padded"
        assert record.config["train"]["shard_optimizer"] == "zero"
        assert record.analysis.steps == 2 and record.analysis.warnings == []
        assert len(record.timed.wall_ms) == 2
        assert (run / f"rank{rank}" / "extract.json.gz").is_file()
        (trace,) = (run / f"rank{rank}" / "trace").iterdir()
        assert record.trace == f"trace/{trace.name}"
    assert "rank 1 of 2 (the optimizer sharded over the 2 processes by ZeroRedundancyOptimizer)" in done.stdout
    # one host's clock: each step of rank 0 overlaps the same step of rank 1 (their collectives meet in it), which
    # is what lets the Traces tab draw both ranks on one axis
    extracts = [read_extract(run / f"rank{r}" / "extract.json.gz") for r in (0, 1)]
    for number, step in extracts[0].steps.items():
        other = extracts[1].steps[number]
        assert step.start < other.start + other.dur and other.start < step.start + step.dur
    # the same model's forward on each rank; each rank's optimizer updates its own parameters, ZeRO's partition
    assert records[0].median("forward", "ops") == records[1].median("forward", "ops") > 0
    assert records[0].median("optimizer step", "ops") != records[1].median("optimizer step", "ops")

    comparison = run_compare(runs=[run / "rank0", run / "rank1"], out_dir=tmp_path / "compare")
    labels = [entry.label for entry in comparison.record.runs]
    assert labels == ["padded rank0", "padded rank1"]
    assert "padded rank1" in (tmp_path / "compare" / "compare.md").read_text()
