"""``bench step`` (``make bench-step``): the training step against the floor of the machine it runs on.

1. The floor, measured in the same run: a bf16 matrix product's rate (8192^3) and a device-to-device
   copy's rate. The step's floor is its two Linear layers' matrix products (forward + backward, 6 B
   in out FLOPs each) at that rate, plus the bytes one optimizer pass must move per parameter
   (OPTIMIZER_BYTES) and the convolution stack's activations (ACTIVATION_PASSES passes over every conv
   and pool output, bf16) at the copy rate. An estimate of what no implementation can beat.
2. The step of the config, and of the speed-option variants in ``VARIANTS`` (each a set of overrides of
   train.*): median [quartiles] of the whole step (CUDA events over a fixed device batch, no data
   loading), its ratio to the floor, and for the config's own step its pieces: forward, forward +
   loss + backward, and clip + optimizer. A variant this machine cannot run (``+float8`` without torchao or
   float8 tensor cores, say) is a row saying why.
3. The data pipeline: images/s of the configured batch loader (and of one process's sampler), against the
   images/s the step consumes (``images_per_second``).

On the CPU it runs the config's step and the data pipeline only (the floors are a GPU's).
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig, OmegaConf

from detector import bench
from detector.config.device import resolve_device
from detector.data import build_loader, build_sampler, to_device
from detector.errors import UserError
from detector.lab.measure.timing import event_ms
from detector.lab.present.tables import markdown_table, significant, spread_cell
from detector.lab.record.provenance import run_header
from detector.model import build_model
from detector.train.observe.memory_estimate import check_command_memory
from detector.train.run.step import TrainStep

# The bytes one optimizer pass must move per parameter (train/optimizer.py): the clip's norm reads the fp32
# gradient (4 B) before anything can be updated; then one pass reads param, grad, m and v (16 B) and writes
# param, m and v (12 B) and the bf16 weight the next forward reads (2 B). torch's pieces (train.optimizer=torch)
# move 46 B: the clip also rescales the gradient in place (8 B) and autocast casts each weight at the forward
# (6 B in place of 2).
OPTIMIZER_BYTES = 4 + 16 + 12 + 2
ACTIVATION_PASSES = 6  # forward: write + read; backward: read the saved input, write and read the gradient
# The speed options one at a time (train.* overrides): each row adds one to "+compile" or the row above;
# CUDA graphs and the fused blocks each come on top of compile, since graphs cannot capture the fused
# kernels yet (train.step.speed_option_refusal); the fused pool comes on top of the fused blocks (the
# defaults). A row equal to the configured step reuses its timing.
_OFF = {"optimizer": "torch", "cudnn_benchmark": "false", "channels_last": "false", "compile": "false"}
_OFF |= {"fused_blocks": "0", "fused_pool": "false", "cuda_graphs": "false"}
_OFF |= {"float8": "false"}  # the ladder is bf16's: "+float8" below is the configured step with a float8 head
_LADDER = [
    ("eager", {}),
    ("+cudnn_benchmark", {"cudnn_benchmark": "true"}),
    ("+channels_last", {"channels_last": "true"}),
    ("+compile", {"compile": "true"}),
    ("+one_pass", {"optimizer": "one_pass"}),
    ("+cuda_graphs", {"cuda_graphs": "true"}),
    ("+fused_blocks", {"cuda_graphs": "false", "fused_blocks": "2"}),
    ("+fused_pool", {"fused_pool": "true"}),
]


def _ladder() -> dict[str, list[str]]:
    options, rows = dict(_OFF), {}
    for name, changes in _LADDER:
        options |= changes
        rows[name] = [f"train.{key}={value}" for key, value in options.items()]
    return rows


VARIANTS = _ladder()
# Not a rung: the configured step (the defaults: every speed option that pays) with the head in float8
# (train.float8, detector/train/run/float8.py), against the config's row and the bf16 floor in the same run
VARIANTS["+float8"] = ["train.float8=true"]


def floors(cfg: DictConfig, model) -> dict:
    """The machine's matmul and copy rates and the step's floor from them (see the module docstring)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul = event_ms(lambda: a @ a, warmup=3, repeats=10)
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = event_ms(lambda: dst.copy_(src), warmup=3, repeats=10)
    tflops = 2 * 8192**3 / matmul.median / 1e9
    copy_gbs = 2 * src.numel() / copy.median / 1e6
    batch = cfg.data.batch_size
    linear_flops = sum(
        6 * batch * m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    parameters = sum(p.numel() for p in model.parameters())
    side, activation_bytes = cfg.data.image_size, 0
    for channels in cfg.model.channels:  # conv output at full size, then the pooled one, in bf16
        activation_bytes += batch * channels * (side * side + side * side // 4) * 2
        side //= 2
    pieces = {
        "matmul": linear_flops / tflops / 1e9,
        "optimizer": parameters * OPTIMIZER_BYTES / copy_gbs / 1e6,
        "activations": activation_bytes * ACTIVATION_PASSES / copy_gbs / 1e6,
    }
    return {"matmul_tflops": tflops, "copy_gbps": copy_gbs, "floor_ms": sum(pieces.values()), "floor_pieces_ms": pieces}


def device_batch(cfg: DictConfig, layout: str, device: torch.device):
    return to_device(next(iter(build_loader(OmegaConf.merge(cfg.data, {"num_workers": 0}), layout, device))), device)


def step_stats(cfg: DictConfig, device: torch.device, batch, pieces: bool) -> dict:
    """The whole step's time (and, with ``pieces``, forward / forward+backward / optimizer) on ``batch``."""
    step = TrainStep(cfg, device)
    timed = {"warmup": 5, "repeats": cfg.bench.repeats, "max_seconds": cfg.bench.max_seconds}
    out = {"step": event_ms(lambda: step(batch), device, **timed)}
    if pieces and step.graph is None:
        images, targets = batch

        def forward():
            with step.autocast:
                step.net(images)

        def forward_backward():
            step.forward_backward(images, targets)

        out["forward"] = event_ms(forward, device, **timed)
        out["forward+backward"] = event_ms(forward_backward, device, **timed)
        out["optimizer"] = event_ms(lambda: step.optimizer_step(torch.zeros((), device=device)), device, **timed)
    return out


def run_bench(cfg: DictConfig) -> dict:
    device = resolve_device(cfg)
    check_command_memory(cfg, device, "bench", batches=1)
    print(f"bench step: {run_header(device)}, batch {cfg.data.batch_size} x {cfg.data.image_size}px")
    batch = device_batch(cfg, "padded", device)
    unknown = set(cfg.bench.variants) - set(VARIANTS)
    if unknown:
        raise UserError(f"bench.variants: unknown {sorted(unknown)}; expected some of {list(VARIANTS)}")
    ladder = {name: VARIANTS[name] for name in cfg.bench.variants or VARIANTS}
    variants = {"config": []} | (ladder if device.type == "cuda" else {})
    steps, unavailable = {}, {}
    for name, overrides in variants.items():
        variant = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        if name != "config" and variant.train == cfg.train:
            steps[name] = {"step": steps["config"]["step"]}  # the configured step: timed once
            continue
        print(f"  timing {name} ...", flush=True)
        try:
            steps[name] = step_stats(variant, device, batch, name == "config")
        except UserError as err:  # an option this machine cannot run (train.float8 without torchao, say)
            if name == "config":
                raise
            unavailable[name] = str(err)
            print(f"  {name}: {err}", flush=True)
    with torch.device("meta"):  # the shapes only: its layers' sizes give the floor
        model = build_model(cfg.model, cfg.data)
    floor = floors(cfg, model) if device.type == "cuda" else None
    rates = images_per_second(cfg.data, seconds=cfg.bench.max_seconds, device=device.type)
    results = {
        "steps": steps,
        "unavailable": unavailable,  # variant -> why it cannot run here
        "floor": floor,
        "data_images_per_s": rates["loader"],
        "sampler_images_per_s": rates["sampler"],
    }
    bench.save(cfg, "step", device, results, tables(results, cfg.data.batch_size, run_header(device)))
    return results


def tables(results: dict, batch: int, header: str) -> str:
    floor = results["floor"]
    rows = []
    for name, stats in results["steps"].items():
        for piece, s in stats.items():
            ratio = f"{s.median / floor['floor_ms']:.2f}x" if floor and piece == "step" else "—"
            rows.append(
                [name, piece, spread_cell(s), ratio, significant(batch / s.median * 1e3) if piece == "step" else "—"]
            )
    rows += [[name, "step", f"unavailable here: {why}", "—", "—"] for name, why in results["unavailable"].items()]
    lines = [header, "", markdown_table(["variant", "piece", "ms", "vs floor", "images/s"], rows, align="llrrr")]
    if floor:
        pieces = ", ".join(f"{k} {significant(v)} ms" for k, v in floor["floor_pieces_ms"].items())
        lines += [
            "",
            f"floor {significant(floor['floor_ms'])} ms ({pieces}) at {significant(floor['matmul_tflops'])} TFLOP/s "
            f"bf16 and {significant(floor['copy_gbps'])} GB/s copy, measured in this run",
        ]
    consumed = batch / results["steps"]["config"]["step"].median * 1e3
    lines += [
        "",
        f"data pipeline: {significant(results['data_images_per_s'])} images/s drawn, "
        f"{significant(consumed)} consumed by the step",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the data pipeline alone


WARMUP_SECONDS = 1.0  # the loader's start (fork the workers, page-lock the ring) and the ring's first fill


def images_per_second(cfg, seconds: float = 5.0, layout: str = "padded", device: str = "cpu") -> dict[str, float]:
    """Images/s of the data pipeline of ``cfg`` (a DataConfig), each rate timed for ~``seconds``.

    ``sampler``: samples drawn one after another in this process. ``loader``: images of the batches of
    ``build_loader(cfg, layout, device)`` (resolve_workers(cfg.num_workers) workers; on a CUDA device
    copied there, so the host-to-device copy counts), counted after WARMUP_SECONDS so that worker
    start-up and the batches drawn meanwhile into the ring's free slots are left out.
    """
    sampler = build_sampler(cfg)
    sampler(0)  # builds this process's noise bank
    drawn, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sampler(drawn)
        drawn += 1
    rates = {"sampler": drawn / (time.perf_counter() - start)}
    batches = iter(build_loader(cfg, layout, torch.device(device)))
    start = time.perf_counter()
    for _ in batches:
        if time.perf_counter() - start >= WARMUP_SECONDS:
            break
    loaded, start = 0, time.perf_counter()
    for _ in batches:
        loaded += cfg.batch_size
        if time.perf_counter() - start >= seconds:
            break
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # the last batch's copy
    rates["loader"] = loaded / (time.perf_counter() - start)
    return rates
