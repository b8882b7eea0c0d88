"""The data a training run reads: its process's share of the training batches from where the run stands, and
the held-out batches it is evaluated on (``train.eval_start`` on, far past any training index)."""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import DictConfig

from detector.data import build_loader, rank_loader
from detector.loader import BatchLoader
from detector.train.distributed import DistEnv


def training_batches(cfg: DictConfig, layout: str, device: torch.device, env: DistEnv, step: int) -> BatchLoader:
    """This process's batches of steps ``step + 1`` to ``train.steps``: of each global batch, its own block."""
    global_batch = cfg.data.batch_size * env.world_size
    return rank_loader(cfg.data, layout, device, env.rank, env.world_size, step * global_batch, cfg.train.steps - step)


class HeldOut:
    """train.eval_batches global batches from train.eval_start: the same images whatever the number of processes.
    Drawn at the first evaluation, by a worker a batch into a ring of that many slots (nothing of it at start-up,
    where nothing needs it), and kept on the device for the next ones."""

    def __init__(self, cfg: DictConfig, device: torch.device, global_batch: int):
        loader = build_loader(
            cfg.data, "padded", device, start=cfg.train.eval_start, length=cfg.train.eval_batches * global_batch
        )
        self.loader = dataclasses.replace(loader, workers=min(loader.workers, loader.batches), slots=loader.batches)
        self.taken: list | None = None

    @property
    def batches(self) -> list:
        if self.taken is None:
            self.taken = list(self.loader)
        return self.taken
