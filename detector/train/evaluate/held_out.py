"""The held-out set the evaluations read (``HeldOut``): the same images whatever the number of processes, drawn by
workers of its own while the run starts and trains, and kept on the device."""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import DictConfig

from detector.data import build_loader
from detector.data.loader import Batches, DataWorkerDied

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
