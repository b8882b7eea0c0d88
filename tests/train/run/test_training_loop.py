"""`make train` on the CPU: exact resume, DDP gradients, refusals, the schedule, the metrics, the sweep
(detector/lab/sweep.py)."""

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from train_helpers import losses, spawn_two, tiny_cfg

from detector.cli.main import main as cli_main
from detector.config.schema import load_config
from detector.data import PaddedTargets, build_loader
from detector.data.loader import DataWorkerDied
from detector.errors import UserError
from detector.lab import sweep
from detector.lab.measure.analysis import measure_steps
from detector.losses import STRATEGIES, Strategy, get_strategy
from detector.model import BlockedLinear, build_model
from detector.train.checkpoints.state import read_checkpoint
from detector.train.distributed import processes as distributed
from detector.train.distributed.processes import count_valid, global_mean
from detector.train.distributed.sharding import shard_refusal
from detector.train.evaluate.held_out import REPLACEMENTS, HeldOut
from detector.train.evaluate.metrics import box_iou, box_metrics, evaluate
from detector.train.observe.progress import Log
from detector.train.run.entry import run_training
from detector.train.run.rank_data import RankBlocks, rank_loader
from detector.train.run.step import lr_factor, speed_option_refusal

# ----------------------------------------------------------------------------- checkpoints


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    run = ["train.steps=6", "train.checkpoint_every=3"]
    straight = run_training(tiny_cfg(tmp_path / "straight", *run))
    first = run_training(tiny_cfg(tmp_path / "split", *run, "train.stop_after=3"))
    run_dir = tmp_path / "split" / "default" / "padded"
    assert first[0].steps == 3 and (run_dir / "checkpoint.json").exists()
    assert not list(run_dir.glob("*.tmp*")), "the manifest is written to a temporary file, then renamed"
    assert len(list(run_dir.glob("checkpoint-*"))) == 1, "the saves before the one committed are removed"
    second = run_training(tiny_cfg(tmp_path / "split", *run, "train.resume=true"))
    # the resumed run's history is the whole run's, not only the steps after the resume
    assert second[0].resumed_at == 3 and [s for s, _ in second[0].history] == [1, 2, 3, 4, 5, 6]
    # CPU fp32 is deterministic: the same model, optimizer, schedule and data position give the same losses
    second, first, straight = ([s.to_json() for s in runs] for runs in (second, first, straight))  # as written
    torch.testing.assert_close(losses(second), losses(straight), rtol=1e-6, atol=0)
    torch.testing.assert_close(losses(first), losses(straight)[:3], rtol=1e-6, atol=0)


def test_the_summary_keeps_every_steps_loss_whatever_the_log_lines(tmp_path):
    every = run_training(tiny_cfg(tmp_path / "every", "train.steps=6"))[0]  # TINY logs every step
    windows = run_training(tiny_cfg(tmp_path / "windows", "train.steps=6", "train.log_every=3"))[0]
    assert len(every.losses) == 6 and windows.losses == every.losses == losses([every.to_json()])
    assert [s for s, _ in windows.history] == [3, 6]
    assert windows.history[1][1] == pytest.approx(sum(every.losses[3:]) / 3)


def test_a_log_line_reads_its_own_window_not_every_step_so_far(tmp_path, monkeypatch):
    """A log line's work is its window's: one that scanned every step's timing made each step of a long run slower
    than the last (the 8,000th CPU step 3.5x the first). Counted in timings read, which no load changes."""
    reads = []

    class Counted(list):
        def __iter__(self):
            reads.append(len(self))
            return super().__iter__()

    made = Log.__init__

    def counted(self, *args):
        made(self, *args)
        self.timings = Counted()

    monkeypatch.setattr(Log, "__init__", counted)
    steps = 40
    summary = run_training(tiny_cfg(tmp_path, f"train.steps={steps}", "train.checkpoint_every=0"))[0]
    assert len(summary.history) == steps  # TINY logs every step
    # the summary's medians read every step once; the 40 log lines read their own windows (read from the end)
    assert sum(reads) <= 2 * steps, reads

    log = Log(torch.device("cpu"), [])
    log.timings = [{"step": s} for s in range(11, 101)]  # a run resumed at step 10
    assert [t["step"] for t in log.since(95)] == [96, 97, 98, 99, 100]
    assert [t["step"] for t in log.since(20, most=30)] == list(range(71, 101))  # the ETA's last steps only
    assert log.since(100) == [] and len(log.since(0)) == len(log.since(10)) == 90


