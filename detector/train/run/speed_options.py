"""The step's speed options (docs/training.md, "Speed options"): what each cannot run, and the model with them.

They change how fast a step goes, never its losses, so a checkpoint resumes under other values of them
(``RUN_CONTROL`` in train/checkpoints/state.py). ``train.compile`` and ``train.cuda_graphs`` wrap the step itself
(train/run/step.py, train/run/graphed.py); the others are settings of the model, applied here.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from detector.errors import UserError
from detector.model import BlockedLinear, build_model, fused_blocks_unavailable
from detector.model.bias_pool_kernel import bias_pool_unavailable
from detector.train.run.float8 import float8_unavailable, to_float8

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


# ----------------------------------------------------------------------------- the compiled step's cache

CACHE_FOLDER = "compile-cache"  # under train.out_dir: one file per configuration, machine kind and torch
# what the first step waits for where it compiles: about a minute with cold caches, seconds with warm ones
COMPILING = "torch.compile of the model, the optimizer's pass and Triton's kernels"
STEP_KEYS = ("compile", "cuda_graphs", "channels_last", "fused_blocks", "fused_pool", "float8", "optimizer")


def step_settings(cfg: DictConfig, device: torch.device, world_size: int) -> dict:
    """What the training step of ``cfg`` is built from, the loss and the batch aside: this GPU (or the device's
    type), torch, the processes, autocast, the model and train's speed options. The compile cache's key and
    train.strategy=auto's kept choice (train/choice.py) each add what else theirs depends on."""
    return {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "world_size": world_size,
        "autocast": cfg.autocast,
        "model": OmegaConf.to_container(cfg.model),
        "train": [cfg.train[k] for k in STEP_KEYS] + [cfg.train.grad_clip > 0, cfg.train.shard_optimizer],
    }


def digest(key: dict) -> str:
    """A file name's 16 hex digits for ``key`` (its JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def compile_cache_file(cfg: DictConfig, device: torch.device, world_size: int, mode: str = "train") -> Path | None:
    """The file of the compiled step's artifacts (torch's portable cache: inductor's graphs, autotuning, Triton's
    kernels) for this configuration, this GPU and this torch, under train.out_dir: a fresh machine that has it (the
    runs folder copied) and a second run or rank skip most of the first step's compilation. `make train` and `make
    profile` of one configuration share it; ``mode="forward"`` (`make profile MODE=forward`, which compiles the
    model's forward alone, without gradients) has its own, so that neither run's save replaces the other's graphs.
    None where nothing compiles."""
    if not (cfg.train.compile or device.type == "cuda"):
        return None
    key = step_settings(cfg, device, world_size)
    key["train"] = [cfg.train.strategy, *key["train"]]  # the compiled loss (the compiled strategies') is the step's
    key["data"] = [cfg.data.batch_size, cfg.data.image_size, cfg.data.max_boxes]
    name = cfg.train.strategy
    if mode != "train":  # training's key stays what it was: the files already written keep being found
        key["mode"], name = mode, f"{name}-{mode}"
    return Path(cfg.train.out_dir) / CACHE_FOLDER / f"{name}-{digest(key)}.bin"


def load_compile_cache(path: Path | None) -> str | None:
    """Load ``path``'s artifacts into torch's caches before the first step; what it loaded, in a few words."""
    if path is None or not path.is_file():
        return None
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as err:  # a file of another torch, or damaged: the step compiles as without it
        return f"not used ({type(err).__name__}: {str(err)[:120]})"
    return f"{path.stat().st_size / 2**20:.0f} MiB loaded" + (f" ({cache_counts(info)})" if info else "")


def save_compile_cache(path: Path | None) -> bool:
    """After the first step: what it compiled, written beside the earlier ones' (atomically, in a thread); whether
    there was any to write."""
    if path is None:
        return False
    found = torch.compiler.save_cache_artifacts()
    if found is None:
        return False

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            partial.write_bytes(found[0])
            partial.replace(path)
        except OSError:
            partial.unlink(missing_ok=True)  # no cache for the next run: it compiles, as this one did

    threading.Thread(target=write, name="compile-cache", daemon=True).start()
    return True


def cache_counts(info) -> str:
    counts = {name: len(getattr(info, name, ()) or ()) for name in ("inductor_artifacts", "autotune_artifacts")}
    return ", ".join(f"{n} {name.split('_')[0]}" for name, n in counts.items() if n)
