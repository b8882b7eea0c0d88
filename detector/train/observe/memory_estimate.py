"""What a command will allocate, estimated before any of it is: `make train`, `make profile` and `bench step`
each call ``check_command_memory`` first, which refuses in one line with the figures what cannot fit.

The estimate is a floor, by parts:
- the loader's ring of batch slots (detector/data/loader.py), in host memory that its workers share;
- the model: fp32 weights, and for a training step their gradients and AdamW's two moments (shared out
  under a sharded optimizer: at least 1/N each);
- the activations of a batch that the forward keeps for the backward;
- the held-out images (train) or the fixed batch the step reads (bench step).
On a GPU all but the ring live on the device, checked against its free memory; the rest is checked against
the host's available memory. Each check keeps a margin, since the estimate leaves out the backward's
temporaries, the allocators' slack and the libraries (``loader.HOST_SHARE``, ``DEVICE_SHARE``).

A command that reads more batches than ``data.length`` holds is refused too (``check_data_length``).
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from detector.data import resolve_workers
from detector.data.host_memory import GIB, MemoryRefusal, check_memory
from detector.data.loader import default_slots
from detector.errors import UserError
from detector.model import build_model

RING = "the loader's ring of batch slots"
MODEL = "the model with its gradients and optimizer state"
WEIGHTS = "the model's weights"
ACTIVATIONS = "the activations of a batch"
HELD_OUT = "the held-out images"
BATCH = "the batch the step reads"
# a GPU holds this process's tensors only, but cuDNN's workspaces, the CUDA context and the caching allocator's
# fragmentation are not counted: a run may take this share of the device's free memory
DEVICE_SHARE = 0.9
SUBJECTS = {"train": "this run", "profile": "this profile", "bench": "bench step"}


def command_memory(cfg: DictConfig, device: torch.device, command: str, world_size: int = 1) -> dict[str, int]:
    """Bytes a process of ``command`` (train, profile or bench) needs at least, by what needs them."""
    data, batch_pixels = cfg.data, cfg.data.batch_size * cfg.data.image_size**2
    with torch.device("meta"):  # the exact parameter count, without memory
        parameters = sum(p.numel() for p in build_model(cfg.model, data, world_size).parameters())
    need = {}
    if command != "bench":  # bench step times a fixed batch; its data pipeline's ring is checked as it is built
        need[RING] = default_slots(resolve_workers(data.num_workers)) * batch_pixels
    if command == "profile" and cfg.profile.mode == "forward":  # no gradients, no optimizer state
        need[WEIGHTS] = parameters * 4
    else:  # fp32 weights and gradients, and AdamW's two moments (1/N each under a sharded optimizer, at least)
        need[MODEL] = parameters * (8 + 8 // world_size)
    need[ACTIVATIONS] = data.batch_size * activations_per_image(cfg, device)
    if command == "train":
        need[HELD_OUT] = cfg.train.eval_batches * world_size * batch_pixels
    if command == "bench":
        need[BATCH] = batch_pixels
    return need


def run_memory(cfg: DictConfig, world_size: int, device: torch.device) -> dict[str, int]:
    """Bytes a process of a training run needs at least, by what needs them, before any of it is allocated."""
    return command_memory(cfg, device, "train", world_size)


def activations_per_image(cfg: DictConfig, device: torch.device) -> int:
    """Bytes of an image's activations that the forward keeps for the backward, at least: the float input, each
    conv block's output, its pooled output, the pool's int64 indices and the ReLU's output (a fused block keeps its
    pooled output only, a block under train.fused_pool its pooled output and a byte per pooled value), and the
    head's hidden layer; more is allocated on the way."""
    size = 2 if cfg.autocast else 4  # bf16 under autocast
    cuda = device.type == "cuda"
    fused, fused_pool = (cfg.train.fused_blocks, cfg.train.fused_pool) if cuda else (0, False)
    side, total = cfg.data.image_size, cfg.data.image_size**2 * 4
    for block, channels in enumerate(cfg.model.channels):
        pooled = channels * (side // 2) ** 2
        if block < fused:
            total += pooled * size
        elif fused_pool:
            total += pooled * (size + 1)
        else:
            total += channels * side**2 * size + pooled * (2 * size + 8)
        side //= 2
    return total + cfg.model.hidden * 2 * size + cfg.data.max_boxes * 4 * 4


def check_data_length(data: DictConfig, batches: int, command: str) -> None:
    """Refuse in one line a command that reads more batches than data.length holds."""
    if data.batch_size > data.length:
        raise UserError(
            f"data.batch_size={data.batch_size} is larger than data.length={data.length}: not one batch can be "
            "drawn; lower data.batch_size or raise data.length"
        )
    if batches * data.batch_size > data.length:
        raise UserError(
            f"{SUBJECTS[command]} reads {batches} batches of data.batch_size={data.batch_size} images "
            f"({batches * data.batch_size:,}), more than data.length={data.length:,}: raise data.length"
        )


def check_command_memory(
    cfg: DictConfig, device: torch.device, command: str, world_size: int = 1, batches: int | None = None
) -> None:
    """Refuse, in one line with the figures, a command (train, profile or bench) whose data cannot be drawn
    (``batches`` batches of data.length; None: train, which draws from its own range) or that cannot fit in the
    host's (and the GPU's) memory."""
    if batches is not None:
        check_data_length(cfg.data, batches, command)
    need = command_memory(cfg, device, command, world_size)
    hint = "lower data.batch_size, data.image_size" + (", train.eval_batches" if command == "train" else "")
    hint += " or the model's size (model.channels, model.hidden)"
    on_host = {RING} if device.type == "cuda" else set(need)  # on a GPU the rest lives on the device
    host = {what: size for what, size in need.items() if what in on_host}
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the processes of this host share its memory
    # every process has its ring, model and activations; the main process alone holds the held-out images
    total = sum(size * (1 if what == HELD_OUT else processes) for what, size in host.items())
    each = f" each of {processes} processes:" if processes > 1 else ""
    check_memory(f"{SUBJECTS[command]} needs at least", total, hint, f" ({each}{parts(host)})")
    on_device = {what: size for what, size in need.items() if what not in on_host}
    if on_device:
        free, _ = torch.cuda.mem_get_info(device)
        if sum(on_device.values()) > free * DEVICE_SHARE:
            raise MemoryRefusal(
                f"{SUBJECTS[command]} needs at least {sum(on_device.values()) / GIB:.1f} GiB on {device} "
                f"({parts(on_device)}), but it has {free / GIB:.1f} GiB free, of which a run may take "
                f"{DEVICE_SHARE:.0%}: {hint}"
            )


def parts(need: dict[str, int]) -> str:
    return ", ".join(f"{what} {size / GIB:.1f} GiB" for what, size in need.items())


def check_run_memory(cfg: DictConfig, world_size: int, device: torch.device) -> None:
    """A training run's check (``check_command_memory``)."""
    check_command_memory(cfg, device, "train", world_size)
