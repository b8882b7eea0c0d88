"""One training step, for `make train` and `make profile` alike: what the profile shows is what training does.

    batch to device -> forward (bf16 autocast) -> loss (any strategy) -> backward -> clip -> optimizer
    -> schedule

``TrainStep`` builds the model, the optimizer and the schedule from a config (the same config gives
the same step in both commands) and runs the step eagerly, compiled (``train.compile``) or as one
CUDA graph (``train.cuda_graphs``). ``forward_only`` is the article's protocol (`make profile
MODE=forward`): copy, forward and loss with no gradient.

Profiler regions ("copy data", "forward", "calc loss", "backward", "optimizer step"; a CUDA-graph step
has "copy data" and "step (CUDA graph)") are marked inside the step. They cost nothing unless
``regions.active`` is set: then each is a ``record_function`` label, and nothing else, so the host runs
ahead of the device exactly as in training (detector/analysis.py finds each region's GPU time through the
kernels it launched). With ``profile.sync_regions=true`` (the original article's protocol) each region
also ends in a device synchronize, inside a ``lab sync`` label, so that its wall time holds its own GPU
work; the analysis measures that wait on its own and leaves it out of every other count.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from detector.data import to_device
from detector.errors import UserError
from detector.losses import get_strategy
from detector.model import BlockedLinear, build_model, fused_blocks_unavailable
from detector.model.bias_pool_kernel import bias_pool_unavailable
from detector.regions import BACKWARD, COPY, FORWARD, GRAPH, LOSS, OPTIMIZER, Regions
from detector.targets import PaddedTargets
from detector.train.distributed import (
    EarlyAllReduce,
    FullyShardedModel,
    ShardedBlocks,
    average_gradients,
    count_valid,
    global_mean,
)
from detector.train.float8 import float8_unavailable, to_float8
from detector.train.optimizer import OnePassAdamW, clip_scale

# Why a CUDA graph cannot replay a strategy of this target layout (the step must have static shapes).
GRAPH_REFUSALS = {
    "list": "its targets are a list of [n_i, 4] tensors whose shapes change with every batch, and the loss "
    "reads those sizes on the host (dynamic shapes and host synchronisations), while a graph replays "
    "fixed shapes with no host in the loop",
    "packed": "its [N, 4] boxes change shape with the number of faces N in every batch, "
    "while a graph replays fixed shapes",
}
GRAPH_WARMUP = 3  # eager steps on a side stream before capture, as in PyTorch's whole-network example


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """The learning-rate multiplier of step ``step`` (0-based): linear warm-up to 1, then a cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, tcfg, device: torch.device, low_precision=()) -> torch.optim.Optimizer:
    """AdamW over ``params``: ``OnePassAdamW`` (train.optimizer=one_pass, train/optimizer.py: clipping, AdamW and
    the bf16 copies of ``low_precision`` in one pass, compiled on CUDA), or torch's own (fused on CUDA). With
    CUDA graphs the lr is a device tensor that the schedule updates in place (the graph reads its address)."""
    lr = torch.tensor(tcfg.lr, device=device) if tcfg.cuda_graphs else tcfg.lr
    if tcfg.optimizer == "one_pass":
        cuda = device.type == "cuda"
        return OnePassAdamW(params, lr, tcfg.weight_decay, low_precision if cuda else (), compile=cuda)
    kwargs = {"fused": True} if device.type == "cuda" else {}
    if tcfg.cuda_graphs:
        kwargs["capturable"] = True
    return torch.optim.AdamW(params, lr=lr, weight_decay=tcfg.weight_decay, **kwargs)


def speed_option_refusal(strategy, tcfg, world_size: int, device: torch.device) -> str | None:
    """Why train.cuda_graphs cannot run this strategy here, or None."""
    if not tcfg.cuda_graphs:
        return None
    if strategy.layout in GRAPH_REFUSALS:
        return f"train.cuda_graphs=true cannot capture strategy {strategy.name!r}: {GRAPH_REFUSALS[strategy.layout]}"
    if device.type != "cuda":
        return f"train.cuda_graphs=true needs a CUDA device, this run is on {device}"
    if world_size > 1:
        return "train.cuda_graphs=true runs on one GPU: capturing DDP's gradient all-reduce is not supported here"
    # a capture of the fused blocks' forward and backward under autocast, after a torch.compile in the same process,
    # failed with "operation would make the legacy stream depend on a capturing blocking stream" (torch 2.11, triton
    # 3.6), while the kernels alone capture: refused, and the fused pool's untried kernels with them, until the full
    # step is shown to capture
    fused = {"fused blocks'": "train.fused_blocks=0"} if tcfg.fused_blocks else {}
    fused |= {"fused pool's": "train.fused_pool=false"} if tcfg.fused_pool else {}
    if fused:
        what, fix = " and the ".join(fused), " and ".join(fused.values())
        return f"train.cuda_graphs=true cannot capture the {what} Triton kernels yet: set {fix}"
    return None


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


