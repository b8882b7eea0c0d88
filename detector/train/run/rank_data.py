"""The data a training run reads: its process's share of the training batches from where the run stands (each rank
its block of every global batch: ``RankBlocks``), and the held-out batches it is evaluated on (``train.eval_start``
on, far past any training index)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector.data import build_dataset, loader_for
from detector.data.loader import BatchLoader
from detector.train.distributed.processes import DistEnv


class RankBlocks(torch.utils.data.Dataset):
    """Rank r's view of a dataset: of each global batch of ``world_size * batch`` samples, block r. The
    union over the ranks is the single process's batch, so DDP sees the same images as one process."""

    def __init__(self, dataset, batch: int, rank: int, world_size: int):
        if len(dataset) % (batch * world_size):
            raise ValueError(
                f"dataset length {len(dataset)} is not a multiple of the global batch {batch * world_size}"
            )
        self.dataset, self.batch, self.rank, self.world_size = dataset, batch, rank, world_size

    def __len__(self) -> int:
        return len(self.dataset) // self.world_size

    def __getitem__(self, i: int):
        return self.dataset[self.dataset_index(i)]

    def dataset_index(self, i: int) -> int:
        step, j = divmod(i, self.batch)
        return (step * self.world_size + self.rank) * self.batch + j

    @property
    def sampler(self):
        return self.dataset.sampler

    def sample_index(self, i: int) -> int:
        """The sampler's index of item i, so that the loader draws whole batches through the sampler."""
        return self.dataset.sample_index(self.dataset_index(i))


def rank_loader(cfg, layout: str, device: torch.device, rank: int, world_size: int, start: int, steps: int):
    """Process ``rank``'s batches of ``steps`` global batches from sample index ``start`` on, in ``layout``."""
    dataset = build_dataset(cfg, start, steps * cfg.batch_size * world_size)
    return loader_for(RankBlocks(dataset, cfg.batch_size, rank, world_size), cfg, layout, device)


def training_batches(cfg: DictConfig, layout: str, device: torch.device, env: DistEnv, step: int) -> BatchLoader:
    """This process's batches of steps ``step + 1`` to ``train.steps``: of each global batch, its own block."""
    global_batch = cfg.data.batch_size * env.world_size
    return rank_loader(cfg.data, layout, device, env.rank, env.world_size, step * global_batch, cfg.train.steps - step)