def test_checkpoint_of_another_config_is_refused(tmp_path):
    run = ["train.steps=4", "train.checkpoint_every=2"]
    run_training(tiny_cfg(tmp_path, *run, "train.stop_after=2"))
    with pytest.raises(UserError, match=r"another configuration.*train\.lr: 0\.01 in the checkpoint, 0\.02 now"):
        run_training(tiny_cfg(tmp_path, *run, "train.resume=true", "train.lr=0.02"))


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", ["loop", "concat"])
def test_cuda_graphs_refuses_list_layout_strategies(tmp_path, name):
    with pytest.raises(UserError, match="dynamic shapes and host synchronisations"):
        run_training(tiny_cfg(tmp_path, f"train.strategy={name}", "train.cuda_graphs=true"))


def test_cuda_graphs_needs_a_gpu():
    tcfg = load_config(["train.cuda_graphs=true"], announce=None).train
    reason = speed_option_refusal(get_strategy("padded"), tcfg, 1, torch.device("cpu"))
    assert "needs a CUDA device" in reason


@pytest.mark.parametrize(
    "blocks,world_size,refusal",
    [
        (2, 2, None),  # rows 5 + 5
        (4, 2, "unequal shares of rows"),  # rows 3 + 3 | 2 + 2
        (3, 2, "model.head_blocks=3 is not a multiple of the 2 processes"),
        (1, 2, "model.head_blocks=1 is not a multiple of the 2 processes"),
        (5, 5, None),
    ],
)
def test_shard_optimizer_needs_equal_shares_of_the_head(blocks, world_size, refusal):
    reason = shard_refusal({"head.1": BlockedLinear(8, 10, blocks)}, world_size)
    if refusal is None:
        assert reason is None
    else:
        assert refusal in reason and "train.shard_optimizer=false" in reason


# ----------------------------------------------------------------------------- schedule and loss normalisation


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(s, steps=10, warmup=2, min_ratio=0.1) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # warm-up reaches the peak at its last step
    assert all(a >= b for a, b in zip(factors[1:], factors[2:], strict=False))  # then it never rises
    assert lr_factor(10, steps=10, warmup=2, min_ratio=0.1) == pytest.approx(0.1)


def test_count_valid_and_one_process_loss_is_untouched():
    boxes = [torch.zeros(2, 4), torch.zeros(0, 4), torch.zeros(3, 4)]
    cpu = torch.device("cpu")
    from detector.data import make_targets

    for layout in ("list", "padded", "packed"):
        assert count_valid(make_targets(boxes, layout, 4), cpu).item() == 5.0
    loss = torch.tensor(0.25, requires_grad=True)
    backward, logged = global_mean(loss, torch.tensor(5.0), world_size=1)
    assert backward is loss and logged.item() == 0.25


def test_rank_blocks_are_disjoint_blocks_of_each_global_batch():
    data = list(range(12))
    assert [RankBlocks(data, 2, r, 2)[i] for r in (0, 1) for i in range(6)] == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]


# ----------------------------------------------------------------------------- DDP (gloo, 2 processes)


def _ddp_worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: no TCP port to race for with other test runs on the machine
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    cfg = tiny_cfg(out, "device=cpu", "train.steps=3", "train.checkpoint_every=0")
    env, device = distributed.setup(cfg)  # the group above: rank, world size 2, the CPU
    # one backward of the real loss path: this rank's block of the first global batch, globally normalised
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data, env.world_size)  # the head in blocks, as TrainStep builds it
    ddp = nn.parallel.DistributedDataParallel(model)
    images, targets = next(iter(rank_loader(cfg.data, "padded", device, env.rank, env.world_size, start=0, steps=1)))
    local = get_strategy("padded")(ddp(images), targets)
    backward, loss = global_mean(local, count_valid(targets, device), env.world_size)
    backward.backward()
    if rank == 0:
        torch.save({"grads": [p.grad for p in model.parameters()], "loss": loss}, Path(out) / "ddp_grads.pt")
    # the training loop itself, 3 steps
    summaries = run_training(cfg)
    if rank == 0:
        (Path(out) / "ddp_history.json").write_text(json.dumps(summaries[0].history))
        (Path(out) / "ddp_eval.json").write_text(json.dumps(summaries[0].eval))


