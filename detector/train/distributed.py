"""Data-parallel plumbing: the process group from torchrun's environment, each rank's slice of the data,
the loss normalised by the *global* number of valid boxes, and the three ways the ranks share the model
(train.shard_optimizer): ``ShardedBlocks`` (blocks), ``FullyShardedModel`` (fsdp2), ``EarlyAllReduce`` (off).

Processes: one node or several alike. ``RANK``/``WORLD_SIZE`` are global (the data block, who writes
files: global rank 0); only the device is the node's own, ``cuda:LOCAL_RANK``.

Data: a step consumes one global batch of ``world_size * B`` consecutive sample indices; rank r reads the
r-th block of B of them. The union over ranks of step s is therefore exactly the batch a single process
with batch ``world_size * B`` reads at step s, so a run's data does not depend on how many processes
share it, and resuming at step s means starting the indices at ``s * world_size * B``, whatever number
of processes wrote the checkpoint (train/checkpoint.py: the same global batch is the same run).

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from detector.config import resolve_device
from detector.data import ListTargets, Targets


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
    a full read and write of the 4.3 GB of gradients at seed scale on the compute stream, and in front of
    the all-reduce. NCCL averages inside the all-reduce (ReduceOp.AVG); gloo (the CPU) has no AVG, so there
    the sum is divided afterwards.
    """
    group = process_group or dist.group.WORLD
    work, divide = all_reduce_mean(bucket.buffer(), group)
    if divide:
        return work.get_future().then(lambda fut: fut.value()[0].div_(dist.get_world_size(group)))
    return work.get_future().then(lambda fut: fut.value()[0])


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


# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.11 has only the old name
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedBlocks:
    """ZeRO stage 1 for the head's blocks under DDP: each rank keeps AdamW's state of, and updates, only its
    own share of them; DDP keeps the rest of the model (the trunk) as it was.

    Rank r owns blocks r*k .. r*k+k-1 of each BlockedLinear (k = blocks / world size): consecutive rows
    of the Linear, one tensor (BlockedLinear.rows). A step:

    - backward: once every block has its gradient, each block's gradient is averaged onto its owner
      (``reduce``), all in one NCCL group, so that the ranks send to each other at once;
    - optimizer: each rank's AdamW updates the trunk and its own blocks; other blocks' gradients are dropped;
    - after the optimizer: one all-gather per layer sends each rank's updated rows to the others. It runs
      on NCCL's stream while the next step copies its batch and runs the conv blocks; the layer's forward
      waits for it after computing this rank's own blocks (BlockedLinear.order and before_block), as does
      anything else that reads the weights (``wait_weights``).

    Why: an all-reduce of every block's gradient, then every rank running AdamW over all 1.1 B parameters
    at seed scale, does the optimizer's work (~38 bytes per parameter) twice over; the reduce and the
    all-gather together move the same bytes as that all-reduce. ``make train EXPERIMENT=seed_scale NPROC=2``
    with ``train.shard_optimizer=off`` and with the default measures the difference.

    Clipping needs the global gradient norm: the trunk's (the same on every rank) and the sum over the
    ranks of their own blocks' squared norms, one scalar all-reduce with no host wait (``clip_grad_norm_``).
    Checkpoints keep one process's layout: ``full_state_dict`` gathers the optimizer's state onto rank 0,
    ``load_state_dict`` keeps this rank's share of it, so a run resumes whatever saved it.

    ``FullyShardedModel`` offers the same methods, so that the step and the loop use either the same way.
    """

    STATE = ("step", "exp_avg", "exp_avg_sq")  # AdamW's state of one parameter (no amsgrad)
    collective_forward = False  # the forward reads whole weights: rank 0 evaluates alone

    def __init__(self, model: torch.nn.Module, layers: dict, rank: int, world_size: int):
        """``layers``: name -> BlockedLinear, each with a multiple of ``world_size`` blocks in equal shares."""
        self.model, self.rank, self.world_size = model, rank, world_size
        self.description = f"the head's optimizer sharded over the {world_size} processes"
        self.nccl = dist.get_backend() == dist.Backend.NCCL
        self.params = list(model.parameters())  # one process's optimizer order: the checkpoint's layout
        self.owner: dict[int, int] = {}  # id of a block parameter -> the rank that updates it
        self.rows = []  # per layer: ((all rows' weight, bias), (this rank's rows' weight, bias))
        names = []
        for name, layer in layers.items():
            share = len(layer.blocks) // world_size
            for i, block in enumerate(layer.blocks):
                for pname, param in block.named_parameters():
                    self.owner[id(param)] = i // share
                    names.append(f"{name}.blocks.{i}.{pname}")
                    param.register_post_accumulate_grad_hook(self.accumulated)
            self.rows.append((layer.rows(0, len(layer.blocks)), layer.rows(rank * share, (rank + 1) * share)))
            mine = range(rank * share, (rank + 1) * share)
            layer.order = [*mine, *(i for i in range(len(layer.blocks)) if i not in mine)]
            # gloo finishes an all-gather by copying into the output on a thread of its own, in-place on the
            # rows this rank reads first (an autograd version bump after the forward saved them): wait first
            layer.before_block = lambda i, mine=mine: None if self.nccl and i in mine else self.wait_weights()
        keep_outside_ddp(model, names)
        self.block_params = [p for p in self.params if id(p) in self.owner]  # model order, the same on every rank
        # what this rank's optimizer updates: the trunk and its own blocks, in model order
        self.owned = [p for p in self.params if self.owner.get(id(p), rank) == rank]
        self.ready: list[Tensor] = []  # block parameters whose gradient this backward has accumulated
        self.grad_works: list = []
        self.weight_works: list[dist.Work] = []

    def accumulated(self, param: Tensor) -> None:
        self.ready.append(param)
        if len(self.ready) == len(self.owner):
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Average the ready blocks' gradients onto their owners: one NCCL group (gloo: one after another)."""
        ids, self.ready = {id(p) for p in self.ready}, []
        ready = [p for p in self.block_params if id(p) in ids]  # the same order on every rank, not autograd's
        op = dist.ReduceOp.AVG if self.nccl else dist.ReduceOp.SUM  # gloo has no AVG: divided in wait_gradients
        if not self.nccl:
            self.grad_works += [dist.reduce(p.grad, dst=self.owner[id(p)], op=op, async_op=True) for p in ready]
            return
        # async_op=True: a synchronous one runs on the current stream, where the backward's kernels would wait
        with dist._coalescing_manager(device=ready[0].grad.device, async_ops=True) as group:
            for p in ready:
                dist.reduce(p.grad, dst=self.owner[id(p)], op=op, async_op=True)
        self.grad_works.append(group)

    def wait_gradients(self) -> None:
        """Make the current stream wait for the reduces; keep this rank's blocks' gradients, drop the others'."""
        if self.ready:  # some block had no gradient: reduce the others all the same (every rank does likewise)
            self.reduce_gradients()
        for work in self.grad_works:
            work.wait()
        self.grad_works.clear()
        for param in self.block_params:
            if self.owner[id(param)] != self.rank:
                param.grad = None  # a partial sum; freed for the next backward
            elif param.grad is not None and not self.nccl:
                param.grad.div_(self.world_size)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """``clip_grad_norm_`` of the whole model's gradients (their global norm), on this rank's share."""
        params = [p for p in self.owned if p.grad is not None]
        trunk = [p.grad for p in params if id(p) not in self.owner]
        mine = [p.grad for p in params if id(p) in self.owner]
        squares = torch.nn.utils.get_total_norm(mine).square() if mine else params[0].grad.new_zeros(())
        dist.all_reduce(squares)  # the sum over the ranks of their blocks' squared norms
        total = (torch.nn.utils.get_total_norm(trunk).square() + squares).sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def gather_weights(self) -> None:
        """Send this rank's updated rows to every rank, without waiting (see ``wait_weights``)."""
        for whole, mine in self.rows:
            for out, part in zip(whole, mine, strict=True):
                self.weight_works.append(all_gather_single(out, part, async_op=True))

    def wait_weights(self) -> None:
        """Make the current stream wait for the all-gathers of the updated weights (no host wait on NCCL)."""
        for work in self.weight_works:
            work.wait()
        self.weight_works.clear()

    def full_state_dict(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The optimizer's state dict in one process's layout, on rank 0 (None on the others): every rank
        calls it; each other rank sends the state of its own blocks to rank 0."""
        own = optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(self.owned)}
        state = {}
        for i, param in enumerate(self.params):
            owner = self.owner.get(id(param), 0)  # the trunk: every rank has its state, rank 0 writes its own
            if self.rank == 0 and owner == 0 and index[id(param)] in own["state"]:
                state[i] = own["state"][index[id(param)]]
            elif self.rank == 0 and owner != 0:
                received = self.receive_state(param, owner)
                if received is not None:
                    state[i] = received
            elif self.rank == owner != 0:
                self.send_state(param, optimizer.state.get(param, {}))
        if self.rank != 0:
            return None
        (group,) = own["param_groups"]  # build_optimizer makes one group
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def send_state(self, param: Tensor, state: dict) -> None:
        has = torch.tensor([bool(state)], dtype=torch.int32, device=param.device)  # none before the first step
        dist.send(has, dst=0)
        for key in self.STATE if state else ():
            dist.send(state[key].to(param.device), dst=0)

    def receive_state(self, param: Tensor, owner: int) -> dict | None:
        has = torch.zeros(1, dtype=torch.int32, device=param.device)
        dist.recv(has, src=owner)
        if not has.item():
            return None
        state = {"step": torch.zeros((), dtype=torch.float32, device=param.device)}
        state |= {key: torch.empty_like(param, memory_format=torch.contiguous_format) for key in self.STATE[1:]}
        for key in self.STATE:
            dist.recv(state[key], src=owner)
        return state

    def model_state(self) -> dict:
        return self.model.state_dict()  # every rank holds the whole model once wait_weights has run

    def load_model_state(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def load_state_dict(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        """Load this rank's share of a one-process-layout optimizer state dict (``full_state_dict``'s)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = [index[id(p)] for p in self.owned]
        (group,) = full["param_groups"]
        optimizer.load_state_dict(
            {
                "state": {j: full["state"][i] for j, i in enumerate(mine) if i in full["state"]},
                "param_groups": [{**group, "params": list(range(len(mine)))}],
            }
        )


