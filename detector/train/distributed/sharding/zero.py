"""``train.shard_optimizer=zero``: torch's ZeRO stage 1, ``torch.distributed.optim.ZeroRedundancyOptimizer``, over
DDP of the whole model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from detector.train.distributed.sharding.replicated import Replicated, wrap_ddp
from detector.train.optimizer import clip_scale

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


class ZeroOverDDP(Replicated):
    """DDP averages every gradient (``wrap_ddp``: the head's blocks too, each a bucket of its own); torch's
    ``ZeroRedundancyOptimizer`` gives each rank whole parameters to update (its sorted-greedy partition by size:
    with the head in one block per process, each rank gets one block, and the trunk's tensors fill in), and after
    each rank's update broadcasts every parameter from its owner.

    The optimizer each rank runs on its parameters is train.optimizer's (the one pass, or torch's AdamW), built
    by ``build_optimizer``, so the step keeps its semantics:

    - **clipping**: every rank holds every averaged gradient, so it takes the global norm from all of them, with
      no collective; the one pass applies the scale in its pass, torch's AdamW gets its own parameters' gradients
      clipped in place (the others are never read);
    - **the schedule**: ``LambdaLR`` sets the learning rate of ZeRO's parameter group, which ZeRO copies to the
      local optimizer at every step;
    - **train.nonfinite=skip**: the skip flag reaches the local optimizer (the one pass's ``skip``, fused
      AdamW's ``found_inf``).

    What differs from ``blocks`` (ShardedBlocks, the same ZeRO stage 1 of ours): the gradients are all-reduced,
    so every rank receives all of them (twice the bytes of a reduce onto the owner, and the head's block gradient
    copied into its DDP bucket); the updated weights come back by one broadcast per parameter right after the
    step, which the next forward waits for, where ShardedBlocks's all-gather runs under the next forward; the
    one pass writes the bf16 copy of this rank's own head block only (the other is cast at the next forward, as
    torch's pieces do). ``overlap_with_ddp=True`` (the update run inside DDP's comm hook, bucket by bucket) is not
    used: clipping by the global norm needs every gradient before any update. ``parameters_as_bucket_view`` is
    off: with a dozen parameter tensors the broadcasts are few, and a bucket view would move the head's blocks
    out of their one tensor (``BlockedLinear.rows``).

    Checkpoints: every rank writes its share of the replicated parameters and the optimizer state of its own.
    """

    def __init__(self, model: torch.nn.Module, layers: dict, world_size: int, device: torch.device, cfg=None):
        super().__init__(model)
        self.net = wrap_ddp(model, device)
        self.description = f"the optimizer sharded over the {world_size} processes by ZeroRedundancyOptimizer"
        self.mine: list[Tensor] = []  # the parameters this rank's optimizer updates

    def make_optimizer(self, build) -> torch.optim.Optimizer:
        # imported here: torch.distributed.optim takes a third of a second to import, which only a ZeRO run needs
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # ZeRO calls build(param_groups) with this rank's groups; its own groups hold every parameter, model order
        zero = ZeroRedundancyOptimizer(self.owned, optimizer_class=build)
        self.mine = [p for group in zero.optim.param_groups for p in group["params"]]
        return zero

    def local(self, optimizer: ZeroRedundancyOptimizer) -> torch.optim.Optimizer:
        return optimizer.optim

    def clip(self, max_norm: float, one_pass: bool) -> Tensor | None:
        grads = [p.grad for p in self.owned if p.grad is not None]  # every rank's, averaged: the global norm
        if one_pass:
            return clip_scale(grads, max_norm)
        torch.nn.utils.clip_grads_with_norm_(self.mine, max_norm, torch.nn.utils.get_total_norm(grads))
        return None

    def writes(self, param: Tensor, state: bool) -> str:
        return "mine" if state else "split"