def test_ddp_matches_one_process_on_the_union_batch(tmp_path):
    spawn_two(_ddp_worker, str(tmp_path))

    # one process, batch 2 x 4: the same 8 images (indices 0-7) as the two ranks together
    cfg = tiny_cfg(tmp_path / "single", "device=cpu", "data.batch_size=8", "train.steps=3", "train.checkpoint_every=0")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data, world_size=2)  # the ranks' blocked head, parameter for parameter
    images, targets = next(iter(build_loader(cfg.data, "padded", torch.device("cpu"))))
    loss = get_strategy("padded")(model(images), targets)
    loss.backward()
    ddp = torch.load(tmp_path / "ddp_grads.pt")
    torch.testing.assert_close(ddp["loss"], loss.detach())
    for ddp_grad, p in zip(ddp["grads"], model.parameters(), strict=True):
        torch.testing.assert_close(ddp_grad, p.grad, rtol=1e-5, atol=1e-7)  # summation order differs

    single = run_training(cfg)
    ddp_history = json.loads((tmp_path / "ddp_history.json").read_text())
    # Adam divides by sqrt(v): a near-zero gradient's rounding can flip an update's sign, hence not 1e-6
    torch.testing.assert_close(losses([{"history": ddp_history}]), losses([single[0].to_json()]), rtol=1e-4, atol=0)
    # the held-out set is eval_batches global batches: the same images whatever the number of processes
    assert json.loads((tmp_path / "ddp_eval.json").read_text())["boxes"] == single[0].eval["boxes"]


def _sharded_worker(rank: int, out: str, backend: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # NCCL: distributed.setup gives rank r the GPU cuda:r
    dist.init_process_group(backend, init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    run = [f"device={'cuda' if backend == 'nccl' else 'cpu'}", "train.steps=4", "train.checkpoint_every=2"]
    results = {}
    for name, options in {
        "all_reduce": ["train.shard_optimizer=false"],  # every rank updates the whole model
        "sharded": ["train.shard_optimizer=true"],
        "zero": ["train.shard_optimizer=zero"],  # torch's ZeroRedundancyOptimizer
    }.items():
        results[name] = run_training(tiny_cfg(Path(out) / name, *run, *options))[0].history
    # a sharded run stopped at step 2 and resumed: its checkpoint gathered each rank's optimizer share
    run_training(tiny_cfg(Path(out) / "resumed", *run, "train.stop_after=2"))
    results["resumed"] = run_training(tiny_cfg(Path(out) / "resumed", *run, "train.resume=true"))[0].history
    # a checkpoint of either kind resumed by the other (the checkpoint has one process's layout either way)
    for first, then in (("false", "true"), ("true", "false")):
        folder = Path(out) / f"from_{first}"
        run_training(tiny_cfg(folder, *run, "train.stop_after=2", f"train.shard_optimizer={first}"))
        resumed = run_training(tiny_cfg(folder, *run, "train.resume=true", f"train.shard_optimizer={then}"))
        results[f"from_{first}"] = resumed[0].history
    try:
        run_training(tiny_cfg(Path(out) / "refused", *run, "model.head_blocks=3"))
    except UserError as err:
        results["refused"] = str(err)
    if rank == 0:
        (Path(out) / "sharded.json").write_text(json.dumps(results))


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL's reduce and all-gather need 2 GPUs"),
        ),
    ],
)
def test_ddp_sharded_optimizer_is_the_all_reduce_step_and_checkpoints_one_layout(tmp_path, backend):
    spawn_two(_sharded_worker, str(tmp_path), backend)
    results = json.loads((tmp_path / "sharded.json").read_text())

    # the reduce onto the owner and the all-reduce add the same two numbers (NCCL's average halves each
    # first, exactly), and the global gradient norm for clipping is the same number: on the CPU, the same
    # losses and weights to the last bit. On 2 H100s the losses were equal but one element of one weight
    # differed by 1.5e-8 (with cuDNN deterministic and without clipping too; the likely cause: the one pass is
    # compiled for the tensors it updates, the whole model or this rank's blocks, and inductor's kernels for
    # the two sets may round a product differently), so there the check is to within a few float32 steps of
    # each tensor's scale.
    def same(actual, expected, what):
        if backend == "gloo":
            assert actual == expected if isinstance(actual, list) else torch.equal(actual, expected), what
        else:
            actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
            scale = expected.abs().max().item() if expected.numel() else 0.0
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale, msg=str(what))

    expected = results["all_reduce"]
    for name in ("sharded", "zero", "resumed", "from_false", "from_true"):
        same([loss for _, loss in results[name]], [loss for _, loss in expected], name)
    # the checkpoints: the same weights, and each sharded run's optimizer state gathered from both ranks into
    # one process's layout, equal to the state every rank of the all-reduce run held
    full = read_checkpoint(next((tmp_path / "all_reduce").rglob("checkpoint.json")).parent)
    for name in ("sharded", "zero"):
        sharded = read_checkpoint(next((tmp_path / name).rglob("checkpoint.json")).parent)
        assert full["step"] == sharded["step"] == 4
        assert full["param_groups"] == sharded["param_groups"], name
        # every tensor of one process's layout, the optimizer's state of every parameter included
        assert full["tensors"].keys() == sharded["tensors"].keys(), name
        assert sum(key.startswith("optimizer/") for key in full["tensors"]) == 3 * len(full["model"])
        for key, tensor in full["tensors"].items():
            same(sharded["tensors"][key].to(tensor.device), tensor, (name, key))
    assert "model.head_blocks=3 is not a multiple of the 2 processes" in results["refused"]


