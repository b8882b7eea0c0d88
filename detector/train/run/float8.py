"""``train.float8``: the head's big Linear in float8, through torchao's float8 training.

``to_float8`` swaps each block of the model's BlockedLinear layers for torchao's ``Float8Linear``
(``convert_to_float8_training``), which keeps the block's weight and bias Parameters: the state dict's keys, the
blocks' one-tensor layout (``BlockedLinear.rows``) and the checkpoints are unchanged. Each of a block's three
products (output, input gradient, weight gradient) casts its operands to float8 with one scale per tensor, from
the tensor's absolute maximum at that call (dynamic tensorwise scaling, torchao's default recipe: e4m3 for the
input and the weight, e5m2 for the output's gradient) and runs on the float8 tensor cores (``torch._scaled_mm``),
at twice the bf16 rate on an H100.

Which layers: the BlockedLinear's blocks only (65536 -> 16384 at seed scale). The last Linear (16384 -> 1024) stays
bf16: its products are 1/64 of the head's, and it writes the box coordinates themselves, where float8's 3 mantissa
bits would cost the most precision for the least time.

Compiled blocks: eager, each float8 cast is kernels of its own over the fp32 weight (its absolute maximum, then the
scaled cast, in the forward and again in the backward: four reads of the 4.3 GB weight at seed scale, besides the
transposed copies ``_scaled_mm`` needs), which eats the faster product's gain. So under ``train.compile`` each
block's forward is compiled on its own (``Module.compile``; BlockedLinear.forward itself stays out of the model's
graph): Inductor fuses the casts, and each block is still its own autograd node, so its gradient is ready, and its
all-reduce can start, before the next block's backward runs. ``make bench-step`` times the step with and without.
"""

from __future__ import annotations

import importlib.util

import torch
from omegaconf import DictConfig

from detector.model import BlockedLinear

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm89), Hopper (sm90) and later
ALIGNMENT = 16  # torch._scaled_mm: every dimension of the three products a multiple of 16


def float8_refusal(
    cfg: DictConfig,
    layers: list[BlockedLinear],
    world_size: int,
    device: torch.device,
    capability: tuple[int, int] | None,
    installed: bool,
) -> str | None:
    """Why train.float8 cannot run here, or None: ``capability`` is the GPU's (None without one), ``installed``
    whether torchao can be imported. Pure, so that every reason is testable on the CPU."""
    if device.type != "cuda":
        return f"it needs a CUDA device (float8 tensor cores), this run is on {device}"
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        found = "none" if capability is None else "sm{}{}".format(*capability)
        return f"it needs a GPU with float8 tensor cores (sm89 or later: Ada, Hopper), this one is {found}"
    if not installed:
        return "it needs torchao, which is not installed: pip install torchao (offline: pip install --no-deps <wheel>)"
    if not cfg.autocast:
        return "it computes the head's products from the bf16 activations of autocast: set autocast=true"
    if world_size > 1 and cfg.train.shard_optimizer == "fsdp2":
        # FSDP2 would need torchao's float8 all-gather and its scales precomputed after each optimizer step
        return "it is not wired for train.shard_optimizer=fsdp2: use train.shard_optimizer=blocks or off"
    sizes = [("data.batch_size", cfg.data.batch_size)]  # the inner dimension of the weight gradient's product
    for layer in layers:
        sizes.append(("the head's inputs", layer.in_features))
        rows = sorted({len(block.bias) for block in layer.blocks})
        sizes += [("rows in a head block (model.hidden / model.head_blocks)", n) for n in rows]
    odd = [f"{what} {size}" for what, size in sizes if size % ALIGNMENT]
    if odd:
        return f"its products need sizes that are multiples of {ALIGNMENT}: {', '.join(dict.fromkeys(odd))}"
    return None


def float8_unavailable(cfg: DictConfig, layers: list[BlockedLinear], world_size: int, device: torch.device):
    """``float8_refusal`` on this machine: its GPU's capability and whether torchao is installed."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    installed = importlib.util.find_spec("torchao") is not None
    return float8_refusal(cfg, layers, world_size, device, capability, installed)


def to_float8(layers: list[BlockedLinear], compile: bool) -> None:
    """Each layer's blocks as torchao's Float8Linear (same Parameters), compiled one by one with ``compile``."""
    # imported here: torchao is optional (pip install torchao), and importing it loads its kernels
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig()  # dynamic tensorwise scaling, torchao's default recipe
    for layer in layers:
        convert_to_float8_training(layer.blocks, config=config)
        if compile:
            for block in layer.blocks:
                block.compile()
        layer.float8 = True
