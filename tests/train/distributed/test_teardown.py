"""distributed.teardown ends the process group, gloo's threads with it, whatever else in the process still refers to
the group: a device mesh kept alive (DTensor's caches, torch's C++ dispatch), and torch's functions whose default
argument is the default group, bound when their module is first imported after init_process_group. A stop every
process agreed on ends with its own line where a peer had gone before the teardown met it."""

import subprocess
import sys

import pytest
from conftest import child_env

# One process; for each holder named, a gloo group of 1, torn down while that holds it; after each teardown, the names
# of the gloo threads left (there must be none). One process for all the holders (torch imported once): dynamo comes
# last, whose point is its first import after the group is made.
HOLDERS = ["nothing", "mesh", "dynamo"]
SCRIPT = """
import sys, tempfile, time
sys.path.insert(0, "tests")
from detector.train.distributed import processes as distributed
import torch.distributed as dist
distributed.before_groups()  # as make train's setup does before it makes its group
from train_helpers import gloo_threads

held = []  # what each holder holds outlives its run, as the caches keep FSDP2's
for holder in sys.argv[1:]:
    with tempfile.TemporaryDirectory() as out:
        dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=0, world_size=1)
        # gloo's threads name themselves once running, so under load the names come a moment after the group does
        deadline = time.monotonic() + 10
        while not gloo_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gloo_threads(), "gloo started no threads in 10 s: this test would prove nothing"
        if holder == "mesh":  # a mesh that outlives the run
            from torch.distributed.device_mesh import DeviceMesh
            held.append(DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        if holder == "dynamo":  # first imported now, as torch.compile's first compile imports it
            assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported before: this would prove nothing"
            import torch._dynamo
        distributed.teardown(distributed.DistEnv(owns_group=True))
        # the group's destruction asks its threads to end; under load they take a moment to be scheduled and go, as
        # they took one to come: the test is that they end, not how soon (a group still held keeps them for good)
        deadline = time.monotonic() + 10
        while gloo_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"{holder}: {gloo_threads()}", flush=True)
"""


def test_teardown_ends_the_group_and_its_gloo_threads_whatever_holds_it():
    """One test for the holders, not one a holder: they share one child process, which a test each would start again
    on each worker that drew one. Each holder's assertions say which it is."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *HOLDERS],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"),
    )
    # the child's lines, one a holder: ``holder: [names of the gloo threads left]``
    left = dict(line.split(": ", 1) for line in done.stdout.splitlines() if line.split(": ")[0] in HOLDERS)
    for holder in HOLDERS:
        assert holder in left, (holder, done.returncode, done.stdout, done.stderr[-2000:])  # its run ended
        assert left[holder] == "[]", (holder, done.stdout)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    "teardown_error,seen",
    [
        # a peer a second signal ended before the barrier met it: the stop's own error is what the user sees
        (RuntimeError("[gloo] ... Connection closed by peer [127.0.0.1]:29500"), KeyboardInterrupt),
        (RuntimeError("something else broke in the teardown"), RuntimeError),  # never hidden
    ],
)
def test_an_agreed_stops_teardown_that_meets_a_gone_peer_leaves_the_stops_own_error(monkeypatch, teardown_error, seen):
    import torch

    from detector.train.distributed import processes as distributed
    from detector.train.run import entry

    monkeypatch.setattr(distributed, "setup", lambda cfg: (distributed.DistEnv(1, 2, True), torch.device("cpu")))

    def teardown(env):
        raise teardown_error

    monkeypatch.setattr(distributed, "teardown", teardown)
    stop = KeyboardInterrupt("interrupted: the run stopped after step 12")
    stop.agreed = True
    with pytest.raises(seen) as caught:
        with entry.training_processes(None):
            raise stop
    assert (caught.value is stop) == (seen is KeyboardInterrupt)
