"""The article's face detector: 4 conv blocks, two linear layers, M boxes per image.

Output parametrisation: the last layer emits 4 raw numbers per slot, (u, v, s, t), turned into a box by

    centre = image_size * sigmoid(u, v),   size = image_size * sigmoid(s, t)
    box    = (centre - size / 2, centre + size / 2)            # xyxy pixels

so every prediction is a proper box (x2 > x1, y2 > y1) of plausible position and size from the first
step, and GIoU's gradient moves centre and size independently. (The article regressed raw xyxy
numbers, which start as degenerate, inverted boxes near 0.)
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detector.model.bias_pool_kernel import bias_pool
from detector.model.conv_pool_kernel import conv_pool, conv_pool_unavailable
from detector.model.stem_kernel import stem, stem_unavailable


class _LowPrecisionLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` in ``dtype`` (bf16 under autocast, as autocast's linear computes it), with
    the weight and bias gradients in fp32 straight from the products: ``torch.mm``'s ``out_dtype`` on CUDA.

    Autocast's linear gives a bf16 weight gradient and then casts it to the fp32 parameter's dtype: a
    kernel of its own over each 1.1 GB block at seed scale (slower still outside torch.compile), and a
    gradient rounded to bf16 on the way. Here the product's fp32 accumulator is the gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, dtype: torch.dtype) -> Tensor:
        x, weight = x.to(dtype), low_precision(weight, dtype)
        ctx.save_for_backward(x, weight)
        return torch.addmm(low_precision(bias, dtype), x, weight.t())

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = torch.mm(dy.t(), x, out_dtype=torch.float32)
        return dx, dw, dy.float().sum(0), None


def low_precision(param: Tensor, dtype: torch.dtype) -> Tensor:
    """``param.to(dtype)``: the copy the optimizer wrote in the same pass as the update (train/optimizer.py)
    while ``param`` is unchanged since (its version counter), else a fresh cast."""
    held = getattr(param, "low_precision", None)
    if held is not None and held[0].dtype == dtype and held[1] == param._version:
        return held[0]
    return param.to(dtype)


def linear(x: Tensor, layer: nn.Linear) -> Tensor:
    """``layer(x)``; under CUDA autocast through _LowPrecisionLinear (fp32 gradients from the products)."""
    if x.is_cuda and torch.is_autocast_enabled("cuda") and layer.weight.dtype == torch.float32:
        with torch.autocast("cuda", enabled=False):
            return _LowPrecisionLinear.apply(x, layer.weight, layer.bias, torch.get_autocast_dtype("cuda"))
    return layer(x)


class BlockedLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` as ``blocks`` Linear layers over slices of the outputs.

    The same function, and the same initial values: the slices of one ``nn.Linear``'s, drawing the same
    random numbers, so a seed gives the model it gave before the split. Why: DDP starts an
    all-reduce when a bucket of parameters has its gradients, and one weight's gradient is ready only when
    the whole weight gradient is. At seed scale that weight is 4.3 GB of gradient; as one parameter, its
    all-reduce began only after the head's backward, and outlasted the conv blocks' backward it could hide
    behind. As blocks, the first block's all-reduce runs while the backward computes the other blocks'.
    """

    def __init__(self, in_features: int, out_features: int, blocks: int):
        super().__init__()
        if not 1 <= blocks <= out_features:
            raise ValueError(f"model.head_blocks={blocks}: expected 1 to {out_features} (the head's hidden width)")
        whole = nn.Linear(in_features, out_features)
        # The blocks' parameters are views of `whole`'s, one after the other in memory: the weights of
        # consecutive blocks are one tensor, which ShardedBlocks (train/distributed/sharding/blocks.py) gathers in one
        # call.
        self._whole = (whole.weight.detach(), whole.bias.detach())
        self.blocks = nn.ModuleList()
        for weight, bias in zip(*(t.tensor_split(blocks) for t in self._whole), strict=True):
            block = nn.Linear(in_features, len(bias), device="meta")  # no RNG draws, no memory
            block.weight, block.bias = nn.Parameter(weight), nn.Parameter(bias)
            self.blocks.append(block)
        self.in_features, self.out_features = in_features, out_features
        # ShardedBlocks (train/distributed/sharding/blocks.py) sets these: the blocks' order of computation (this rank's
        # own first, while the others' weights are still on their way), and a call before block i's weights are read
        self.order: list[int] | None = None
        self.before_block = None
        # train/run/float8.py sets this: the blocks are then torchao's Float8Linear, each called as itself (its own
        # float8 casts and products; compiled one by one under train.compile) in place of `linear`
        self.float8 = False

    def starts(self) -> list[int]:
        """The first row of each block, then the number of rows: block i is rows starts[i] .. starts[i+1]-1."""
        return [0, *itertools.accumulate(len(block.bias) for block in self.blocks)]

    def rows(self, first: int, stop: int) -> tuple[Tensor, Tensor]:
        """The weights and biases of blocks first..stop-1 as one [rows, in] and one [rows] tensor, views of
        the blocks' own parameters; an error if a conversion (``.to(dtype)``, say) has separated them."""
        weight, bias = self._whole
        starts = self.starts()
        for start, block in zip(starts[:-1], self.blocks, strict=True):
            if (block.weight.data_ptr(), block.bias.data_ptr()) != (weight[start:].data_ptr(), bias[start:].data_ptr()):
                raise RuntimeError("BlockedLinear: the blocks' parameters no longer lie in one tensor")
        return weight[starts[first] : starts[stop]], bias[starts[first] : starts[stop]]

    # Not compiled (``compile_model``): under torch.compile the whole head's backward would be one autograd node, and
    # all the blocks' gradients would arrive together at its end. Eager, each block's gradient is ready (and its
    # all-reduce can start) before the next block's backward runs. A Linear has nothing to fuse but its
    # casts, and `linear` needs no cast of the weight gradient. (Float8 blocks have casts to fuse: train/run/float8.py
    # compiles each block on its own, which keeps one autograd node per block.)
    def forward(self, x: Tensor) -> Tensor:
        outputs = [None] * len(self.blocks)
        for i in self.order or range(len(self.blocks)):
            if self.before_block is not None:
                self.before_block(i)
            outputs[i] = self.blocks[i](x) if self.float8 else linear(x, self.blocks[i])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def compile_model(net: nn.Module) -> nn.Module:
    """``torch.compile(net)`` with ``BlockedLinear`` kept eager (``torch.compiler.disable`` on its forward, the
    class's, as a decorator would). Marked when a run first compiles, not where the class is defined: the decorator
    imports the compiler (dynamo: about 0.5 s on 2 CPU cores, seconds on a GPU machine's), which a command that never
    compiles (an eager run, export, predict, the configuration's checks) never needs."""
    if not getattr(BlockedLinear.forward, "_torchdynamo_disable", False):
        BlockedLinear.forward = torch.compiler.disable(BlockedLinear.forward)
    return torch.compile(net)


