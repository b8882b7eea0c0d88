"""``train.shard_optimizer=blocks``: ZeRO stage 1 for the head's blocks under DDP, our own (``ShardedBlocks``).

Why: an all-reduce of every block's gradient, then every rank running AdamW over all 1.1 B parameters at seed
scale, does the optimizer's work (~38 bytes per parameter) twice over; the reduce and the all-gather together
move the same bytes as that all-reduce. ``python -m detector scaling run`` measures it against plain DDP
and torch's engines.

Clipping needs the global gradient norm: the trunk's (the same on every rank) and the sum over the ranks of
their own blocks' squared norms, one scalar all-reduce with no host wait (``ShardedBlocks.clip``). In a checkpoint
each rank writes its own blocks' rows and their optimizer state, and its share of the trunk's.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from detector.errors import UserError
from detector.train.distributed.sharding.replicated import Replicated, keep_outside_ddp, wrap_ddp
from detector.train.optimizer import OnePassAdamW, norm_scale

# torch 2.13 renamed all_gather_into_tensor (deprecated there); torch 2.11 has only the old name
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_refusal(layers: dict, world_size: int) -> str | None:
    """Why train.shard_optimizer cannot share these BlockedLinear layers' blocks among the ranks, or None."""
    fix = "set model.head_blocks=0 (auto: one block per process) or train.shard_optimizer=false"
    for layer in layers.values():
        if len(layer.blocks) % world_size:
            return f"model.head_blocks={len(layer.blocks)} is not a multiple of the {world_size} processes: {fix}"
        share = len(layer.blocks) // world_size
        rows = {len(layer.rows(r * share, (r + 1) * share)[1]) for r in range(world_size)}
        if len(rows) > 1:
            blocks = f"model.hidden={layer.out_features} in {len(layer.blocks)} blocks"
            return f"{blocks} gives the processes unequal shares of rows: {fix}"
    return None


def reduce_onto_owners(parts: list[tuple[Tensor, int]]) -> list:
    """Reduce each tensor onto its owner rank, in place and without waiting: on NCCL averaged, in one coalescing
    group, so that the ranks send to each other at once; on gloo summed (it has no AVG), one reduce after another.
    Returns the works to wait on. (``async_op=True`` also on NCCL: a synchronous collective runs on the current
    stream, where the backward's kernels would wait for it.)"""
    if dist.get_backend() != dist.Backend.NCCL:
        return [dist.reduce(t, dst=owner, op=dist.ReduceOp.SUM, async_op=True) for t, owner in parts]
    with dist._coalescing_manager(device=parts[0][0].device, async_ops=True) as group:
        for t, owner in parts:
            dist.reduce(t, dst=owner, op=dist.ReduceOp.AVG, async_op=True)
    return [group]


