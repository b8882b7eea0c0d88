"""How the processes of a run share the model: the class that each way of detector/config/sharing.py names
(``train.shard_optimizer``), each with the interface of ``Replicated`` (replicated.py), so that the step and the loop
use any of them alike.

    AllReduced         replicated.py     DDP for the trunk, EarlyAllReduce for the head's blocks
    ShardedBlocks      blocks.py         ours: ZeRO stage 1 for the head's blocks; DDP for the trunk
    FullyShardedModel  fully_sharded.py  torch's FSDP2
    ZeroOverDDP        zero.py           torch's ZeroRedundancyOptimizer over DDP

One process is ``Replicated``: the model as it is. docs/training.md ("Several GPUs") says what each way sends and
when; ``python -m detector scaling`` measures them against each other.
"""

from __future__ import annotations

import importlib

import torch
from omegaconf import DictConfig

from detector.config.sharing import WAYS, Way
from detector.model import BlockedLinear
from detector.train.distributed.sharding.blocks import ShardedBlocks, shard_refusal
from detector.train.distributed.sharding.replicated import Replicated

__all__ = ["Replicated", "ShardedBlocks", "implementation", "share", "shard_refusal"]


def implementation(way: Way) -> type[Replicated]:
    """The class ``way`` names, its module imported now: ZeRO's imports torch.distributed.optim (a third of a second
    on 2 CPU cores), which a run that shares no model never needs."""
    module, name = way.implementation.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def share(model: torch.nn.Module, cfg: DictConfig, world_size: int, device: torch.device) -> Replicated:
    """``model`` shared among ``world_size`` processes as ``cfg.train.shard_optimizer`` says (one: as it is)."""
    if world_size == 1:
        return Replicated(model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, BlockedLinear)}
    return implementation(WAYS[cfg.train.shard_optimizer])(model, layers, world_size, device, cfg)
