"""``bench blocks``: the fused conv blocks' Triton kernels (detector/model/) under each launch configuration.

For each kernel of ``stem_kernel.CONFIGS`` and ``conv_pool_kernel.CONFIGS`` (the first block's forward and
backward; the second's forward, weight gradient and input gradient), at the config's batch and image size
and the model's first two channel counts, and of ``bias_pool_kernel.CONFIGS`` (train.fused_pool's forward
and backward, one call over every block after train.fused_blocks, as the step runs them): the device time
of the op that launches it, for every (BLOCK, num_warps) in ``BLOCKS`` x ``WARPS``, the others kept at
their configured values. The table marks the configuration in use and the fastest; the kernels' arithmetic
does not depend on it (the weight gradients' partial sums are added in another grouping), so a faster one
can replace the default in CONFIGS. Then the configured training step with the configurations in use and
with the fastest, side by side. CUDA only.
"""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig

from detector import bench
from detector.bench.step import device_batch, step_stats
from detector.bench.timing import budget, event_ms
from detector.model import bias_pool_kernel, conv_pool_kernel, stem_kernel
from detector.tables import markdown_table, run_header, spread_cell

BLOCKS = (32, 64, 128, 256)
WARPS = (2, 4, 8)


@contextlib.contextmanager
def configured(module, kernel: str, config: tuple[int, int]):
    """``module.CONFIGS[kernel]`` set to ``config`` for the duration."""
    saved = module.CONFIGS[kernel]
    module.CONFIGS[kernel] = config
    try:
        yield
    finally:
        module.CONFIGS[kernel] = saved


def calls(cfg: DictConfig, device: torch.device) -> dict:
    """(module, kernel) -> the op call that launches that kernel, on seed-shaped inputs."""
    batch, side = cfg.data.batch_size, cfg.data.image_size
    c1, c2 = cfg.model.channels[:2]
    gen = torch.Generator(device).manual_seed(0)
    images = torch.randint(0, 256, (batch, 1, side, side), dtype=torch.uint8, device=device, generator=gen)
    w1, b1 = torch.randn(c1, 1, 3, 3, device=device) * 0.3, torch.zeros(c1, device=device)
    stem_out = torch.ops.detector.stem_forward(images, w1, b1, True, True)  # bf16, channels_last, as trained
    g1 = torch.randn_like(stem_out)
    w2, b2 = torch.randn(c2, c1, 3, 3, device=device) * 0.3, torch.zeros(c2, device=device)
    out, winner = torch.ops.detector.conv_pool_forward(stem_out, w2, b2)
    g2 = torch.randn_like(out)
    backward = torch.ops.detector.conv_pool_backward
    return {
        (stem_kernel, "forward"): lambda: torch.ops.detector.stem_forward(images, w1, b1, True, True),
        (stem_kernel, "backward"): lambda: torch.ops.detector.stem_backward(g1, images, w1, b1, True),
        (conv_pool_kernel, "forward"): lambda: torch.ops.detector.conv_pool_forward(stem_out, w2, b2),
        (conv_pool_kernel, "wgrad"): lambda: backward(g2, stem_out, w2, winner, False),  # no input gradient
        (conv_pool_kernel, "dgrad"): lambda: backward(g2, stem_out, w2, winner, True),  # wgrad + dgrad
    } | pool_calls(cfg, device, gen)


def pool_calls(cfg: DictConfig, device: torch.device, gen: torch.Generator) -> dict:
    """(bias_pool_kernel, kernel) -> one call of its op on each block after train.fused_blocks (bf16, channels_last,
    as trained); none without such blocks or without train.fused_pool."""
    blocks = list(enumerate(cfg.model.channels))[cfg.train.fused_blocks :]
    if not cfg.train.fused_pool or not blocks:
        return {}
    inputs = []
    for block, channels in blocks:
        side = cfg.data.image_size // 2**block
        y = torch.randn(cfg.data.batch_size, channels, side, side, device=device, dtype=torch.bfloat16, generator=gen)
        y, bias = y.contiguous(memory_format=torch.channels_last), torch.randn(channels, device=device, generator=gen)
        out, winner = torch.ops.detector.bias_pool_forward(y, bias)
        inputs.append((y, bias, torch.randn_like(out), winner))
    forward, backward = torch.ops.detector.bias_pool_forward, torch.ops.detector.bias_pool_backward
    return {
        (bias_pool_kernel, "forward"): lambda: [forward(y, bias) for y, bias, _, _ in inputs],
        (bias_pool_kernel, "backward"): lambda: [backward(g, w, *y.shape[2:], True) for y, _, g, w in inputs],
    }


def sweep(call, module, kernel: str, cfg: DictConfig, device: torch.device) -> dict:
    """config -> Stats of ``call()`` with ``module.CONFIGS[kernel]`` at each config the GPU can run."""
    times = {}
    for config in [(b, w) for b in BLOCKS for w in WARPS]:
        with configured(module, kernel, config):
            try:
                times[config] = event_ms(call, device, **budget(cfg.bench))
            except Exception as err:  # noqa: BLE001  a config the GPU cannot run (registers, shared memory)
                print(f"    {kernel} {config}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
    return times


def run_bench(cfg: DictConfig) -> dict | None:
    channels = cfg.model.channels[:2]
    device = bench.gpu_device(cfg, "blocks", lambda d: conv_pool_kernel.conv_pool_unavailable(d, *channels))
    if device is None:
        return None
    print(f"bench blocks: {run_header(device)}, batch {cfg.data.batch_size} x {cfg.data.image_size}px", flush=True)
    results, rows, fastest = {"kernels": {}}, [], []
    for (module, kernel), call in calls(cfg, device).items():
        name = f"{module.__name__.rsplit('.', 1)[1]}.{kernel}"
        times = sweep(call, module, kernel, cfg, device)
        in_use = module.CONFIGS[kernel]
        best = min(times, key=lambda c: times[c].median)
        fastest.append((module, kernel, best))
        print(f"  {name}: in use {in_use} {spread_cell(times.get(in_use))} ms, fastest {best} "
              f"{spread_cell(times[best])} ms", flush=True)  # fmt: skip
        results["kernels"][name] = {
            "in_use": in_use,
            "fastest": best,
            "ms": {f"{b},{w}": t for (b, w), t in times.items()},
        }
        rows.append([name, str(in_use), spread_cell(times.get(in_use)), str(best), spread_cell(times[best])])
    headers = ["kernel (op timed)", "(BLOCK, warps) in use", "ms", "fastest", "ms"]
    text = [run_header(device), "", markdown_table(headers, rows)]
    # the configured training step, with the configurations in use and with the fastest, side by side
    batch = device_batch(cfg, "padded", device)
    steps = {"in use": step_stats(cfg, device, batch, pieces=False)["step"]}
    with contextlib.ExitStack() as stack:
        for module, kernel, best in fastest:
            stack.enter_context(configured(module, kernel, best))
        steps["fastest"] = step_stats(cfg, device, batch, pieces=False)["step"]
    results["step_ms"] = steps
    text += [
        "",
        markdown_table(["configurations", "training step ms"], [[k, spread_cell(v)] for k, v in steps.items()]),
    ]
    bench.save(cfg, "blocks", device, results, "\n".join(text))
    return results
