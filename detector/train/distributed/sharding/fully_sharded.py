"""``train.shard_optimizer=fsdp2``: the model under torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), tuned as
its documentation recommends for a model that fits on one GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from detector.train.distributed.sharding.replicated import Replicated


def head_policy(cfg) -> MixedPrecisionPolicy:
    """The head's mixed precision: its weights gathered in bf16 when the forward computes in bf16 (autocast), its
    gradients reduced in fp32.

    - ``param_dtype=bfloat16`` (under autocast only): autocast casts every weight to bf16 before its product
      anyway, so gathering the bf16 cast in place of the fp32 weight halves the head's all-gather (2.1 GB in
      place of 4.3 at seed scale) and its gathered copy, for the same forward. Without autocast the forward
      is fp32 and so is the gather.
    - ``reduce_dtype=float32``: the reduce-scatter sums the ranks' gradients in fp32, as DDP's all-reduce does
      (FSDP2's documentation: reduce in full precision while computing in low precision). The gradient of a
      bf16 weight is bf16, autocast's linear's: on a GPU that rounds the head's gradient to bf16 before the
      reduction, where the other modes take it in fp32 from the product (``_LowPrecisionLinear``); on the CPU
      autocast's linear gives the same bf16 gradient to every mode.

    The trunk (the root unit) keeps fp32 weights: the fused conv blocks' Triton kernels read them in fp32, and
    its ~67 MB gathered in bf16 would save nothing measurable.
    """
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.autocast else None, reduce_dtype=torch.float32)


class FullyShardedModel(Replicated):
    """The model under torch's FSDP2 (``fully_shard``): parameters, gradients and AdamW's state sharded on
    dim 0 over the ranks (DTensors); no DDP.

    Units, and FSDP2's settings for a model that fits on one GPU:

    - **Groups** (FSDP2's only bucket size: each ``fully_shard`` call is one all-gather and one reduce-scatter):
      each BlockedLinear is one unit (its blocks are views read inside its forward, not modules called there,
      so a unit per block would never be gathered), and the root unit holds the rest (the trunk). The head's
      reduce-scatter then runs while the trunk's backward computes.
    - **reshard_after_forward=False** on every unit: the gathered weights stay from the forward to the
      backward, so the backward gathers nothing (the documentation's choice where memory allows; the root's
      default), and the only all-gathers are the forward's.
    - **Prefetching**: the head's all-gather is issued with the trunk's at the start of the forward
      (``set_modules_to_forward_prefetch``), so it runs while the conv blocks compute. With nothing gathered in
      the backward there is nothing to prefetch there.
    - **Mixed precision**: ``head_policy``.

    The reduce-scatter averages over the ranks, as DDP's all-reduce does, so ``global_mean``'s scaling holds. The
    optimizer is torch's AdamW over the DTensor shards (train.optimizer=one_pass reads whole tensors): each rank
    updates its shard of every parameter. Every rank takes part in each forward (an all-gather), so every rank
    evaluates (``collective_forward``). Checkpoints: every rank writes and reads its own shards' rows.
    """

    collective_forward = True

    def __init__(self, model: torch.nn.Module, layers: dict, world_size: int, device: torch.device, cfg):
        """``layers``: name -> BlockedLinear of ``model``."""
        self.model = self.net = model
        self.description = f"the model fully sharded (FSDP2) over the {world_size} processes"
        # FSDP2 shards contiguous parameters only, and its all-gathered weights are contiguous whatever the
        # layout before: the NHWC conv weights (train.channels_last) go back to NCHW, and the convolutions
        # reorder these few kilobytes themselves (cuDNN, and the fused kernels' .contiguous())
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        # the mesh of the model's device (fully_shard's default is the accelerator's, which on a machine with GPUs
        # would move a CPU run's shards to cuda:<rank>) over the run's own group: init_device_mesh would make a new
        # group for it where CUDA is present and the group is gloo, one per model, held past the run's teardown
        mesh = DeviceMesh.from_group(dist.group.WORLD, next(model.parameters()).device.type)
        for layer in layers.values():
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=head_policy(cfg))
            layer._whole = None  # its rows now live in the shards: do not keep a whole copy of the head alive
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model.set_modules_to_forward_prefetch(list(layers.values()))
        self.owned = list(model.parameters())  # this rank's shards (DTensors), in model order

    def make_optimizer(self, build) -> torch.optim.Optimizer:
        return build(self.owned, kind="torch")  # torch's AdamW steps DTensor shards

    def clip(self, max_norm: float, one_pass: bool) -> None:
        """The whole model's gradient norm, clipped in place (the DTensor norm reduces over the shards)."""
        torch.nn.utils.clip_grad_norm_(self.owned, max_norm)

    def at_rest(self) -> None:
        # an evaluation's forward (reshard_after_forward=False) leaves every unit's weights gathered
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def writes(self, param, state: bool) -> str:
        return "mine"
