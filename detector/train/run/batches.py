"""The data a training run reads: its process's share of the training batches from where the run stands (each rank
its block of every global batch: ``RankBlocks``), and the held-out batches it is evaluated on (``train.eval_start``
on, far past any training index)."""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import DictConfig

from detector.data import build_dataset, build_loader, loader_for
from detector.data.loader import Batches, BatchLoader, DataWorkerDied
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


# New workers draw the held-out set again after a worker's death this many times; the next death ends the run: a
# machine that keeps killing them (out of memory, say) would otherwise replace them for good
REPLACEMENTS = 3


class HeldOut:
    """train.eval_batches global batches from train.eval_start: the same images whatever the number of processes.
    Drawn by a worker a batch into a ring of that many slots, from ``start()`` (the loop calls it as it starts the
    training loader: the workers draw while the start-up and the steps run, not at the first evaluation), and kept on
    the device for the next evaluations."""

    def __init__(self, cfg: DictConfig, device: torch.device, global_batch: int):
        loader = build_loader(
            cfg.data, "padded", device, start=cfg.train.eval_start, length=cfg.train.eval_batches * global_batch
        )
        self.loader = dataclasses.replace(
            loader, workers=min(loader.workers, loader.batches), slots=loader.batches, role="held-out worker"
        )
        self.taken: list | None = None
        self.drawing: Batches | None = None
        self.replaced = 0  # times its workers died and new ones drew the set again

    def start(self) -> None:
        """Start the workers drawing the held-out batches (where they are not drawn or being drawn already)."""
        if self.taken is None and self.drawing is None:
            self.drawing = iter(self.loader)
            self.drawing.started()

    def watch(self, say) -> None:
        """Between steps, while the workers draw: a worker's death is noticed at once, not at the first evaluation,
        hours later. Its workers draw by index and hold no state, so new workers draw the set again (the line says
        so, naming the worker) up to REPLACEMENTS times; the next death, or a worker that raised, ends the run as
        the training loader's would. Once every batch is drawn, the batches are taken and the workers stopped:
        nothing is left to die."""
        ring = self.drawing.ring if self.drawing is not None else None
        if ring is None or not ring.workers:
            return  # drawn already, not started, or drawn in this process at the first evaluation
        try:
            ring.collect(self.drawing.next, block=False)  # raises a worker's death or error
        except DataWorkerDied as err:
            if type(err) is not DataWorkerDied or self.replaced >= REPLACEMENTS:
                raise
            self.drawing.close()
            self.drawing, self.replaced = None, self.replaced + 1
            say(
                f"warning: {err}: new workers draw the held-out set again, by index as before "
                f"(replacement {self.replaced} of at most {REPLACEMENTS})",
                flush=True,
            )
            self.start()
            return
        if ring.waiting() >= self.loader.batches - self.drawing.next:
            self.taken = list(self.drawing)  # every batch waits in its slot: taken, and the workers stop
            self.drawing = None

    @property
    def batches(self) -> list:
        if self.taken is None:
            self.taken = list(self.drawing if self.drawing is not None else self.loader)
            self.drawing = None
        return self.taken

    def close(self) -> None:
        """Stop workers still drawing (a run that ends before its first evaluation)."""
        drawing, self.drawing = self.drawing, None
        if drawing is not None:
            drawing.close()
