"""The step's speed options (docs/training.md, "Speed options"): what each cannot run, and the model with them.

They change how fast a step goes, never its losses, so a checkpoint resumes under other values of them
(``RUN_CONTROL`` in train/checkpoint.py). ``train.compile`` and ``train.cuda_graphs`` wrap the step itself
(train/step.py, train/graphed.py); the others are settings of the model, applied here.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector.errors import UserError
from detector.model import BlockedLinear, build_model, fused_blocks_unavailable
from detector.model.bias_pool_kernel import bias_pool_unavailable
from detector.train.float8 import float8_unavailable, to_float8

# Why a CUDA graph cannot replay a strategy of this target layout (the step must have static shapes).
GRAPH_REFUSALS = {
    "list": "its targets are a list of [n_i, 4] tensors whose shapes change with every batch, and the loss "
    "reads those sizes on the host (dynamic shapes and host synchronisations), while a graph replays "
    "fixed shapes with no host in the loop",
    "packed": "its [N, 4] boxes change shape with the number of faces N in every batch, "
    "while a graph replays fixed shapes",
}


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


def build_trained_model(cfg: DictConfig, device: torch.device, world_size: int) -> torch.nn.Module:
    """The detector of ``cfg`` on ``device`` with train's model options (channels_last, the fused blocks and pool,
    float8, cuDNN's benchmark); each refuses, in one line, where it cannot run. The caller seeds the RNG."""
    tcfg = cfg.train
    with device:  # initialise on the device: a 1.1 B-parameter model initialises in a blink there
        model = build_model(cfg.model, cfg.data, world_size)
    if tcfg.channels_last:
        model.to(memory_format=torch.channels_last)
        model.channels_last = True
    if tcfg.fused_blocks:
        reason = fused_blocks_unavailable(tcfg.fused_blocks, cfg.model.channels, device)
        if reason:
            raise UserError(
                f"train.fused_blocks={tcfg.fused_blocks} cannot run here: {reason}; set train.fused_blocks=0"
            )
        model.fused_blocks = tcfg.fused_blocks
    if tcfg.fused_pool:
        reason = bias_pool_unavailable(device)
        if reason:
            raise UserError(f"train.fused_pool=true cannot run here: {reason}; set train.fused_pool=false")
        model.fused_pool = True
    if tcfg.float8:  # before DDP or sharding wrap the model: the blocks keep their Parameters
        heads = [m for m in model.modules() if isinstance(m, BlockedLinear)]
        reason = float8_unavailable(cfg, heads, world_size, device)
        if reason:
            raise UserError(f"train.float8=true cannot run here: {reason}; set train.float8=false")
        to_float8(heads, compile=bool(tcfg.compile))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = bool(tcfg.cudnn_benchmark)
    return model


def compile_caches() -> str:
    """Where torch keeps what the first step compiles (inductor's and AOTAutograd's graphs, Triton's kernels), which a
    second run of the same configuration on this machine reuses: ``TORCHINDUCTOR_CACHE_DIR`` or its default."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
