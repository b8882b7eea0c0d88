"""How the processes of a run share the model: ``train.shard_optimizer``, one class per way, each with the interface
of ``Replicated`` (replicated.py), so that the step and the loop use any of them alike.

    off      AllReduced         DDP for the trunk, EarlyAllReduce for the head's blocks; every rank updates all
    blocks   ShardedBlocks      ours: ZeRO stage 1 for the head's blocks (reduce onto the owner, all-gather under
                                the next forward); DDP for the trunk
    fsdp2    FullyShardedModel  torch's FSDP2: parameters, gradients and optimizer state sharded
    zero     ZeroOverDDP        torch's ZeRO stage 1: ZeroRedundancyOptimizer over DDP of the whole model

One process is ``Replicated``: the model as it is. docs/training.md ("Several GPUs") says what each way sends and
when; ``python -m detector.bench.sharding`` measures them against each other.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector.model import BlockedLinear
from detector.train.sharding.blocks import ShardedBlocks, shard_refusal
from detector.train.sharding.fully_sharded import FullyShardedModel
from detector.train.sharding.replicated import AllReduced, Replicated
from detector.train.sharding.zero import ZeroOverDDP

WAYS = {"off": AllReduced, "blocks": ShardedBlocks, "fsdp2": FullyShardedModel, "zero": ZeroOverDDP}

__all__ = ["WAYS", "Replicated", "share", "shard_refusal"]


def share(model: torch.nn.Module, cfg: DictConfig, world_size: int, device: torch.device) -> Replicated:
    """``model`` shared among ``world_size`` processes as ``cfg.train.shard_optimizer`` says (one: as it is)."""
    if world_size == 1:
        return Replicated(model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, BlockedLinear)}
    return WAYS[cfg.train.shard_optimizer](model, layers, world_size, device, cfg)
