"""One training step, for `make train` and `make profile` alike: what the profile shows is what training does.

    batch to device -> forward (bf16 autocast) -> loss (any strategy) -> backward -> clip -> optimizer
    -> schedule

``TrainStep`` builds the model (with train/run/speed_options.py's options), shares it among the processes
(train/distributed/sharding/), and builds the optimizer and the schedule from a config (the same config gives the same
step in both commands); it runs the step eagerly, compiled (``train.compile``) or as one CUDA graph
(``train.cuda_graphs``, train/run/graphed.py). ``forward_only`` is the article's protocol (`make profile
MODE=forward`): copy, forward and loss with no gradient.

Profiler regions ("copy data", "forward", "calc loss", "backward", "optimizer step"; a CUDA-graph step
has "copy data" and "step (CUDA graph)") are marked inside the step. They cost nothing unless
``regions.active`` is set: then each is a ``record_function`` label, and nothing else, so the host runs
ahead of the device exactly as in training (detector/lab/measure/analysis.py finds each region's GPU time through the
kernels it launched). With ``profile.sync_regions=true`` (the original article's protocol) each region
also ends in a device synchronize, inside a ``lab sync`` label, so that its wall time holds its own GPU
work; the analysis measures that wait on its own and leaves it out of every other count.
"""

from __future__ import annotations

import functools
import math
import time
from itertools import pairwise

import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from detector.data import to_device
from detector.errors import UserError
from detector.losses import get_strategy
from detector.model import BlockedLinear, compile_model
from detector.regions import BACKWARD, COPY, FORWARD, LOSS, OPTIMIZER, Regions
from detector.train.distributed.processes import count_valid, global_mean
from detector.train.distributed.sharding import Replicated, share
from detector.train.optimizer import OnePassAdamW
from detector.train.run.graphed import GraphedStep
from detector.train.run.speed_options import build_trained_model, speed_option_refusal


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """The learning-rate multiplier of step ``step`` (0-based): linear warm-up to 1, then a cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, tcfg, device: torch.device, low_precision=(), kind: str | None = None):
    """AdamW over ``params`` (tensors or parameter groups): ``OnePassAdamW`` (train.optimizer=one_pass,
    train/optimizer.py: clipping, AdamW and the bf16 copies of ``low_precision`` in one pass, compiled on CUDA),
    or torch's own (fused on CUDA); ``kind`` in place of train.optimizer where a way of sharing needs torch's.
    With CUDA graphs the lr is a device tensor that the schedule updates in place (the graph reads its address)."""
    lr = torch.tensor(tcfg.lr, device=device) if tcfg.cuda_graphs else tcfg.lr
    if (kind or tcfg.optimizer) == "one_pass":
        cuda = device.type == "cuda"
        return OnePassAdamW(params, lr, tcfg.weight_decay, low_precision if cuda else (), compile=cuda)
    kwargs = {"fused": True} if device.type == "cuda" else {}
    if tcfg.cuda_graphs:
        kwargs["capturable"] = True
    return torch.optim.AdamW(params, lr=lr, weight_decay=tcfg.weight_decay, **kwargs)


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
        self.model = build_trained_model(cfg, device, world_size)
        # the head's weights, which the forward casts to bf16 under autocast: the one-pass optimizer writes that copy;
        # not under train.float8, whose blocks cast the fp32 weights to float8 themselves and would never read it
        heads = [m for m in self.model.modules() if isinstance(m, BlockedLinear)]
        head = [p for m in heads for p in m.parameters()] if cfg.autocast and not tcfg.float8 else ()
        self.sharing: Replicated = share(self.model, cfg, world_size, device)
        self.optimizer = self.sharing.make_optimizer(
            functools.partial(build_optimizer, tcfg=tcfg, device=device, low_precision=head)
        )
        self.one_pass = isinstance(self.sharing.local(self.optimizer), OnePassAdamW)
        schedule = lambda s: lr_factor(s, tcfg.steps, tcfg.warmup_steps, tcfg.lr_min_ratio)  # noqa: E731
        self.scheduler = LambdaLR(self.optimizer, schedule)  # stepped once per optimizer step
        # the model only: the loss stays the strategy under test (`compiled` is its own one)
        self.net = compile_model(self.sharing.net) if tcfg.compile else self.sharing.net
        # cache_enabled=False: required inside CUDA graph capture, and every weight is used once per forward anyway
        self.autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=bool(cfg.autocast), cache_enabled=False
        )
        self.regions = Regions(device, sync=cfg.profile.sync_regions)
        self.graph = GraphedStep(self) if tcfg.cuda_graphs else None

    @property
    def shard(self) -> Replicated | None:
        """How the processes share the model (train/distributed/sharding/); None on one process."""
        return self.sharing if self.world_size > 1 else None

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
            self.strategy.backward(loss_backward)  # a user's loss failing in its backward: one line naming it
        return loss

    def optimizer_step(self, loss: Tensor) -> None:
        """Clip (the norm now; under the one pass the clip itself inside the optimizer's pass), update, and send
        the updated weights where a way of sharing sends them."""
        with self.regions(OPTIMIZER):
            self.sharing.wait_gradients()
            scale = self.sharing.clip(self.tcfg.grad_clip, self.one_pass) if self.tcfg.grad_clip > 0 else None
            skip = ~torch.isfinite(loss) if self.tcfg.nonfinite == "skip" else None
            local = self.sharing.local(self.optimizer)
            if self.one_pass:
                self.optimizer.step(scale=scale, skip=skip)
            elif skip is not None and local.defaults.get("fused"):
                local.found_inf = skip.float()  # the fused kernel skips the update on the device
                self.optimizer.step()
            elif skip is None or not skip.item():  # the CPU has no device to wait for
                self.optimizer.step()
            self.sharing.gather_weights()

    def wait_weights(self) -> None:
        """Before reading the parameters outside a forward (a checkpoint): wait for the last step's update."""
        self.sharing.wait_weights()

    @torch.no_grad()
    def forward_only(self, batch) -> Tensor:
        """The article's protocol: copy, forward and loss, no gradient and no optimizer."""
        with self.regions(COPY):
            images, targets = to_device(batch, self.device)
        with self.regions(FORWARD), self.autocast:
            pred = self.net(images)  # [B, M, 4] xyxy
        with self.regions(LOSS):
            return self.strategy(pred, targets)


def time_steps(step: TrainStep, run, batches, count: int, device: torch.device) -> list[float]:
    """The ms of ``count`` calls of ``run`` (``step`` or its forward_only) on ``batches``, with neither profiler nor
    regions, as training runs them: `make profile`'s timed steps and train.strategy=auto's. On a GPU the host
    runs ahead, so a step's host time says little: each step is the time between CUDA events recorded as
    it starts and as the next one starts, i.e. what the device spent on it, idle gaps the host left
    included (training's throughput). On the CPU, the host's wall time."""
    step.regions.active = False
    cuda = device.type == "cuda"
    marks = []
    for _ in range(count + 1):
        if cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())
        if len(marks) <= count:
            run(next(batches))
    if cuda:
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in pairwise(marks)]
    return [(b - a) * 1e3 for a, b in pairwise(marks)]
