"""`make train NNODES=2` on one machine: two torchrun agents, two "nodes" of one process each, meet at a c10d
rendezvous and train over gloo as one 2-process run does, to the last bit, and as one process does with their union
batch, to the order of the sums."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, child_env, fails_after
from train_helpers import TINY, losses, spawn_two

from detector.config.schema import load_config
from detector.train.checkpoints.state import CheckpointError, read_checkpoint, shared_checkpoint
from detector.train.run.entry import run_training

RUN = [*TINY, "device=cpu", "data.num_workers=0", "train.steps=4", "train.checkpoint_every=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def make_train(out: Path, *variables: str) -> subprocess.Popen:
    """`make train <variables>` of the tiny run into ``out``, in a session of its own."""
    args = " ".join([*RUN, f"train.out_dir={out}"])
    command = ["make", "-s", "--no-print-directory", "train", f"PY={sys.executable}", "EXPERIMENT=cpu_smoke"]
    command += [*variables, f"ARGS={args}"]
    env = child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def make_train_node(out: Path, port: int) -> subprocess.Popen:
    """One node's `make train NNODES=2 NPROC=1` (both nodes run the same command)."""
    return make_train(out, "NNODES=2", "NPROC=1", f"RDZV_ENDPOINT=localhost:{port}", f"RDZV_ID=test-{port}")


def finish(processes: list[subprocess.Popen], seconds: int) -> list[str]:
    """The processes' outputs once they have ended; killed whole if they are not done in ``seconds``."""
    try:
        with fails_after(seconds):
            return [process.communicate()[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # a rendezvous or a collective that never completed


def test_two_nodes_train_as_one_node_of_two_processes_and_as_one_process_with_their_union_batch(tmp_path):
    port = free_port()
    nodes = [make_train_node(tmp_path / "nodes", port) for _ in range(2)]
    outputs = finish(nodes, 90)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    run_dir = tmp_path / "nodes" / "cpu_smoke" / "padded"
    two = json.loads((run_dir / "summary.json").read_text())
    assert two["world_size"] == 2 and two["global_batch"] == 8
    # global rank 0 alone writes the run folder, whichever node the rendezvous put it on
    assert sum("done: " in output for output in outputs) == 1

    # one node of two processes: the same ranks and the same sums. Two ranks' gradients add as a + b, in whatever
    # order or topology the reduction runs, so the losses are equal to the last bit (docs/training.md, "Several
    # machines", says what may differ on GPUs)
    pair = make_train(tmp_path / "pair", "NPROC=2")
    output = finish([pair], 90)[0]
    assert pair.returncode == 0, output
    one_node = json.loads((tmp_path / "pair" / "cpu_smoke" / "padded" / "summary.json").read_text())
    assert one_node["world_size"] == 2 and one_node["losses"] == two["losses"]

    # one process with the same global batch: the same 8 images a step, the same losses but for the order of sums
    cfg = load_config([*RUN, "data.batch_size=8", f"train.out_dir={tmp_path / 'one'}"], "cpu_smoke", announce=None)
    one = run_training(cfg, "cpu_smoke")
    torch.testing.assert_close(losses([two]), losses(s.to_json() for s in one), rtol=1e-4, atol=0)
    assert read_checkpoint(run_dir)["fingerprint"]["global_batch"] == 8


@pytest.mark.parametrize("variable", ["NNODES=2", "NPROC=2"])
def test_make_train_launches_torchrun_for_several_nodes_or_processes(variable):
    """The launch lines themselves (make -n prints them): c10d with the rendezvous settings, or --standalone."""
    printed = subprocess.run(
        ["make", "-n", "train", "PY=python3", variable, "RDZV_ENDPOINT=node0:29500", "RDZV_ID=job7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if variable == "NNODES=2":
        for flag in ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=job7"):
            assert flag in printed
    else:
        assert "--standalone --nproc_per_node=2" in printed


def _sees_its_own_folder(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    # node 0 finds a checkpoint in its train.out_dir; node 1, whose out_dir is another disk, finds none there
    found = "unexpected: no refusal"
    try:
        shared_checkpoint(Path(out) / f"node{rank}", world_size=2)
    except CheckpointError as err:
        found = str(err)
    (Path(out) / f"rank{rank}.txt").write_text(found)


def test_a_run_folder_that_not_every_node_shares_is_refused_on_every_rank(tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "checkpoint.json").write_text("{}")
    spawn_two(_sees_its_own_folder, str(tmp_path), timeout=60)
    for rank in (0, 1):  # both ranks refuse, so neither waits for the other in a collective
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "rank(s) [1] do not find the checkpoint" in message and "a folder that every node shares" in message
