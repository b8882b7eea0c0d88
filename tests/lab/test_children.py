"""The one runner of the lab's and the benches' child commands (detector/lab/children.py): its log, its echo, its
exit status, its time limit, its environment and its done file."""

import os
import signal
import threading
import time

import pytest

from detector.lab import children
from detector.lab.children import Child, run_child


def test_a_child_that_succeeds_is_logged_shown_indented_and_marked_done(tmp_path, capsys):
    done = tmp_path / "part" / "done"
    child = Child("two lines", ["-c", "print('one'); print('two')"], done=done)
    with open(tmp_path / "log", "w") as log:
        ran = run_child(child, log, echo=True)
    assert ran.code == 0 and ran.state == "done" and ran.command == child.command() and ran.seconds > 0
    lines = (tmp_path / "log").read_text().splitlines()
    assert lines[0] == f"===== two lines: {child.command()}" and lines[1:3] == ["one", "two"]
    assert lines[3].startswith("===== two lines: done after ") and len(lines) == 4
    assert capsys.readouterr().out == "    one\n    two\n"
    assert done.read_text()  # the time it was done


def test_a_child_that_fails_says_its_exit_and_is_not_marked_done(tmp_path, capsys):
    done = tmp_path / "done"
    with open(tmp_path / "log", "w") as log:
        ran = run_child(Child("fails", ["-c", "import sys; print('why'); sys.exit(3)"], done=done), log)
    assert ran.code == 3 and ran.state == "exit 3" and not done.exists()
    assert "why\n===== fails: exit 3 after" in (tmp_path / "log").read_text()
    assert capsys.readouterr().out == ""  # no echo asked for


def test_a_child_past_its_limit_is_stopped(tmp_path):
    began = time.perf_counter()
    with open(tmp_path / "log", "w") as log:
        ran = run_child(Child("hangs", ["-c", "print('started', flush=True); import time; time.sleep(60)"], 1.0), log)
    assert ran.code is None and ran.state == "stopped at its limit of 1 s" and time.perf_counter() - began < 20
    text = (tmp_path / "log").read_text()
    assert text.startswith("===== hangs: python -c ") and "(at most 1 s)\nstarted\n" in text
    assert "===== hangs: stopped at its limit of 1 s after 1 s" in text


def test_a_child_gets_the_variables_set_and_not_those_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("CHILD_REMOVED", "here")
    code = "import os; print(*(os.environ.get(k) for k in ('CHILD_SET', 'CHILD_REMOVED', 'PYTHONUNBUFFERED')))"
    with open(tmp_path / "log", "w") as log:
        run_child(Child("env", ["-c", code], env={"CHILD_SET": "x", "CHILD_REMOVED": None}), log)
    assert (tmp_path / "log").read_text().splitlines()[1] == "x None 1"
    assert os.environ["CHILD_REMOVED"] == "here"  # the parent's own environment is left as it was


@pytest.mark.parametrize("stops_itself", [True, False])
def test_a_ctrl_c_gives_the_child_its_own_stop_then_ends_it(tmp_path, monkeypatch, stops_itself):
    """A Ctrl-C in the parent (here to the parent alone; a terminal's would reach the child too): the child
    finishes by itself where it does within STOP_SECONDS (a training child's last save), else it is killed; the Ctrl-C
    goes on up either way."""
    monkeypatch.setattr(children, "STOP_SECONDS", 5.0 if stops_itself else 0.5)
    mark = tmp_path / "stopped"
    seconds = 1.0 if stops_itself else 60.0
    code = f"import time; time.sleep({seconds}); open({str(mark)!r}, 'w').write('by itself')"
    # Python's own SIGINT handler for the test, which is of run_child's answer to a KeyboardInterrupt: a process
    # started with SIGINT ignored (a suite run as a background job of a shell script inherits SIG_IGN, and Python
    # then installs no handler of its own) would never raise one
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # to this process alone
        began = time.perf_counter()
        with open(tmp_path / "log", "w") as log, pytest.raises(KeyboardInterrupt):
            run_child(Child("stops", ["-c", code]), log)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert mark.exists() == stops_itself and time.perf_counter() - began < 10
