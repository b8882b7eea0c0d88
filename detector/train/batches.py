"""The data a training run reads: its process's share of the training batches from where the run stands, and
the held-out batches it is evaluated on (``train.eval_start`` on, far past any training index)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector.data import build_loader, rank_loader
from detector.loader import BatchLoader
from detector.train.distributed import DistEnv


def training_batches(cfg: DictConfig, layout: str, device: torch.device, env: DistEnv, step: int) -> BatchLoader:
    """This process's batches of steps ``step + 1`` to ``train.steps``: of each global batch, its own block."""
    global_batch = cfg.data.batch_size * env.world_size
    return rank_loader(cfg.data, layout, device, env.rank, env.world_size, step * global_batch, cfg.train.steps - step)


def held_out_set(cfg: DictConfig, device: torch.device, global_batch: int) -> list:
    """train.eval_batches global batches from train.eval_start: the same images whatever the number of processes."""
    length = cfg.train.eval_batches * global_batch
    return list(build_loader(cfg.data, "padded", device, start=cfg.train.eval_start, length=length))
