"""Every train.shard_optimizer (blocks, fsdp2, zero, off) on 2 processes (gloo): its losses against plain DDP's
(off), and checkpoints that reshard: a run stopped on 2 processes resumes on 1 with the same global batch, and the
other way round, with the losses of an uninterrupted run, whatever chunks each side's rows lie in."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_helpers import losses, spawn_two, tiny_cfg

from detector.config.sharing import WAYS
from detector.train.checkpoints import writer as checkpointer
from detector.train.checkpoints.state import CheckpointError, fingerprint, load_checkpoint, read_checkpoint
from detector.train.run.entry import run_training
from detector.train.run.step import TrainStep

# channels_last as on a GPU: FSDP2 shards only contiguous parameters, and the NHWC conv weights are not
RUN = ["device=cpu", "data.num_workers=0", "train.steps=6", "train.checkpoint_every=3", "train.channels_last=true"]
ONE = ["data.batch_size=8"]  # 1 process with the global batch of 2 processes of tiny_cfg's 4
MODES = tuple(WAYS)
# 1 and 2 processes sum the gradient in a different order; Adam divides by sqrt(v), so a near-zero gradient's
# rounding moves an update by more than the rounding itself (as in test_training_loop's DDP test)
RTOL = 1e-4


def _two_processes(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    # the saves of 2 processes in chunks of a few rows (a tensor's rows in many chunks, of both processes); those of
    # 1 process in the test's own, one chunk a tensor: each direction reads the other's
    checkpointer.CHUNK_BYTES = 4096
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    results = {}
    for mode in MODES:
        run = [*RUN, f"train.shard_optimizer={mode}"]
        results[f"straight_{mode}"] = run_training(tiny_cfg(Path(out) / f"straight_{mode}", *run))[0].history
        run_training(tiny_cfg(Path(out) / f"to_one_{mode}", *run, "train.stop_after=3"))  # the test resumes it on 1
        resumed = run_training(tiny_cfg(Path(out) / f"from_one_{mode}", *run, "train.resume=true"))[0]
        results[f"from_one_{mode}"] = resumed.history if resumed.resumed_at == 3 else "not resumed"
        # bf16 autocast, torch's AdamW (the one FSDP2 steps), NCHW conv weights (FSDP2's): the ways' arithmetic alone
        bf16 = [*RUN, "autocast=true", "train.optimizer=torch", "train.channels_last=false"]
        bf16 += [f"train.shard_optimizer={mode}"]
        results[f"bf16_{mode}"] = run_training(tiny_cfg(Path(out) / f"bf16_{mode}", *bf16))[0].losses
    results["gathered"] = gathered_head_dtypes(out)
    if rank == 0:
        (Path(out) / "results.json").write_text(json.dumps(results))


def gathered_head_dtypes(out: str) -> dict[str, str]:
    """The dtype of the head's weights as FSDP2 gathers them for a forward (reshard_after_forward=False keeps them
    registered until the backward): bf16 under autocast, fp32 without; the trunk's stay fp32."""
    found = {}
    for autocast in ("true", "false"):
        cfg = tiny_cfg(Path(out) / "dtypes", *RUN, f"autocast={autocast}", "train.shard_optimizer=fsdp2")
        step = TrainStep(cfg, torch.device("cpu"), world_size=2)
        with step.autocast:
            step.net(torch.zeros(2, 1, 32, 32, dtype=torch.uint8))
        head, trunk = step.model.head[1].blocks[0].weight, step.model.features[0].weight
        found[autocast] = f"{head.dtype} {trunk.dtype}"
        step.model.reshard()
    return found