def weak_hook(method):
    """``method`` as a parameter's hook that does not keep its object alive. A parameter keeps its hooks in C++, where
    the garbage collector cannot see them: a hook holding the object that holds the model would be a cycle never
    freed, keeping the object's DDP, and with it the process group and gloo's threads, alive past
    destroy_process_group, until the interpreter exits (where such a thread aborts the process)."""
    ref = weakref.WeakMethod(method)

    def hook(param: Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner(param)

    return hook


class ShardedBlocks(Replicated):
    """ZeRO stage 1 for the head's blocks under DDP: each rank keeps AdamW's state of, and updates, only its
    own share of them; DDP keeps the rest of the model (the trunk) as it was.

    Rank r owns blocks r*k .. r*k+k-1 of each BlockedLinear (k = blocks / world size): consecutive rows
    of the Linear, one tensor (BlockedLinear.rows). A step:

    - backward: once every block has its gradient, each block's gradient is averaged onto its owner
      (``reduce``), all in one NCCL group, so that the ranks send to each other at once;
    - optimizer: each rank's AdamW updates the trunk and its own blocks; other blocks' gradients are dropped;
    - after the optimizer: one all-gather per layer sends each rank's updated rows to the others. It runs
      on NCCL's stream while the next step copies its batch and runs the conv blocks; the layer's forward
      waits for it after computing this rank's own blocks (BlockedLinear.order and before_block).

    Where the forward reads the weights as bf16 copies that the one-pass optimizer writes (autocast; see
    ``detector.model.low_precision``), the all-gather sends those copies: half the bytes of the fp32 rows, and
    no cast of the other ranks' rows before the forward. The forward computes with the same bf16 weights
    either way, so the losses are the same. The other ranks' fp32 rows are then brought up to date only
    where something reads them outside a forward: ``wait_weights`` (a checkpoint, the end of training).
    """

    def __init__(self, model: torch.nn.Module, layers: dict, world_size: int, device: torch.device, cfg=None):
        """``layers``: name -> BlockedLinear, each with a multiple of ``world_size`` blocks in equal shares."""
        reason = shard_refusal(layers, world_size)
        if reason:
            raise UserError(f"train.shard_optimizer=blocks cannot share the head among the processes: {reason}")
        super().__init__(model)
        rank = self.rank = dist.get_rank()
        self.world_size = world_size
        self.description = f"the head's optimizer sharded over the {world_size} processes"
        self.nccl = dist.get_backend() == dist.Backend.NCCL
        self.owner: dict[int, int] = {}  # id of a block parameter -> the rank that updates it
        self.rows = []  # per layer: ((all rows' weight, bias), (this rank's rows' weight, bias))
        keep_outside_ddp(model, [block for name, layer in layers.items() for block in self.share(name, layer)])
        params = list(model.parameters())
        self.block_params = [p for p in params if id(p) in self.owner]  # model order, the same on every rank
        # what this rank's optimizer updates: the trunk and its own blocks, in model order
        self.owned = [p for p in params if self.owner.get(id(p), rank) == rank]
        self.ready: list[Tensor] = []  # block parameters whose gradient this backward has accumulated
        self.grad_works: list = []
        self.weight_works: list[dist.Work] = []
        self.layers = list(layers.values())
        self.low_precision: list[tuple[Tensor, Tensor]] = []  # per layer: (all rows', this rank's rows') bf16 copies
        self.gathered: list[tuple[Tensor, Tensor]] = []  # (weight of an other rank's block, its rows in those copies)
        self.stale = False  # the other ranks' fp32 rows lag their owners' (only the bf16 copies were gathered)
        self.net = wrap_ddp(model, device)

    def share(self, name: str, layer) -> list[str]:
        """Give this rank its share of ``layer``'s blocks (owners, rows, order, hooks); the blocks' names."""
        rank, share = self.rank, len(layer.blocks) // self.world_size
        names = []
        for i, block in enumerate(layer.blocks):
            for pname, param in block.named_parameters():
                self.owner[id(param)] = i // share
                names.append(f"{name}.blocks.{i}.{pname}")
                param.register_post_accumulate_grad_hook(weak_hook(self.accumulated))
        self.rows.append((layer.rows(0, len(layer.blocks)), layer.rows(rank * share, (rank + 1) * share)))
        mine = range(rank * share, (rank + 1) * share)
        layer.order = [*mine, *(i for i in range(len(layer.blocks)) if i not in mine)]
        # gloo finishes an all-gather by copying into the output on a thread of its own, in-place on the
        # rows this rank reads first (an autograd version bump after the forward saved them): wait first
        layer.before_block = lambda i, mine=mine: None if self.nccl and i in mine else self.wait_gathers()
        return names

    def make_optimizer(self, build) -> torch.optim.Optimizer:
        """The optimizer of this rank's parameters; where it writes the forward's bf16 copies of this rank's block
        weights, they become rows of one tensor per layer, which ``gather_weights`` sends whole."""
        optimizer = build(self.owned)
        weights = [block.weight for layer in self.layers for block in layer.blocks]
        mine = [w for w in weights if self.owner[id(w)] == self.rank]
        if isinstance(optimizer, OnePassAdamW) and all(id(w) in optimizer.copy_ids for w in mine):
            for layer, ((whole, _), _) in zip(self.layers, self.rows, strict=True):
                copy = torch.empty_like(whole, dtype=optimizer.copy_dtype)
                starts, share = layer.starts(), len(layer.blocks) // self.world_size
                for i, block in enumerate(layer.blocks):
                    view = copy[starts[i] : starts[i + 1]]
                    if self.owner[id(block.weight)] == self.rank:
                        optimizer.copies[id(block.weight)] = view
                    else:
                        self.gathered.append((block.weight, view))
                self.low_precision.append((copy, copy[starts[self.rank * share] : starts[(self.rank + 1) * share]]))
        return optimizer

    def accumulated(self, param: Tensor) -> None:
        self.ready.append(param)
        if len(self.ready) == len(self.owner):
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Average the ready blocks' gradients onto their owners: one NCCL group (gloo: one after another)."""
        ids, self.ready = {id(p) for p in self.ready}, []
        ready = [p for p in self.block_params if id(p) in ids]  # the same order on every rank, not autograd's
        # gloo sums: wait_gradients divides
        self.grad_works += reduce_onto_owners([(p.grad, self.owner[id(p)]) for p in ready])

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

    def clip(self, max_norm: float, one_pass: bool) -> Tensor | None:
        """``clip_grad_norm_`` of the whole model's gradients (their global norm), on this rank's share: the scale
        for the one-pass optimizer to apply, or None once the gradients are clipped in place."""
        params = [p for p in self.owned if p.grad is not None]
        trunk = [p.grad for p in params if id(p) not in self.owner]
        mine = [p.grad for p in params if id(p) in self.owner]
        squares = torch.nn.utils.get_total_norm(mine).square() if mine else params[0].grad.new_zeros(())
        dist.all_reduce(squares)  # the sum over the ranks of their blocks' squared norms
        total = (torch.nn.utils.get_total_norm(trunk).square() + squares).sqrt()
        if one_pass:  # the optimizer's pass scales the gradients as it reads them: no pass of its own here
            return norm_scale(total, max_norm)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return None

    def gather_weights(self) -> None:
        """Send this rank's updated rows to every rank, without waiting (see ``wait_gathers``): the bf16 copies
        the forward reads where the optimizer writes them (then the fp32 rows lag: ``wait_weights``), else the
        fp32 rows."""
        for (whole, mine), copies in itertools.zip_longest(self.rows, self.low_precision):
            if copies is None:
                pairs = zip(whole, mine, strict=True)
            else:
                pairs = [copies, (whole[1], mine[1])]  # the biases' few kilobytes stay fp32
                self.stale = True
            self.weight_works += [all_gather_single(out, part, async_op=True) for out, part in pairs]
        for weight, view in self.gathered:  # an other rank's rows: the forward reads the gathered copy
            weight.low_precision = (view, weight._version)

    def wait_gathers(self) -> None:
        """Make the current stream wait for the all-gathers of the updated weights (no host wait on NCCL)."""
        for work in self.weight_works:
            work.wait()
        self.weight_works.clear()

    def wait_weights(self) -> None:
        """Before reading the parameters outside a forward: the all-gathers waited for, and where only the bf16
        copies were gathered, the fp32 rows too (every rank calls it)."""
        self.wait_gathers()
        if self.stale:
            for whole, mine in self.rows:
                for out, part in zip(whole, mine, strict=True):
                    all_gather_single(out, part)
            self.stale = False

    def writes(self, param: Tensor, state: bool) -> str:
        if id(param) not in self.owner:
            return "split"  # the trunk: every rank holds it
        return "mine" if self.owner[id(param)] == self.rank else "held"

    def loaded(self) -> None:
        self.stale = False  # every rank's fp32 rows are the checkpoint's; the forward casts them afresh
