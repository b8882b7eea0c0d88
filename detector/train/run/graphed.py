"""``train.cuda_graphs``: the whole training step (train/run/step.py), forward to optimizer step, as one CUDA graph."""

from __future__ import annotations

import torch
from torch import Tensor

from detector.data.targets import PaddedTargets
from detector.regions import COPY, GRAPH

GRAPH_WARMUP = 3  # eager steps on a side stream before capture, as in PyTorch's whole-network example


class GraphedStep:
    """The whole step, forward to optimizer step, as one CUDA graph over static input buffers.

    The first GRAPH_WARMUP calls run eagerly on a side stream (real steps that also warm up cuBLAS and
    any torch.compile), the next one captures and replays, and every later one copies its batch into
    the buffers and replays. Gradients live in the graph's memory, so they are never set to None.
    """

    def __init__(self, step):  # a TrainStep
        self.step = step
        self.static: tuple | None = None  # images [B, 1, S, S] uint8, PaddedTargets on the device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: Tensor | None = None
        self.calls = 0

    def __call__(self, batch) -> Tensor:
        images, targets = batch
        if self.static is None:
            device = self.step.device
            boxes, counts = (
                torch.empty_like(targets.boxes, device=device),
                torch.empty_like(targets.counts, device=device),
            )
            self.static = (torch.empty_like(images, device=device), PaddedTargets(boxes, counts))
        s_images, s_targets = self.static
        with self.step.regions(COPY):
            s_images.copy_(images, non_blocking=True)
            s_targets.boxes.copy_(targets.boxes, non_blocking=True)
            s_targets.counts.copy_(targets.counts, non_blocking=True)
        self.calls += 1
        if self.graph is None and self.calls <= GRAPH_WARMUP:
            return self.warm_up()
        if self.graph is None:
            self.capture()
        with self.step.regions(GRAPH):
            self.graph.replay()
        return self.loss.clone()  # the graph overwrites its output at the next replay

    def warm_up(self) -> Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = self.step.forward_backward(*self.static)
            self.step.optimizer_step(loss)
            self.step.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        return loss

    def capture(self) -> None:
        self.step.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        regions = self.step.regions
        active, regions.active = regions.active, False  # no labels or synchronisation inside a capture
        try:
            # thread_local: only this thread's unsafe CUDA calls fail the capture, not another thread's
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.loss = self.step.forward_backward(*self.static)
                self.step.optimizer_step(self.loss)
        except RuntimeError as err:
            raise RuntimeError(
                f"train.cuda_graphs=true: the step with strategy {self.step.strategy.name!r} could not be captured "
                f"in a CUDA graph (it synchronises with the host or changes shapes): {err}"
            ) from err
        finally:
            regions.active = active
