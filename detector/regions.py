"""The names of a training step's profiler regions: one place for the step that marks them, the loader that
marks its wait, and the lab that reads them back from a trace (detector/lab/measure/analysis.py).

A step is made of the loader's data wait, then copy data, forward, calc loss, backward and optimizer step
(a CUDA-graph step: copy data, then the whole step as one replay). "other" is the step's time outside them;
"step" is the whole ProfilerStep.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

DATA_WAIT = "data wait"
COPY = "copy data"
FORWARD = "forward"
LOSS = "calc loss"
BACKWARD = "backward"
OPTIMIZER = "optimizer step"
GRAPH = "step (CUDA graph)"
OTHER = "other"
STEP = "step"

LAB_REGIONS = (COPY, FORWARD, LOSS, BACKWARD, OPTIMIZER, GRAPH)  # the ones the step marks
REGIONS = (DATA_WAIT, *LAB_REGIONS, OTHER, STEP)  # table order
PARTS = REGIONS[:-1]  # the regions a step is made of
LOSS_REGIONS = LAB_REGIONS  # where one strategy's step differs from another's

# The loader's wait is labelled as torch's DataLoader labels its own, so that tools that know that label
# (TensorBoard's profile plugin, HolisticTraceAnalysis) see data loading; the lab reads it as DATA_WAIT.
LOADER_LABEL = "enumerate(DataLoader)#BatchLoader.__next__"
LOADER_PREFIX = "enumerate(DataLoader)#"
# The synchronize that ends a region under profile.sync_regions=true: the lab measures it on its own.
LAB_SYNC = "lab sync"


def region_of_label(label: str) -> str | None:
    """The region a trace's user annotation marks, or None (a ProfilerStep, a label of someone else's)."""
    if label.startswith(LOADER_PREFIX):
        return DATA_WAIT
    return label if label in LAB_REGIONS else None


class Regions:
    """The step's named profiler regions: free when inactive, a label when active (+ a synchronize with
    ``sync``, the article's protocol)."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.device = device
        self.sync = sync and device.type == "cuda"
        self.active = False  # set by the profiler loop around its warm-up and active steps

    def __call__(self, name: str):
        return self._marked(name) if self.active else contextlib.nullcontext()

    @contextlib.contextmanager
    def _marked(self, name: str):
        with record_function(name):
            yield
            if self.sync:
                with record_function(LAB_SYNC):
                    torch.cuda.synchronize(self.device)