class FaceDetector(nn.Module):
    def __init__(self, image_size: int, max_boxes: int, channels: list[int], hidden: int, head_blocks: int = 1):
        super().__init__()
        if image_size % 2 ** len(channels):
            raise ValueError(f"image_size {image_size} must be divisible by 2**{len(channels)} (one pool per block)")
        blocks, c_in = [], 1
        for c_out in channels:
            blocks += [nn.Conv2d(c_in, c_out, 3, padding="same"), nn.MaxPool2d(2), nn.ReLU()]
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        side = image_size // 2 ** len(channels)
        self.head = nn.Sequential(
            nn.Flatten(),
            BlockedLinear(c_in * side * side, hidden, head_blocks),  # 256 * 16 * 16 = 65536 -> 16384 at seed scale
            nn.ReLU(),
            nn.Linear(hidden, max_boxes * 4),
        )
        self.image_size, self.max_boxes = image_size, max_boxes
        self.channels_last = False  # NHWC activations (train.channels_last)
        self.fused_blocks = 0  # the first blocks as Triton kernels (train.fused_blocks), same parameters
        self.fused_pool = False  # the other blocks' bias, pool and ReLU as Triton kernels (train.fused_pool)

    def forward(self, images: Tensor) -> Tensor:
        if self.fused_blocks:  # normalise + block 1 in one kernel (stem_kernel.py); block 2 in conv_pool_kernel.py's
            first = self.features[0]
            x = stem(images, first.weight, first.bias, self.channels_last)
            if self.fused_blocks > 1:
                second = self.features[3]
                x = conv_pool(x, second.weight, second.bias)
        else:
            x = images.float() / 127.5 - 1  # [B, 1, S, S] uint8 -> [-1, 1]
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
        rest = self.features[3 * self.fused_blocks :]
        if self.fused_pool:  # cuDNN's bias-less convolution, then bias + pool + ReLU in one kernel (bias_pool_kernel)
            for conv in rest[::3]:
                x = bias_pool(F.conv2d(x, conv.weight, None, padding=1), conv.bias)
        else:
            x = rest(x)
        # contiguous: NCHW order for the head's flatten, inside the compiled graph (fused into its last kernel)
        raw = self.head(x.contiguous()).view(-1, self.max_boxes, 4)  # [B, M, 4]
        centre, size = (self.image_size * torch.sigmoid(raw)).split(2, dim=-1)  # [B, M, 2] each
        return torch.cat([centre - size / 2, centre + size / 2], dim=-1)  # [B, M, 4] xyxy


def fused_blocks_unavailable(blocks: int, channels: list[int], device: torch.device) -> str | None:
    """Why the first ``blocks`` conv blocks cannot run as Triton kernels here, or None."""
    if blocks > len(channels):
        return f"the model has {len(channels)} blocks"
    reason = stem_unavailable(device, channels[0])
    if reason is None and blocks > 1:
        reason = conv_pool_unavailable(device, channels[0], channels[1])
    return reason


def build_model(cfg, data_cfg, world_size: int = 1) -> FaceDetector:
    # model.head_blocks=0 (auto): one block per process, the share that train.shard_optimizer gives each
    # (under train.shard_optimizer=off too, fewer and larger blocks beat more of them: `make train
    # EXPERIMENT=seed_scale NPROC=2 ARGS="model.head_blocks=N"` measures it)
    blocks = cfg.head_blocks or min(world_size, cfg.hidden)
    return FaceDetector(data_cfg.image_size, data_cfg.max_boxes, list(cfg.channels), cfg.hidden, blocks)
