"""Data-parallel plumbing: the process group from torchrun's environment, each rank's slice of the data,
and the loss normalised by the *global* number of valid boxes.

Data: a step consumes one global batch of ``world_size * B`` consecutive sample indices; rank r reads the
r-th block of B of them. The union over ranks of step s is therefore exactly the batch a single process
with batch ``world_size * B`` reads at step s, so a run's data does not depend on how many processes
share it, and resuming at step s means starting the indices at ``s * world_size * B``.

Loss: every strategy returns the mean over the valid boxes of its own (rank-local) batch,
``S_r / max(n_r, 1)``. The contract's loss of the global batch is ``sum_r S_r / max(n, 1)`` with
``n = sum_r n_r``. DDP averages gradients over ranks, so each rank back-propagates

    local_loss * n_r / max(n, 1) * world_size   ( = S_r * world_size / max(n, 1) )

and the averaged gradient is ``grad(sum_r S_r) / max(n, 1)``: the gradient of one process on the union
batch. ``n`` comes from one all-reduce of ``[n_r, S_r]`` on the device; the host never waits for it
(the ``list`` layout's n_r is a host integer already: one tiny host-to-device copy).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from detector.config import resolve_device
from detector.data import ListTargets, Targets, build_dataset, loader_for


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # whether we created the process group (and so destroy it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg) -> tuple[DistEnv, torch.device]:
    """The process group (from torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or one already initialised) and
    this rank's device: ``cuda:LOCAL_RANK`` with NCCL on GPUs, the CPU with gloo otherwise."""
    device = resolve_device(cfg)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DistEnv(), device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistEnv(dist.get_rank(), dist.get_world_size(), owns), device


def teardown(env: DistEnv) -> None:
    if env.owns_group:
        # a DDP reducer left in a reference cycle holds the group: freed after its destruction, with the GIL
        # held, it would destroy the gloo group while a gloo thread waits for the GIL. Free it while it lives.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_mean(tensor: Tensor, group=None) -> tuple[dist.Work, bool]:
    """Launch an in-place all-reduce of ``tensor`` towards its mean over the ranks: (the work, whether the
    result still needs dividing by the world size). NCCL averages inside the all-reduce (ReduceOp.AVG);
    gloo (the CPU) has no AVG, so there the caller divides the sum."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True), False
    return dist.all_reduce(tensor, group=group, async_op=True), True


def average_gradients(process_group, bucket):  # -> Future[Tensor]; DDP checks a real annotation, not a string
    """DDP comm hook: a bucket of gradients averaged over the ranks, in place.

    DDP's own hook divides the bucket by the world size in a kernel of its own before a summing all-reduce:
    a full read and write of the 4.3 GB of gradients at seed scale (~1 ms of an H200) on the compute stream,
    and in front of the all-reduce. NCCL averages inside the all-reduce (ReduceOp.AVG); gloo (the CPU) has
    no AVG, so there the sum is divided afterwards.
    """
    group = process_group or dist.group.WORLD
    work, divide = all_reduce_mean(bucket.buffer(), group)
    if divide:
        return work.get_future().then(lambda fut: fut.value()[0].div_(dist.get_world_size(group)))
    return work.get_future().then(lambda fut: fut.value()[0])


class EarlyAllReduce:
    """Averages some parameters' gradients over the ranks outside DDP: each in place, the moment the
    backward has accumulated it (a post-accumulate-grad hook). DDP ignores these parameters.

    Why: DDP first copies each gradient into its bucket. For the head's blocks at seed scale that is
    0.6 ms per 1.1 GB on an H200, on the compute stream (docs/gpu-runs.md, run U). Here
    each block's gradient is all-reduced where autograd put it. Call ``wait`` before reading the
    gradients: it makes the current stream wait for the all-reduces, without blocking the host on NCCL.
    """

    def __init__(self, model: torch.nn.Module, names: list[str]):
        params = dict(model.named_parameters())
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        self.pending: list[tuple[dist.Work, Tensor, bool]] = []
        for name in names:
            dist.broadcast(params[name].detach(), src=0)  # what DDP does for the parameters it owns
            params[name].register_post_accumulate_grad_hook(self.launch)

    def launch(self, param: Tensor) -> None:
        self.pending.append((*all_reduce_mean(param.grad), param.grad))

    def wait(self) -> None:
        for work, divide, grad in self.pending:
            work.wait()
            if divide:
                grad.div_(dist.get_world_size())
        self.pending.clear()


class RankBlocks(torch.utils.data.Dataset):
    """Rank r's view of a dataset: of each global batch of ``world_size * batch`` samples, block r."""

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


def rank_loader(data_cfg, layout: str, device: torch.device, env: DistEnv, start: int, steps: int):
    """This rank's batches of ``steps`` global batches from sample index ``start`` on, in ``layout``."""
    dataset = build_dataset(data_cfg, start, steps * data_cfg.batch_size * env.world_size)
    return loader_for(RankBlocks(dataset, data_cfg.batch_size, env.rank, env.world_size), data_cfg, layout, device)


def count_valid(targets: Targets, device: torch.device) -> Tensor:
    """The number of valid boxes of a batch, a 0-dim fp32 tensor on ``device`` (exact up to 2**24)."""
    if isinstance(targets, ListTargets):
        return torch.tensor(float(sum(b.shape[0] for b in targets.boxes)), device=device)
    return targets.counts.sum().float()


def global_mean(local_loss: Tensor, n_local: Tensor, world_size: int) -> tuple[Tensor, Tensor]:
    """(the loss to back-propagate, the global mean loss to log) from a rank's mean over its own boxes.

    One process: both are ``local_loss`` itself, untouched. Several: see the module docstring.
    """
    if world_size == 1:
        return local_loss, local_loss.detach()
    local_sum = local_loss.detach().float() * n_local
    totals = torch.stack([n_local, local_sum])  # [2]: valid boxes, sum of (1 - GIoU)
    dist.all_reduce(totals)  # the only collective of the loss, launched without a host wait
    n_global = totals[0].clamp(min=1)
    return local_loss * (n_local * world_size / n_global), totals[1] / n_global