def test_a_checkpoint_resumes_on_another_number_of_processes_with_the_same_losses(tmp_path):
    straight = losses(s.to_json() for s in run_training(tiny_cfg(tmp_path / "straight", *RUN, *ONE)))
    for mode in MODES:  # 1 process stopped at step 3: resumed on 2 in _two_processes
        run_training(tiny_cfg(tmp_path / f"from_one_{mode}", *RUN, *ONE, "train.stop_after=3"))
    spawn_two(_two_processes, str(tmp_path), timeout=120)
    results = json.loads((tmp_path / "results.json").read_text())

    # another global batch is refused in one line, saying which batch resumes it here
    with pytest.raises(CheckpointError) as refused:
        run_training(tiny_cfg(tmp_path / "to_one_blocks", *RUN, "train.resume=true"))
    message = str(refused.value)
    assert "global batch of 8" in message and "data.batch_size=8 on 1 process" in message and "\n" not in message

    # Every way against plain DDP (off). blocks and zero add the same two gradients (a + b is b + a, and halving
    # is exact), take the same global norm and run the same AdamW per element: equal to the last bit. So is FSDP2
    # where both step torch's AdamW, under bf16 autocast too (its bf16 all-gather of the head is the cast autocast
    # makes, and the CPU's autocast linear gives every way the same bf16 gradient), as long as the conv weights
    # have the same layout: FSDP2 shards contiguous tensors only, and under train.channels_last its NCHW weights
    # make the convolutions sum in another order (in bf16, 2e-5 apart after these 6 steps).
    # With the one-pass default FSDP2 still steps torch's AdamW, whose roundings differ from the one pass's by
    # ~1e-7 a step (tests/train/test_optimizer.py): 5.5e-7 after these 6 steps, hence 1e-5.
    ddp = losses([{"history": results["straight_off"]}])
    for mode in ("blocks", "zero"):
        assert losses([{"history": results[f"straight_{mode}"]}]) == ddp, mode
    torch.testing.assert_close(losses([{"history": results["straight_fsdp2"]}]), ddp, rtol=1e-5, atol=0)
    assert all(results[f"bf16_{mode}"] == results["bf16_off"] for mode in MODES), {
        m: results[f"bf16_{m}"] for m in MODES
    }
    assert results["bf16_off"] != losses([{"history": results["straight_off"]}])  # autocast did compute in bf16
    assert results["gathered"] == {"true": "torch.bfloat16 torch.float32", "false": "torch.float32 torch.float32"}
    for mode in MODES:
        to_one = run_training(tiny_cfg(tmp_path / f"to_one_{mode}", *RUN, *ONE, "train.resume=true"))
        assert to_one[0].resumed_at == 3 and to_one[0].world_size == 1
        for name, curve in [
            ("2 processes", results[f"straight_{mode}"]),
            ("1 -> 2", results[f"from_one_{mode}"]),
            ("2 -> 1", to_one[0].history),
        ]:
            assert len(losses([{"history": curve}])) == 6, (mode, name)
            torch.testing.assert_close(losses([{"history": curve}]), straight, rtol=RTOL, atol=0, msg=f"{mode} {name}")


def test_the_checkpoint_joins_the_blocks_of_the_head_into_one_linear(tmp_path):
    """A head of 2 blocks (model.head_blocks=2) on one process: the checkpoint's head.1.weight is the blocks' rows
    one after the other, and so is each of its optimizer states; the step, the same in each block, is one value."""
    cfg = tiny_cfg(tmp_path, "device=cpu", "data.num_workers=0", "model.head_blocks=2", "train.steps=2")
    run_training(cfg)
    state = read_checkpoint(tmp_path / "default" / "padded")
    step = TrainStep(cfg, torch.device("cpu"))
    blocks = step.model.head[1].blocks
    assert len(blocks) == 2 and state["tensors"]["model/head.1.weight"].shape == (32, blocks[0].in_features)
    keys = {key.rsplit("/", 1)[-1] for key in state["tensors"] if key.startswith("optimizer/head.1.weight/")}
    assert keys == {"step", "exp_avg", "exp_avg_sq"} and state["tensors"]["optimizer/head.1.weight/step"].dim() == 0
    # resumed into 2 blocks: each block's rows and optimizer state are the joined tensor's
    load_checkpoint(tmp_path / "default" / "padded", step, fingerprint(cfg, 1), 4)
    weight = torch.cat([block.weight.detach() for block in blocks])
    assert torch.equal(weight, state["tensors"]["model/head.1.weight"])
    exp_avg = torch.cat([step.optimizer.state[block.weight]["exp_avg"] for block in blocks])
    assert torch.equal(exp_avg, state["tensors"]["optimizer/head.1.weight/exp_avg"])
    assert all(step.optimizer.state[block.weight]["step"] == 2 for block in blocks)


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_of_our_formats_before_dcp_is_refused_in_one_line_saying_how(tmp_path, version):
    """checkpoint.pt (version 1) and a manifest of our own part files (version 2) are read by the detector that wrote
    them: resuming is refused in one line naming the version that reads them; train.resume=false moves the run aside
    and starts afresh."""
    run = ["device=cpu", "data.num_workers=0", "train.steps=4", "train.checkpoint_every=2"]
    folder = tmp_path / "default" / "padded"
    folder.mkdir(parents=True)
    if version == 1:
        (folder / "checkpoint.pt").write_bytes(b"detector-checkpoint v1 sha256=" + b"0" * 64 + b" bytes=0\n")
    else:
        (folder / "checkpoint.json").write_text(json.dumps({"format": "detector-checkpoint", "version": 2, "step": 2}))
    for resume in ("auto", "true"):
        with pytest.raises(CheckpointError) as refused:
            run_training(tiny_cfg(tmp_path, *run, f"train.resume={resume}"))
        message = str(refused.value)
        assert "before its checkpoints moved to torch.distributed.checkpoint" in message and "\n" not in message
        assert "git checkout 230b480" in message and "train.resume=false" in message
    assert run_training(tiny_cfg(tmp_path, *run, "train.resume=false"))[0].steps == 4
    (aside,) = [p for p in tmp_path.joinpath("default").iterdir() if p.name.startswith("padded-")]
    assert (aside / ("checkpoint.pt" if version == 1 else "checkpoint.json")).exists()  # moved aside, not deleted
