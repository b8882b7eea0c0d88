"""How busy the machine was around a run (detector/lab/measure/cpu_load.py): the cores other processes kept busy,
read from Linux's /proc."""

import os
import subprocess
import sys

import pytest

from detector.lab.measure import cpu_load


def test_the_meter_counts_the_cores_others_kept_busy(monkeypatch):
    """Between start and stop the machine used 3 s of CPU in 2 s, this process 1 s of it: others kept 1 core busy."""
    readings = iter([(10.0, 100.0, 5.0), (12.0, 103.0, 6.0)])
    monkeypatch.setattr(cpu_load.LoadMeter, "_now", staticmethod(lambda: next(readings)))
    meter = cpu_load.LoadMeter()
    meter.start()
    assert meter.stop() == pytest.approx(1.0) and meter.own == pytest.approx(0.5)
    readings = iter([(10.0, 100.0, None), (12.0, 103.0, 6.0)])  # /proc unreadable: unknown, not 0
    meter.start()
    assert meter.stop() is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc")
def test_the_readings_count_a_child_as_ours_and_the_machine_counts_it_too():
    """A child that spins for a second counts in this process's CPU time (the loader's workers are ours) and in
    the machine's."""
    own, machine = cpu_load.own_busy(), cpu_load.machine_busy()
    spin = "import time\nend = time.time() + 1\nwhile time.time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    spent = cpu_load.own_busy() - own
    assert 0.2 < spent < 5 and cpu_load.machine_busy() - machine >= spent * 0.9
    assert cpu_load.own_busy(root=2**22 + 12345) is None  # no such process


def test_under_torchrun_the_other_ranks_are_the_runs_own(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert cpu_load.run_root() == os.getpid()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's agent started this process and its siblings
    assert cpu_load.run_root() == os.getppid()
