"""``bench blocks``: the fused conv blocks' Triton kernels (detector/model/) under each launch configuration.

For each kernel of ``stem_kernel.CONFIGS`` and ``conv_pool_kernel.CONFIGS`` (the first block's forward and
backward; the second's forward, weight gradient and input gradient), at the config's batch and image size
and the model's first two channel counts, and of ``bias_pool_kernel.CONFIGS`` (train.fused_pool's forward
and backward, one call over every block after train.fused_blocks, as the step runs them): the device time
of the op that launches it, for every (BLOCK, num_warps) in ``BLOCKS`` x ``WARPS``, the others kept at
their configured values; then, for a kernel whose programs loop over the pixel blocks (its module's
``PROGRAMS``), each program count of ``PROGRAM_COUNTS`` at its fastest configuration. The table marks the
configuration in use and the fastest; the kernels' arithmetic does not depend on them (the weight gradients'
partial sums are added in another grouping), so faster ones can replace the defaults in CONFIGS and
PROGRAMS. Then the configured training step with the configurations in use and with the fastest, side by
side. CUDA only.
"""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig

from detector import bench
from detector.bench.step import device_batch, step_stats
from detector.lab.measure.timing import budget, event_ms
from detector.lab.present.tables import markdown_table, spread_cell
from detector.lab.record.provenance import run_header
from detector.model import bias_pool_kernel, conv_pool_kernel, stem_kernel

BLOCKS = (32, 64, 128, 256)
WARPS = (2, 4, 8)
PROGRAM_COUNTS = (1024, 2048, 4096, 8192, 16384)


@contextlib.contextmanager
def configured(module, kernel: str, config, table: str = "CONFIGS"):
    """``module.<table>[kernel]`` (its CONFIGS, or its PROGRAMS) set to ``config`` for the duration."""
    settings = getattr(module, table)
    saved = settings[kernel]
    settings[kernel] = config
    try:
        yield
    finally:
        settings[kernel] = saved


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


def sweep(call, module, kernel: str, cfg: DictConfig, device: torch.device, table: str = "CONFIGS") -> dict:
    """config -> Stats of ``call()`` with ``module.<table>[kernel]`` at each value the GPU can run: the (BLOCK,
    warps) of ``BLOCKS`` x ``WARPS`` for CONFIGS, the counts of ``PROGRAM_COUNTS`` for PROGRAMS."""
    times = {}
    for config in [(b, w) for b in BLOCKS for w in WARPS] if table == "CONFIGS" else PROGRAM_COUNTS:
        with configured(module, kernel, config, table):
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
        entry = {"in_use": in_use, "fastest": best, "ms": {f"{b},{w}": t for (b, w), t in times.items()}}
        chosen, in_use_cell, best_cell, best_time = [(best, "CONFIGS")], str(in_use), str(best), times[best]
        looped, counts = getattr(module, "PROGRAMS", {}), {}
        if kernel in looped:  # its programs loop over the blocks: how many, at the fastest configuration
            with configured(module, kernel, best):
                counts = sweep(call, module, kernel, cfg, device, "PROGRAMS")
        if counts:
            count = min(counts, key=lambda n: counts[n].median)
            if times[best].median <= counts[count].median:  # the configuration sweep's time of the count in use
                count = looped[kernel]
                counts[count] = times[best]
            entry["programs"] = {
                "in_use": looped[kernel],
                "fastest": count,
                "ms": {str(n): t for n, t in counts.items()},
            }
            chosen.append((count, "PROGRAMS"))
            in_use_cell, best_cell = f"{in_use}, {looped[kernel]} programs", f"{best}, {count} programs"
            best_time = counts[count]
        fastest.append((module, kernel, chosen))
        cells = [in_use_cell, spread_cell(times.get(in_use)), best_cell, spread_cell(best_time)]
        print(f"  {name}: in use {cells[0]} {cells[1]} ms, fastest {cells[2]} {cells[3]} ms", flush=True)
        results["kernels"][name] = entry
        rows.append([name, *cells])
    headers = ["kernel (op timed)", "(BLOCK, warps) in use", "ms", "fastest", "ms"]
    text = [run_header(device), "", markdown_table(headers, rows)]
    # the configured training step, with the configurations in use and with the fastest, side by side
    batch = device_batch(cfg, "padded", device)
    steps = {"in use": step_stats(cfg, device, batch, pieces=False)["step"]}
    with contextlib.ExitStack() as stack:
        for module, kernel, chosen in fastest:
            for value, table in chosen:
                stack.enter_context(configured(module, kernel, value, table))
        steps["fastest"] = step_stats(cfg, device, batch, pieces=False)["step"]
    results["step_ms"] = steps
    text += [
        "",
        markdown_table(["configurations", "training step ms"], [[k, spread_cell(v)] for k, v in steps.items()]),
    ]
    bench.save(cfg, "blocks", device, results, "\n".join(text))
    return results
