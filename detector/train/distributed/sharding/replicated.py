"""Every rank holds and updates the whole model: ``Replicated`` (one process), and ``AllReduced``
(``train.shard_optimizer=off``: DDP for the trunk, ``EarlyAllReduce`` for the head's blocks). Also the DDP pieces
that the other ways share: the averaging comm hook and ``wrap_ddp``.

``Replicated`` is the interface that every way of sharing offers the step (train/run/step.py) and the loop
(train/run/training_loop.py), so that they use any of them the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from detector.train.distributed.processes import all_reduce_mean
from detector.train.optimizer import clip_scale


def average_gradients(process_group, bucket):  # -> Future[Tensor]; DDP checks a real annotation, not a string
    """DDP comm hook: a bucket of gradients averaged over the ranks, in place.

    DDP's own hook divides the bucket by the world size in a kernel of its own before a summing all-reduce:
    a full read and write of the 4.3 GB of gradients at seed scale on the compute stream, and in front of
    the all-reduce. NCCL averages inside the all-reduce (ReduceOp.AVG); gloo (the CPU) has no AVG, so there
    the sum is divided afterwards.
    """
    group = process_group or dist.group.WORLD
    work, divide = all_reduce_mean(bucket.buffer(), group)
    if divide:
        return work.get_future().then(lambda fut: fut.value()[0].div_(dist.get_world_size(group)))
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.parallel.DistributedDataParallel:
    """``model`` under DDP, as every way but FSDP2 runs it. The settings, after DDP's documentation:

    - ``gradient_as_bucket_view=True``: the gradients live in DDP's all-reduce buckets, so the 4.4 GB of them
      at seed scale are not copied into the buckets and back every step, nor held twice;
    - ``bucket_cap_mb`` at its default (25): each of the head's blocks is hundreds of MB, a bucket of its own
      whatever the cap, and the trunk's few tensors fill two or three buckets;
    - ``static_graph`` off: every parameter is used in every step and ``find_unused_parameters`` is off, so
      DDP searches no graph either way (what static_graph would save), and under torch.compile static_graph
      has had a history with DDP's graph splitting;
    - the averaging inside the all-reduce (``average_gradients``), in place of DDP's division kernel.
    """
    ids = [device] if device.type == "cuda" else None
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    net.register_comm_hook(None, average_gradients)
    return net


def keep_outside_ddp(model: torch.nn.Module, names: list[str]) -> None:
    """Have DDP leave these parameters alone; every rank starts from rank 0's values, as DDP does for its own."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    params = dict(model.named_parameters())
    for name in names:
        dist.broadcast(params[name].detach(), src=0)


class EarlyAllReduce:
    """Averages some parameters' gradients over the ranks outside DDP: each in place, the moment the
    backward has accumulated it (a post-accumulate-grad hook). DDP ignores these parameters.

    Why: DDP first copies each gradient into its bucket: for the head's blocks at seed scale a copy of
    1.1 GB per block, on the compute stream. Here each block's gradient is all-reduced where autograd put
    it. Call ``wait`` before reading the gradients: it makes the current stream wait for the all-reduces,
    without blocking the host on NCCL.
    """

    def __init__(self, model: torch.nn.Module, names: list[str]):
        params = dict(model.named_parameters())
        keep_outside_ddp(model, names)
        self.pending: list[tuple[dist.Work, Tensor, bool]] = []
        for name in names:
            params[name].register_post_accumulate_grad_hook(self.launch)

    def launch(self, param: Tensor) -> None:
        self.pending.append((*all_reduce_mean(param.grad), param.grad))

    def wait(self) -> None:
        for work, divide, grad in self.pending:
            work.wait()
            if divide:
                grad.div_(dist.get_world_size())
        self.pending.clear()


class Replicated:
    """One process: the model as it is, and the interface of every way of sharing it.

    ``net`` is what the step calls, ``owned`` what this rank's optimizer updates, ``collective_forward`` whether
    every rank must take part in each forward (then every rank evaluates with rank 0). A step calls
    ``wait_gradients`` before reading the gradients, ``clip`` for the global gradient norm, and
    ``gather_weights`` after the optimizer; anything that reads the weights outside a forward calls
    ``wait_weights`` first. A checkpoint asks ``writes`` who writes each parameter's rows and its optimizer
    state's (train/checkpoints/state.py: each process writes its part), and a resume calls ``loaded`` once it has put
    the state in place.
    """

    collective_forward = False
    description = ""  # what the loop announces about the sharing (several processes only)

    def __init__(self, model: torch.nn.Module):
        self.model = self.net = model
        self.owned = list(model.parameters())  # model order: the checkpoint's

    def make_optimizer(self, build) -> torch.optim.Optimizer:
        """The optimizer of ``owned``: ``build(params, kind=None)`` is train/run/step.py's ``build_optimizer``."""
        return build(self.owned)

    def local(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer that updates this rank's parameters (``optimizer`` itself but under ZeRO)."""
        return optimizer

    def wait_gradients(self) -> None:
        pass

    def clip(self, max_norm: float, one_pass: bool) -> Tensor | None:
        """Clip by the global gradient norm: the scale for the one-pass optimizer to apply in its pass, or None
        once the gradients are clipped in place (torch's ``clip_grad_norm_``)."""
        if one_pass:
            return clip_scale([p.grad for p in self.owned if p.grad is not None], max_norm)
        torch.nn.utils.clip_grad_norm_(self.owned, max_norm)
        return None

    def gather_weights(self) -> None:
        pass

    def wait_weights(self) -> None:
        pass

    def at_rest(self) -> None:
        """The parameters in the layout a checkpoint reads and writes (FSDP2: its shards, not the gathered weights
        that a forward keeps until the backward)."""

    def writes(self, param: Tensor, state: bool) -> str:
        """Who writes ``param``'s rows in a checkpoint (its optimizer state's, ``state``): ``mine`` (this process
        alone holds them), ``split`` (every process holds them: each writes its share) or ``held`` (their owner
        writes them). One process holds everything."""
        return "mine"

    def loaded(self) -> None:
        """A resume has written the parameters and the optimizer state in place."""


class AllReduced(Replicated):
    """``train.shard_optimizer=off``: DDP averages the trunk's gradients and ``EarlyAllReduce`` the head's blocks'
    (when there are several); every rank then updates the whole model."""

    def __init__(self, model: torch.nn.Module, layers: dict, world_size: int, device: torch.device, cfg=None):
        super().__init__(model)
        split = [(n, m) for n, m in layers.items() if len(m.blocks) > 1]
        self.early = EarlyAllReduce(model, [f"{n}.{p}" for n, m in split for p, _ in m.named_parameters()])
        self.net = wrap_ddp(model, device)
        self.description = f"every one of the {world_size} processes updating the whole model"

    def writes(self, param: Tensor, state: bool) -> str:
        return "split"

    def wait_gradients(self) -> None:
        self.early.wait()