# ----------------------------------------------------------------------------- metrics


def test_box_iou_and_recall_by_hand():
    pred = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2], [0, 0, 1, 1], [0, 0, 4, 4]], dtype=torch.float32)
    target = torch.tensor([[1, 1, 3, 3], [0, 0, 2, 2], [2, 2, 3, 3], [0, 0, 4, 2]], dtype=torch.uint8)
    # 2x2 boxes offset by (1, 1): overlap 1, union 7; identical; disjoint; the lower half of a 4x4 box
    expected = torch.tensor([1 / 7, 1.0, 0.0, 0.5])
    torch.testing.assert_close(box_iou(pred, target), expected)
    metrics = box_metrics(pred, target)
    assert metrics["mean_iou"] == pytest.approx(expected.mean().item())
    assert metrics["recall50"] == 0.5  # IoU 1 and exactly 0.5 count; 1/7 and 0 do not
    # over the thresholds 0.5, 0.55, ..., 0.95: IoU 1 passes all 10, IoU 0.5 the first alone, 1/7 and 0 none
    assert metrics["recall50_95"] == pytest.approx((10 + 1) / 40)


class FixedBoxes(nn.Module):
    def __init__(self, pred):
        super().__init__()
        self.pred = pred

    def forward(self, images):
        return self.pred