class FullyShardedModel:
    """The model under torch's FSDP2 (``fully_shard``): parameters, gradients and AdamW's state sharded on
    dim 0 over the ranks (DTensors); no DDP. ``train.shard_optimizer=fsdp2``.

    Units: each BlockedLinear is one unit (its blocks are views inside its forward, not modules called
    there, so a unit per block would never be gathered); the root unit holds the rest (the trunk). A step:
    the forward all-gathers each unit (the head's all-gather is issued with the trunk's, ahead of its use:
    ``set_modules_to_forward_prefetch``), ``reshard_after_forward=False`` keeps the gathered weights for the
    backward, whose end reduce-scatters each unit's gradient (averaged over the ranks, as DDP's all-reduce,
    so ``global_mean``'s scaling holds); the head's reduce-scatter runs while the trunk's backward computes.
    The optimizer (torch's AdamW over the DTensor shards) updates this rank's shard of every parameter.

    Against ShardedBlocks: the same bytes on the wire (a reduce-scatter and an all-gather per step), the
    optimizer's work split likewise, and the trunk sharded too; what FSDP2 adds is its copies into and out of
    its flat communication buffers. ``docs/training.md`` ("Measuring the sharding on 2 GPUs") compares them.

    Every rank takes part in each forward (an all-gather), so every rank evaluates (``collective_forward``).
    Checkpoints keep one process's layout: ``torch.distributed.checkpoint.state_dict`` with
    ``full_state_dict=True`` gathers the model and the optimizer state onto rank 0 keyed by parameter name,
    and on load shards the whole state that every rank read.
    """

    collective_forward = True

    def __init__(self, model: torch.nn.Module, layers: dict, world_size: int):
        """``layers``: name -> BlockedLinear of ``model``."""
        self.model = model
        self.description = f"the model fully sharded (FSDP2) over the {world_size} processes"
        # FSDP2 shards contiguous parameters only, and its all-gathered weights are contiguous whatever the
        # layout before: the NHWC conv weights (train.channels_last) go back to NCHW, and the convolutions
        # reorder these few kilobytes themselves (cuDNN, and the fused kernels' .contiguous())
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        # the mesh of the model's device: fully_shard's default is the accelerator's, which on a machine with
        # GPUs would move a CPU (gloo) run's shards to cuda:<rank>
        mesh = init_device_mesh(next(model.parameters()).device.type, (world_size,))
        for layer in layers.values():
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            layer._whole = None  # its rows now live in the shards: do not keep a whole copy of the head alive
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model.set_modules_to_forward_prefetch(list(layers.values()))
        self.owned = list(model.parameters())  # this rank's shards (DTensors), in model order
        self.names = [name for name, _ in model.named_parameters()]  # the state dicts' keys, in model order

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """The whole model's gradient norm, clipped (the DTensor norm reduces over the shards)."""
        return torch.nn.utils.clip_grad_norm_(self.owned, max_norm).full_tensor()

    def wait_gradients(self) -> None:
        pass  # FSDP2 waits for its reduce-scatters at the end of the backward

    def gather_weights(self) -> None:
        pass  # FSDP2 all-gathers in the next forward

    def wait_weights(self) -> None:
        pass

    def options(self, gather: bool):
        # gather: the whole state onto rank 0's CPU memory only; load: every rank holds the whole state it read
        return StateDictOptions(full_state_dict=True, cpu_offload=gather)

    def model_state(self) -> dict:
        """The whole model's state dict on rank 0 ({} on the others): every rank calls it."""
        return get_model_state_dict(self.model, options=self.options(gather=True))

    def load_model_state(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=self.options(gather=False))

    def full_state_dict(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The optimizer's state dict in one process's layout (indices in model order) on rank 0, None on
        the others: every rank calls it."""
        full = get_optimizer_state_dict(self.model, optimizer, options=self.options(gather=True))
        if dist.get_rank() != 0:
            return None
        index = {name: i for i, name in enumerate(self.names)}
        (group,) = full["param_groups"]  # build_optimizer makes one group
        return {
            "state": {index[name]: state for name, state in full["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}],
        }

    def load_state_dict(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        """Load this rank's shards of a one-process-layout optimizer state dict (``full_state_dict``'s)."""
        (group,) = full["param_groups"]
        by_name = {
            "state": {self.names[i]: state for i, state in full["state"].items()},
            "param_groups": [{**group, "params": [self.names[i] for i in group["params"]]}],
        }
        set_optimizer_state_dict(self.model, optimizer, by_name, options=self.options(gather=False))


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
