"""Data-parallel plumbing: the process group from torchrun's environment, each rank's slice of the data,
and the loss normalised by the *global* number of valid boxes. How the ranks share the model
(train.shard_optimizer) is detector/train/distributed/sharding/.

Processes: one node or several alike. ``RANK``/``WORLD_SIZE`` are global (the data block, who writes
files: global rank 0); only the device is the node's own, ``cuda:LOCAL_RANK``.

Data: a step consumes one global batch of ``world_size * B`` consecutive sample indices; rank r reads the
r-th block of B of them. The union over ranks of step s is therefore exactly the batch a single process
with batch ``world_size * B`` reads at step s, so a run's data does not depend on how many processes
share it, and resuming at step s means starting the indices at ``s * world_size * B``, whatever number
of processes wrote the checkpoint (train/checkpoints/state.py: the same global batch is the same run).

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
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from detector.config.device import resolve_device
from detector.data import ListTargets, Targets
from detector.errors import PeerLost, UserError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # whether we created the process group (and so destroy it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def before_groups() -> None:
    """Import, before any process group exists, torch's modules whose functions take ``group=group.WORLD`` as a default
    argument: each binds it when first imported, and imported after init_process_group it holds the default group for
    the life of the process, which destroy_process_group then cannot end (gloo's threads run on; see teardown).
    torch._dynamo imports the first, so torch.compile's first import would bind it. Imported here, their default is
    None. A process of one, which makes no group, never imports them (FSDP, DTensor and ZeRO: about 0.7 s)."""
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401
    import torch.distributed.nn  # noqa: F401
    import torch.distributed.optim.zero_redundancy_optimizer  # noqa: F401


def setup(cfg) -> tuple[DistEnv, torch.device]:
    """The process group (from torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or one already initialised) and
    this rank's device: ``cuda:LOCAL_RANK`` with NCCL on GPUs, the CPU with gloo otherwise."""
    device = resolve_device(cfg)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DistEnv(), device
    if not dist.is_initialized():  # a group made by the caller came after its own imports: not ours to order
        before_groups()
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
        release_meshes()
        gc.collect()
        # NCCL's barrier on this process's device (the one it computes on; torch warns where it has to guess)
        nccl = dist.get_backend() == dist.Backend.NCCL
        dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)
        dist.destroy_process_group()


def release_meshes() -> None:
    """Make every DeviceMesh still alive let go of its process groups (``_pg_registry``, torch's private map from a
    group's name to the group).

    Why: a mesh outlives the model that made it. DTensor's sharding caches keep it, and so do references from
    torch's C++ dispatch that no cache clearing releases (torch 2.11). The mesh keeps the group alive, and the
    group keeps gloo's threads running past destroy_process_group. Emptying the map releases the group whatever
    holds the mesh; no mesh is used after its group is destroyed."""
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    if device_mesh is None:  # no mesh was ever made
        return
    for obj in gc.get_objects():
        # the class's own MRO, not isinstance: DeviceMesh's metaclass would ask every object of the process for
        # attributes, deprecated ones of torch's included (each a warning)
        if device_mesh.DeviceMesh in type(obj).__mro__:
            getattr(obj, "_pg_registry", {}).clear()


# how gloo and NCCL report a collective whose peer is gone (killed, or its machine down)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def lost_peer(err: BaseException) -> PeerLost | None:
    """``err`` as a ``PeerLost``, where a collective failed because another process is gone; else None."""
    text = " ".join(str(err).split())
    return (
        PeerLost(f"another process of this run stopped ({text[:200]})") if any(p in text for p in PEER_GONE) else None
    )


class Control:
    """The run's control messages between its processes, on a gloo group of their own (never behind a step's NCCL
    work): the token of the run's checkpoint folders, whether they share the run folder, and the stop vote.

    ``stop_vote(requested)`` is called by every process once a step: it sends whether this process was asked to
    stop (SIGTERM, Ctrl-C) without waiting, and returns whether any process had been asked at the previous call,
    by then long delivered. Every process gets the same answer at the same step, so all stop at the same step,
    after one checkpoint, even where the signal reached only some of them. A process that died fails the vote at
    once (gloo's connection closes): ``PeerLost``.
    """

    def __init__(self, env: DistEnv):
        self.group = dist.new_group(backend="gloo") if env.world_size > 1 else None
        self.vote: tuple[dist.Work, Tensor] | None = None

    def broadcast(self, value):
        """Process 0's ``value``, on every process."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value) -> list:
        """Every process's ``value``, in rank order, on every process."""
        if self.group is None:
            return [value]
        values = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(values, value, group=self.group)
        return values

    def close(self) -> None:
        """The last vote waited for and the group ended (a group left to the interpreter's exit keeps gloo's threads,
        which may then abort the process); where a process is gone, left as it is."""
        if self.group is None:
            return
        try:
            if self.vote is not None:
                self.vote[0].wait()
            dist.destroy_process_group(self.group)
        except RuntimeError:
            pass  # a peer gone: this process ends now anyway (PeerLost)
        self.group = self.vote = None

    def stop_vote(self, requested: bool) -> bool:
        if self.group is None:
            return requested
        decided = False
        try:
            if self.vote is not None:
                work, flag = self.vote
                work.wait()
                decided = bool(flag.item())
            flag = torch.tensor([int(requested)])
            self.vote = (dist.all_reduce(flag, group=self.group, async_op=True), flag)
        except RuntimeError as err:  # gloo: a peer's connection closed
            raise (lost_peer(err) or PeerLost(f"another process of this run stopped ({err})")) from err
        return decided


def shared_folder(run_dir: Path, mark: str, control: Control, is_main: bool) -> str:
    """Process 0's ``mark``, once every process of the run (``control``: distributed.Control) has found it in
    ``run_dir``: each writes its part of a checkpoint there, so on several nodes train.out_dir must be a folder they
    share; refused in one line on every process."""
    path = run_dir / f".shared-{mark}"
    if is_main:
        path.touch()
    mark = control.broadcast(mark)  # after process 0 made the file
    found = control.gather((run_dir / f".shared-{mark}").exists())
    if is_main:
        path.unlink(missing_ok=True)
    if not all(found):
        missing = [rank for rank, ok in enumerate(found) if not ok]
        raise UserError(
            f"rank(s) {missing} do not see the run folder {run_dir} that rank 0 writes: every process writes its part "
            "of a checkpoint there, so on several nodes train.out_dir must be a folder that every node shares"
        )
    return mark


def all_reduce_mean(tensor: Tensor, group=None) -> tuple[dist.Work, bool]:
    """Launch an in-place all-reduce of ``tensor`` towards its mean over the ranks: (the work, whether the
    result still needs dividing by the world size). NCCL averages inside the all-reduce (ReduceOp.AVG);
    gloo (the CPU) has no AVG, so there the caller divides the sum."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True), False
    return dist.all_reduce(tensor, group=group, async_op=True), True


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
