"""ShardedBlocks (train.shard_optimizer=blocks) where the one-pass optimizer writes the forward's bf16 weights: the
all-gather sends those copies, the forward reads them, and the fp32 rows catch up where something reads them
outside a forward (``wait_weights``). Two gloo processes against one process's AdamW on the same global batch.

On a GPU this is the default path (autocast, train.optimizer=one_pass); on the CPU the step builds no bf16 copies
(the forward is fp32 there), so the test builds the optimizer with them itself."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from train_helpers import spawn_two

from detector.model import BlockedLinear, low_precision
from detector.train.distributed.sharding import ShardedBlocks
from detector.train.optimizer import OnePassAdamW

STEPS, LR, DECAY, MAX_NORM = 3, 1e-2, 0.1, 0.05  # a max norm the gradients exceed: the clip scale is used


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 12), BlockedLinear(12, 8, 2))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def reference() -> list[torch.Tensor]:
    """One process: the whole batch, torch's AdamW, clip_grad_norm_; the head's weight after each step."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=DECAY)
    weights = []
    for step in range(STEPS):
        loss = sum(net(batch(step, rank)).square().mean() for rank in range(2)) / 2  # each rank's mean, averaged
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights.append(net[1].rows(0, 2)[0].detach().clone())
    return weights


def _two_processes(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    net = model()
    head = net[1]
    sharing = ShardedBlocks(net, {"1": head}, 2, torch.device("cpu"))
    optimizer = sharing.make_optimizer(
        lambda params: OnePassAdamW(params, LR, DECAY, low_precision=list(head.parameters()))
    )
    found = {"forward reads": [], "fp32 lags": [], "fp32 after wait": []}
    for step in range(STEPS):
        sharing.net(batch(step, rank)).square().mean().backward()
        sharing.wait_gradients()
        optimizer.step(scale=sharing.clip(MAX_NORM, one_pass=True))
        optimizer.zero_grad(set_to_none=True)
        sharing.gather_weights()
        sharing.wait_gathers()
        read = torch.cat([low_precision(block.weight, torch.bfloat16) for block in head.blocks])
        found["forward reads"].append(read.float().tolist())
        other = head.blocks[1 - rank].weight.detach().clone()
        sharing.wait_weights()
        found["fp32 lags"].append(not torch.equal(other, head.blocks[1 - rank].weight))
        found["fp32 after wait"].append(head.rows(0, 2)[0].tolist())
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))


def test_the_gathered_bf16_copies_are_what_the_forward_reads_and_the_fp32_rows_catch_up(tmp_path):
    spawn_two(_two_processes, str(tmp_path), timeout=120)
    expected = reference()
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for step in range(STEPS):
            whole = torch.tensor(found["fp32 after wait"][step])
            # two processes sum the gradient in another order than one: Adam's sqrt(v) magnifies its rounding
            torch.testing.assert_close(whole, expected[step], rtol=1e-4, atol=1e-6)
            # what the forward reads is exactly the bf16 of the updated fp32 weights, the other rank's rows included
            assert torch.equal(torch.tensor(found["forward reads"][step]), whole.bfloat16().float())
            # the other rank's fp32 rows were not sent with the copies: wait_weights brought them
            assert found["fp32 lags"][step], f"rank {rank}, step {step}: the fp32 rows were already current"