def test_evaluate_against_the_mean_box_by_hand():
    nan = math.nan
    boxes = torch.tensor(
        [
            [[0, 0, 2, 2], [nan] * 4],  # one face
            [[2, 2, 4, 4], [nan] * 4],  # one face
            [[nan] * 4, [nan] * 4],  # none: its predictions must not count
        ]
    )
    targets = PaddedTargets(boxes, torch.tensor([1, 1, 0]))
    pred = torch.tensor(
        [
            [[0, 0, 2, 2], [9, 9, 9, 9]],  # exact: IoU 1
            [[2, 2, 4, 3], [9, 9, 9, 9]],  # the lower half: IoU 0.5
            [[0, 0, 1, 1], [0, 0, 1, 1]],
        ],
        dtype=torch.float32,
    )
    batches = [(torch.zeros(3, 1, 4, 4), targets)]
    metrics = evaluate(FixedBoxes(pred), batches, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    assert metrics["boxes"] == 2
    assert metrics["mean_iou"] == pytest.approx(0.75) and metrics["recall50"] == 1.0
    # the mean box (1, 1, 3, 3) overlaps each target by 1 of a union of 7
    assert metrics["trivial_mean_iou"] == pytest.approx(1 / 7) and metrics["trivial_recall50"] == 0.0


# ----------------------------------------------------------------------------- sweep and command line


def test_sweep_runs_each_strategy_on_the_same_seed_and_data(tmp_path, monkeypatch):
    padded = get_strategy("padded")
    registry = {name: STRATEGIES[name] for name in ("loop", "concat", "padded")}
    registry["needs_gpu"] = Strategy("needs_gpu", "padded", padded.fn, "test", lambda device: "no GPU here")
    monkeypatch.setattr(sweep, "STRATEGIES", registry)
    cfg = tiny_cfg(tmp_path, "train.strategy=all", "train.steps=3", "train.checkpoint_every=0")
    summaries = sweep.run_sweep(cfg, "sweep")
    assert [s.strategy for s in summaries] == ["loop", "concat", "padded"]
    for s in summaries[1:]:  # the same model, data and contract: the curves overlap to rounding
        torch.testing.assert_close(losses([s.to_json()]), losses([summaries[0].to_json()]), rtol=1e-5, atol=0)
    table = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "| needs_gpu | skipped: no GPU here" in table
    assert (tmp_path / "sweep" / "loss_curves.png").exists()
    assert all((tmp_path / "sweep" / name / "summary.json").exists() for name in ("loop", "concat", "padded"))


def test_make_train_command_line_runs_the_cpu_smoke_experiment(tmp_path, capsys):
    overrides = [f"train.out_dir={tmp_path}", "train.steps=2", "train.log_every=1", "train.eval_batches=1"]
    assert cli_main(["train", "--experiment", "cpu_smoke", *overrides]) == 0
    out = capsys.readouterr().out
    assert "experiment: cpu_smoke" in out and "eval        2  mean IoU" in out
    # the command's own parts of the start-up are named apart from the interpreter's: the configuration, and the wait
    # for the CUDA context where the run is on a GPU (device=auto: the GPU where there is one)
    startup = next(line for line in out.splitlines() if line.startswith("start-up "))
    assert re.search(r"[:,] interpreter and imports [\d.]+ s", startup), startup
    assert re.search(r", configuration [\d.]+ s", startup), startup
    assert bool(re.search(r", CUDA context [\d.]+ s", startup)) == torch.cuda.is_available(), startup
    run_dir = tmp_path / "cpu_smoke" / "padded"
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoint.json").exists()
    assert list(run_dir.glob("events.out.tfevents.*"))


def test_profiler_window_has_the_regions_of_make_profile(tmp_path):
    window = ["profile.wait=1", "profile.warmup=1", "profile.active=2", "train.profile=true", "train.steps=5"]
    run_training(tiny_cfg(tmp_path, *window, "train.checkpoint_every=0"))
    (trace,) = (tmp_path / "default" / "padded" / "profile").glob("*.pt.trace.json.gz")
    steps = measure_steps(trace)
    assert len(steps) == 2
    regions = ["data wait", "copy data", "forward", "calc loss", "backward", "optimizer step", "other", "step"]
    assert all(list(s.regions) == regions for s in steps)


def test_the_held_out_set_drawn_ahead_by_its_workers_is_the_one_drawn_at_the_evaluation(tmp_path):
    """HeldOut.start(), as the loop calls it with the training loader: its workers draw while the steps run; the batches
    then taken are those a held-out set drawn at the evaluation gets, and close() stops workers not yet read."""
    cfg = tiny_cfg(tmp_path, "device=cpu", "data.num_workers=2", "train.eval_batches=3")
    ahead, at_eval = HeldOut(cfg, torch.device("cpu"), 4), HeldOut(cfg, torch.device("cpu"), 4)
    ahead.start()
    assert ahead.drawing is not None and ahead.drawing.ring is not None  # its workers started
    ahead.start()  # once only
    taken = ahead.batches
    assert ahead.drawing is None and len(taken) == 3 and taken is ahead.batches
    for (images, targets), (again, again_targets) in zip(taken, at_eval.batches, strict=True):
        assert torch.equal(images, again) and torch.equal(targets.boxes, again_targets.boxes)
    unread = HeldOut(cfg, torch.device("cpu"), 4)
    unread.start()
    ring = unread.drawing.ring
    assert ring.workers is not None
    unread.close()
    assert unread.drawing is None and ring.workers is None


def test_a_held_out_worker_that_dies_while_the_steps_run_is_said_at_once_and_replaced(tmp_path):
    """A held-out worker killed while the steps run (an out-of-memory kill, say) is said within the step that follows,
    naming its role, and new workers draw the set again: the batches are those of a set drawn undisturbed. Once every
    batch is drawn, watch takes them and the workers stop; after REPLACEMENTS replacements the next death ends the
    run with its line."""
    cfg = tiny_cfg(tmp_path, "device=cpu", "data.num_workers=2", "train.eval_batches=3")
    held_out, undisturbed, said = HeldOut(cfg, torch.device("cpu"), 4), HeldOut(cfg, torch.device("cpu"), 4), []
    held_out.start()
    victim = held_out.drawing.ring.workers.processes[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    held_out.watch(lambda line, **_: said.append(line))
    (line,) = said
    assert f"held-out worker 2 of 2 (pid {victim.pid}) was killed by SIGKILL" in line
    assert "new workers draw the held-out set again" in line and "replacement 1 of at most 3" in line
    deadline = time.monotonic() + 60
    while held_out.drawing is not None and time.monotonic() < deadline:  # the steps go on; watch between them
        held_out.watch(said.append)
        time.sleep(0.05)
    assert held_out.drawing is None and len(said) == 1  # all drawn: taken, its workers stopped
    for (images, targets), (again, again_targets) in zip(held_out.batches, undisturbed.batches, strict=True):
        assert torch.equal(images, again) and torch.equal(targets.boxes, again_targets.boxes)

    doomed = HeldOut(cfg, torch.device("cpu"), 4)
    doomed.replaced = REPLACEMENTS
    doomed.start()
    victim = doomed.drawing.ring.workers.processes[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    with pytest.raises(DataWorkerDied, match="held-out worker 1 of 2 .* was killed by SIGKILL"):
        doomed.watch(said.append)
    doomed.close()