class TrainStep:
    """The model, its optimizer and schedule, and one call per training step (see the module docstring)."""

    def __init__(self, cfg: DictConfig, device: torch.device, world_size: int = 1):
        tcfg = cfg.train
        self.strategy = get_strategy(tcfg.strategy)
        reason = self.strategy.unavailable(device) or speed_option_refusal(self.strategy, tcfg, world_size, device)
        if reason:
            raise UserError(f"strategy {self.strategy.name!r} cannot train here: {reason}")
        self.device, self.world_size, self.tcfg = device, world_size, tcfg
        torch.manual_seed(tcfg.seed)  # the same seed gives every strategy the same initial model
        with device:  # initialise on the device: a 1.1 B-parameter model initialises in a blink there
            self.model = build_model(cfg.model, cfg.data, world_size)
        if tcfg.channels_last:
            self.model.to(memory_format=torch.channels_last)
            self.model.channels_last = True
        if tcfg.fused_blocks:
            reason = fused_blocks_unavailable(tcfg.fused_blocks, cfg.model.channels, device)
            if reason:
                raise UserError(
                    f"train.fused_blocks={tcfg.fused_blocks} cannot run here: {reason}; set train.fused_blocks=0"
                )
            self.model.fused_blocks = tcfg.fused_blocks
        if tcfg.fused_pool:
            reason = bias_pool_unavailable(device)
            if reason:
                raise UserError(f"train.fused_pool=true cannot run here: {reason}; set train.fused_pool=false")
            self.model.fused_pool = True
        heads = [m for m in self.model.modules() if isinstance(m, BlockedLinear)]
        if tcfg.float8:  # before DDP or sharding wrap the model: the blocks keep their Parameters
            reason = float8_unavailable(cfg, heads, world_size, device)
            if reason:
                raise UserError(f"train.float8=true cannot run here: {reason}; set train.float8=false")
            to_float8(heads, compile=bool(tcfg.compile))
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = bool(tcfg.cudnn_benchmark)
        self.net = self.model
        self.early = self.shard = None  # how the head's blocks are shared under DDP (train/distributed.py)
        params = list(self.model.parameters())
        if world_size > 1:
            modules = self.model.named_modules()
            blocked = {n: m for n, m in modules if isinstance(m, BlockedLinear)}
            if tcfg.shard_optimizer == "fsdp2":  # no DDP: FSDP2 reduce-scatters every gradient itself
                self.shard = FullyShardedModel(self.model, blocked, world_size)
                params = self.shard.owned
                tcfg = OmegaConf.merge(tcfg, {"optimizer": "torch"})  # torch's AdamW steps DTensor shards
            elif tcfg.shard_optimizer == "blocks":
                reason = shard_refusal(blocked, world_size)
                if reason:
                    raise UserError(f"train.shard_optimizer=blocks cannot share the head among the processes: {reason}")
                self.shard = ShardedBlocks(self.model, blocked, dist.get_rank(), world_size)
                params = self.shard.owned
            else:
                split = [(n, m) for n, m in blocked.items() if len(m.blocks) > 1]
                names = [f"{n}.{p}" for n, m in split for p, _ in m.named_parameters()]
                self.early = EarlyAllReduce(self.model, names)
            if self.shard is None or not self.shard.collective_forward:
                ids = [device] if device.type == "cuda" else None
                # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets, so the 4.4 GB of them
                # at seed scale are not copied into the buckets and back every step
                self.net = torch.nn.parallel.DistributedDataParallel(
                    self.model, device_ids=ids, gradient_as_bucket_view=True
                )
                self.net.register_comm_hook(None, average_gradients)
        # the head's weights, which the forward casts to bf16 under autocast: the one-pass optimizer writes that copy;
        # not under train.float8, whose blocks cast the fp32 weights to float8 themselves and would never read it
        head = [p for m in heads for p in m.parameters()] if cfg.autocast and not tcfg.float8 else ()
        self.optimizer = build_optimizer(params, tcfg, device, head)
        schedule = lambda s: lr_factor(s, tcfg.steps, tcfg.warmup_steps, tcfg.lr_min_ratio)  # noqa: E731
        self.scheduler = LambdaLR(self.optimizer, schedule)  # stepped once per optimizer step
        if tcfg.compile:  # the model only: the loss stays the strategy under test (`compiled` is its own one)
            self.net = torch.compile(self.net)
        # cache_enabled=False: required inside CUDA graph capture, and every weight is used once per forward anyway
        self.autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=bool(cfg.autocast), cache_enabled=False
        )
        self.regions = Regions(device, sync=cfg.profile.sync_regions)
        self.graph = GraphedStep(self) if tcfg.cuda_graphs else None

    def __call__(self, batch) -> Tensor:
        """One optimizer step on ``batch``; returns the global mean loss (detached, on the device)."""
        if self.graph is not None:
            loss = self.graph(batch)
        else:
            with self.regions(COPY):
                images, targets = to_device(batch, self.device)
            loss = self.forward_backward(images, targets)
            self.optimizer_step(loss)
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss

    def forward_backward(self, images: Tensor, targets) -> Tensor:
        with self.regions(FORWARD), self.autocast:
            pred = self.net(images)  # [B, M, 4] xyxy
        with self.regions(LOSS):
            n_local = count_valid(targets, self.device)
            loss_backward, loss = global_mean(self.strategy(pred, targets), n_local, self.world_size)
        with self.regions(BACKWARD):
            loss_backward.backward()
        return loss

    def optimizer_step(self, loss: Tensor) -> None:
        with self.regions(OPTIMIZER):
            if self.early is not None:
                self.early.wait()
            if self.shard is not None:
                self.shard.wait_gradients()
            one_pass = isinstance(self.optimizer, OnePassAdamW)
            scale = None
            if self.tcfg.grad_clip > 0 and self.shard is not None:
                self.shard.clip_grad_norm_(self.tcfg.grad_clip)  # the norm needs every rank's share: clipped here
            elif self.tcfg.grad_clip > 0 and one_pass:  # the norm now, the clip inside the optimizer's pass
                scale = clip_scale([p.grad for p in self.model.parameters() if p.grad is not None], self.tcfg.grad_clip)
            elif self.tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
            skip = ~torch.isfinite(loss) if self.tcfg.nonfinite == "skip" else None
            if one_pass:
                self.optimizer.step(scale=scale, skip=skip)
            elif skip is not None and self.optimizer.defaults.get("fused"):
                self.optimizer.found_inf = skip.float()  # the fused kernel skips the update on the device
                self.optimizer.step()
            elif skip is None or not skip.item():  # the CPU has no device to wait for
                self.optimizer.step()
            if self.shard is not None:
                self.shard.gather_weights()

    def wait_weights(self) -> None:
        """Before reading the parameters outside a forward (a checkpoint): wait for the last step's update."""
        if self.shard is not None:
            self.shard.wait_weights()

    def model_state(self) -> dict:
        """The model's state dict in one process's layout. Under fsdp2 every rank must call it (they gather
        the shards onto rank 0); the other ranks get {}."""
        return self.shard.model_state() if self.shard else self.model.state_dict()

    def load_model_state(self, state: dict) -> None:
        """Load a ``model_state`` (this rank's shards of it, under fsdp2)."""
        if self.shard is not None:
            self.shard.load_model_state(state)
        else:
            self.model.load_state_dict(state)

    def optimizer_state(self) -> dict | None:
        """The optimizer's state dict in one process's layout. With a sharded optimizer every rank must call
        it (they send their shares to rank 0); the other ranks get None."""
        return self.shard.full_state_dict(self.optimizer) if self.shard else self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        """Load an ``optimizer_state`` (this rank's share of it, under a sharded optimizer)."""
        if self.shard is not None:
            self.shard.load_state_dict(self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)

    @torch.no_grad()
    def forward_only(self, batch) -> Tensor:
        """The article's protocol: copy, forward and loss, no gradient and no optimizer."""
        with self.regions(COPY):
            images, targets = to_device(batch, self.device)
        with self.regions(FORWARD), self.autocast:
            pred = self.net(images)  # [B, M, 4] xyxy
        with self.regions(LOSS):
            return self.strategy(pred, targets)


class GraphedStep:
    """The whole step, forward to optimizer step, as one CUDA graph over static input buffers.

    The first GRAPH_WARMUP calls run eagerly on a side stream (real steps that also warm up cuBLAS and
    any torch.compile), the next one captures and replays, and every later one copies its batch into
    the buffers and replays. Gradients live in the graph's memory, so they are never set to None.
    """

    def __init__(self, step: TrainStep):
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
