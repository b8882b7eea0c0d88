"""`make train EXPERIMENT=<name>`: train the detector with one GIoU loss strategy, or with each in turn.

``train`` reads top to bottom: options, run folder, model, optimizer and schedule, the checkpoint to
resume from, data, the step (eager, compiled, or one CUDA graph), the loop, the summary. A run writes to
``runs/train/<experiment>/<run>/`` with run = ``<strategy>[+compile][+cuda_graphs][+ddpN]``:

    config.yaml       the merged configuration
    events.out.*      TensorBoard scalars: train/, eval/, time/, memory/
    checkpoint.pt     model, optimizer, schedule, step, RNG states and data position (atomic writes)
    summary.json      final loss and metrics, median step time, images/s, the loss curve
    profile/          with train.profile=true: one torch.profiler window, regions as in `make profile`

Timing without stalling the device: each step's regions ("copy data", "forward", "calc loss",
"backward", "optimizer step") end with a device event (CUDA) or a clock reading (CPU), read only at the
next log line. "step ms" therefore excludes the wait for the data loader, reported apart as "data
wait"; images/s is the wall-clock rate, waits included. The loss share is "calc loss" (the loss's
forward) over the step; the loss's backward runs inside "backward". A CUDA-graph step has two regions
only, "copy data" and "step (CUDA graph)".

Multi-GPU: under torchrun each rank reads its own block of every global batch and the loss is the
global mean over valid boxes (detector/distributed.py); rank 0 evaluates, logs and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter

from detector.data import PaddedTargets, build_loader, to_device
from detector.losses import STRATEGIES, get_strategy
from detector.model import build_model
from detector.profiling import RegionTimer, device_name, make_profiler
from detector.train import distributed
from detector.train.distributed import DistEnv, count_valid, global_mean, rank_loader
from detector.train.metrics import evaluate

# Why a CUDA graph cannot replay a strategy of this target layout (the step must have static shapes).
GRAPH_REFUSALS = {
    "list": "its targets are a list of [n_i, 4] tensors whose shapes change with every batch, and the loss "
    "reads those sizes on the host (dynamic shapes and host synchronisations), while a graph replays "
    "fixed shapes with no host in the loop",
    "packed": "its [N, 4] boxes change shape with the number of faces N in every batch, "
    "while a graph replays fixed shapes",
}
# Settings that change how a run is watched or how fast it goes, never its losses: a checkpoint
# written under other values of these still resumes.
RUN_CONTROL = {"resume", "stop_after", "log_every", "eval_every", "eval_batches", "eval_start", "checkpoint_every"}
RUN_CONTROL |= {"out_dir", "compile", "cuda_graphs", "profile"}
TIMING_SKIP = 5  # first steps of a run left out of its median step time: compilation, autotuning, graph capture
GRAPH_WARMUP = 3  # eager steps on a side stream before capture, as in PyTorch's whole-network example


def speed_option_refusal(strategy, tcfg, env: DistEnv, device: torch.device) -> str | None:
    """Why train.cuda_graphs cannot run this strategy here, or None."""
    if not tcfg.cuda_graphs:
        return None
    if strategy.layout in GRAPH_REFUSALS:
        return f"train.cuda_graphs=true cannot capture strategy {strategy.name!r}: {GRAPH_REFUSALS[strategy.layout]}"
    if device.type != "cuda":
        return f"train.cuda_graphs=true needs a CUDA device, this run is on {device}"
    if env.world_size > 1:
        return "train.cuda_graphs=true runs on one GPU: capturing DDP's gradient all-reduce is not supported here"
    return None


def run_name(tcfg, world_size: int) -> str:
    options = [name for name in ("compile", "cuda_graphs") if tcfg[name]]
    options += [f"ddp{world_size}"] if world_size > 1 else []
    return "+".join([tcfg.strategy, *options])


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """The learning-rate multiplier of step ``step`` (0-based): linear warm-up to 1, then a cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model, tcfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW: fused on CUDA; with CUDA graphs also capturable with a device-tensor lr that the schedule
    updates in place (the graph reads its address)."""
    kwargs = {"fused": True} if device.type == "cuda" else {}
    lr = tcfg.lr
    if tcfg.cuda_graphs:
        kwargs["capturable"] = True
        lr = torch.tensor(tcfg.lr, device=device)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=tcfg.weight_decay, **kwargs)


# ----------------------------------------------------------------------------- checkpoints


def fingerprint(cfg: DictConfig, world_size: int) -> dict:
    """What determines a run's losses; a checkpoint resumes only under the same fingerprint."""
    c = OmegaConf.to_container(cfg, resolve=True)
    return {
        "data": {k: v for k, v in c["data"].items() if k != "num_workers"},
        "model": c["model"],
        "train": {k: v for k, v in c["train"].items() if k not in RUN_CONTROL},
        "autocast": c["autocast"],
        "world_size": world_size,
    }


def differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<missing>"), now.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the checkpoint, {b!r} now")
    return out


def rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(path: Path, state: dict) -> None:
    """Write to a temporary file, then rename: a run killed mid-write leaves the previous checkpoint intact."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer, scheduler, expected: dict, global_batch: int) -> int:
    """Restore a run from ``path`` and return its step; refuse a checkpoint of another configuration."""
    # Our own file, holding numpy and Python RNG states: not loadable with weights_only=True.
    state = torch.load(path, map_location="cpu", weights_only=False)
    diffs = differences(state["fingerprint"], expected)
    if diffs:
        raise ValueError(
            f"checkpoint {path} was written by another configuration, so resuming would not continue that run:\n  "
            + "\n  ".join(diffs)
            + "\nresume with the checkpoint's settings, or set train.resume=false to start this folder afresh"
        )
    step = state["step"]
    if state["data"]["next_index"] != step * global_batch:
        raise ValueError(
            f"checkpoint {path}: data position {state['data']['next_index']} != step {step} x {global_batch}"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return step


# ----------------------------------------------------------------------------- step timing and the CUDA graph


class StepRegions:
    """The named regions of a step: a profiler label each, and an end time on the device (CUDA events,
    no synchronisation) or the host clock (CPU), turned into milliseconds only by ``read``. Inside the
    profiler window the regions are make profile's RegionTimer (synchronised, so each is its own)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.timer = RegionTimer(device)
        self.profiling = False  # inside the profiler's active window
        self.quiet = False  # during CUDA graph capture: no events, no synchronisation
        self.marks: list | None = None  # this step's (region, end time); None when not timing
        self.finished: list[tuple[int, list]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks = [("start", self._now())]

    def stop(self, step: int) -> None:
        self.finished.append((step, self.marks))
        self.marks = None

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.quiet:
            yield
            return
        with self.timer(name) if self.profiling else record_function(name):
            yield
        if self.marks is not None:
            self.marks.append((name, self._now()))

    def read(self) -> list[tuple[int, dict[str, float]]]:
        """(step, {region: ms, "step": ms}) of the steps finished since the last read."""
        out = []
        for step, marks in self.finished:
            if self.cuda:
                marks[-1][1].synchronize()
            ms = (lambda a, b: a.elapsed_time(b)) if self.cuda else (lambda a, b: (b - a) * 1e3)
            times = {name: ms(marks[i][1], t) for i, (name, t) in enumerate(marks[1:])}
            times["step"] = ms(marks[0][1], marks[-1][1])
            out.append((step, times))
        self.finished = []
        return out


class GraphedStep:
    """The whole step, forward to optimizer step, as one CUDA graph over static input buffers.

    The first GRAPH_WARMUP calls run eagerly on a side stream (real steps that also warm up cuBLAS and
    any torch.compile), the next one captures and replays, and every later one copies its batch into
    the buffers and replays. Gradients live in the graph's memory, so they are never set to None.
    """

    def __init__(self, forward_backward, optimizer_step, optimizer, regions: StepRegions, strategy_name: str, device):
        self.forward_backward, self.optimizer_step, self.optimizer = forward_backward, optimizer_step, optimizer
        self.regions, self.strategy_name, self.device = regions, strategy_name, device
        self.static: tuple | None = None  # images [B, 1, S, S] uint8, PaddedTargets on the device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss = None
        self.calls = 0

    def __call__(self, batch):
        images, targets = batch
        if self.static is None:
            self.static = (
                torch.empty_like(images, device=self.device),
                PaddedTargets(
                    torch.empty_like(targets.boxes, device=self.device),
                    torch.empty_like(targets.counts, device=self.device),
                ),
            )
        s_images, s_targets = self.static
        with self.regions("copy data"):
            s_images.copy_(images, non_blocking=True)
            s_targets.boxes.copy_(targets.boxes, non_blocking=True)
            s_targets.counts.copy_(targets.counts, non_blocking=True)
        self.calls += 1
        if self.graph is None and self.calls <= GRAPH_WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.forward_backward(s_images, s_targets)
                self.optimizer_step()
                self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            self.capture()
        with self.regions("step (CUDA graph)"):
            self.graph.replay()
        return self.loss

    def capture(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        self.regions.quiet = True
        try:
            # thread_local: the DataLoader's pin-memory thread keeps calling CUDA while we capture
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.loss = self.forward_backward(*self.static)
                self.optimizer_step()
        except RuntimeError as err:
            raise RuntimeError(
                f"train.cuda_graphs=true: the step with strategy {self.strategy_name!r} could not be captured "
                f"in a CUDA graph (it synchronises with the host or changes shapes): {err}"
            ) from err
        finally:
            self.regions.quiet = False


def compile_loss(strategy, say):
    """torch.compile of the loss for static-shape layouts; the list layout's per-image loop stays eager."""
    if strategy.layout == "list":
        say(
            f"train.compile: the loss of {strategy.name!r} stays eager "
            "(its per-image shapes would recompile every batch)"
        )
        return strategy
    return torch.compile(strategy.fn, dynamic=strategy.layout == "packed")  # packed: N changes every batch


def format_eta(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


# ----------------------------------------------------------------------------- one training run


def train(cfg: DictConfig, experiment: str, env: DistEnv, device: torch.device) -> dict:
    """One training run of ``cfg.train.strategy``; returns its summary (also written to summary.json)."""
    tcfg = cfg.train
    say = print if env.is_main else (lambda *args, **kwargs: None)
    strategy = get_strategy(tcfg.strategy)
    reason = strategy.unavailable(device) or speed_option_refusal(strategy, tcfg, env, device)
    if reason:
        raise ValueError(f"strategy {strategy.name!r} cannot train here: {reason}")
    batch, world = cfg.data.batch_size, env.world_size
    global_batch = batch * world
    if tcfg.steps * global_batch > tcfg.eval_start:
        raise ValueError(
            f"{tcfg.steps} steps x {global_batch} images reach past train.eval_start={tcfg.eval_start}: "
            "training would see held-out images"
        )
    run_dir = Path(tcfg.out_dir) / experiment / run_name(tcfg, world)
    checkpoint_path = run_dir / "checkpoint.pt"
    expected = fingerprint(cfg, world)

    # model, optimizer, schedule: the same seed gives every strategy the same initial model
    torch.manual_seed(tcfg.seed)
    with device:  # initialise on the device: a 1.1 B-parameter model initialises in a blink there
        model = build_model(cfg.model, cfg.data)
    optimizer = build_optimizer(model, tcfg, device)
    scheduler = LambdaLR(
        optimizer, lambda s: lr_factor(s, tcfg.steps, tcfg.warmup_steps, tcfg.lr_min_ratio)
    )  # stepped once per optimizer step

    step = 0
    if tcfg.resume and checkpoint_path.exists():
        step = load_checkpoint(checkpoint_path, model, optimizer, scheduler, expected, global_batch)
        if step >= tcfg.steps:
            say(f"{run_dir} is complete ({step} steps): nothing to resume")
            return json.loads((run_dir / "summary.json").read_text())
        say(f"resuming {run_dir} at step {step}")
    elif env.is_main:
        if tcfg.resume:
            say(f"train.resume=true but {checkpoint_path} does not exist: starting from step 0")
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run must not mix its scalars with an older run's
        run_dir.mkdir(parents=True)
    if env.is_main:
        OmegaConf.save(cfg, run_dir / "config.yaml")
    resumed_at = step

    net = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if tcfg.compile:
        net = torch.compile(net)
    loss_fn = compile_loss(strategy, say) if tcfg.compile else strategy
    # cache_enabled=False: required inside CUDA graph capture, and every weight is used once per forward anyway
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(cfg.autocast), cache_enabled=False)

    # data: this rank's block of every global batch, from the resumed position on; the held-out range once
    loader = rank_loader(cfg.data, strategy.layout, device, env, start=step * global_batch, steps=tcfg.steps - step)
    eval_set = []
    if env.is_main:
        length = tcfg.eval_batches * batch
        eval_set = list(build_loader(cfg.data, "padded", device, start=tcfg.eval_start, length=length))

    # the step
    regions = StepRegions(device)

    def forward_backward(images, targets):
        with regions("forward"), autocast:
            pred = net(images)  # [B, M, 4] xyxy
        with regions("calc loss"):
            loss_backward, loss = global_mean(loss_fn(pred, targets), count_valid(targets, device), world)
        with regions("backward"):
            loss_backward.backward()
        return loss  # the global mean over valid boxes, detached

    def optimizer_step():
        with regions("optimizer step"):
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            optimizer.step()

    def eager_step(batch):
        with regions("copy data"):
            images, targets = to_device(batch, device)
        loss = forward_backward(images, targets)
        optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step_fn = eager_step
    if tcfg.cuda_graphs:
        step_fn = GraphedStep(forward_backward, optimizer_step, optimizer, regions, strategy.name, device)

    # the loop
    writer = SummaryWriter(str(run_dir), purge_step=step + 1 if step else None) if env.is_main else None
    profiling = tcfg.profile and env.is_main
    profiler = (
        make_profiler(cfg.profile, run_dir / "profile", device, tcfg.strategy)
        if profiling
        else contextlib.nullcontext()
    )
    window = (cfg.profile.wait + cfg.profile.warmup, cfg.profile.wait + cfg.profile.warmup + cfg.profile.active)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    parameters = sum(p.numel() for p in model.parameters())
    say(
        f"training {run_dir.name} ({strategy.description}) on {device_name(device)} x {world}: steps {step + 1}-"
        f"{tcfg.steps}, batch {batch} x {world} of {cfg.data.image_size}px, {parameters:,} parameters, "
        f"autocast {'bf16' if cfg.autocast else 'off'}"
    )
    history, evals, step_times = [], [], []
    loss_sum, loss_steps, data_wait, interval_wall = torch.zeros((), device=device), 0, 0.0, 0.0
    eval_step = checkpoint_step = -1
    run_start = time.perf_counter()
    batches = iter(loader)
    with profiler as prof:
        while step < tcfg.steps:
            index = step - resumed_at  # position of this step within this process's run
            regions.profiling = profiling and window[0] <= index < window[1]
            regions.timer.recording = regions.profiling
            started = time.perf_counter()
            next_batch = next(batches)
            data_wait += time.perf_counter() - started
            regions.start()
            loss = step_fn(next_batch)
            step += 1
            regions.stop(step)
            scheduler.step()
            loss_sum += loss
            loss_steps += 1
            if profiling:
                prof.step()

            if step % tcfg.log_every == 0 or step == tcfg.steps or step == tcfg.stop_after:
                mean_loss = (loss_sum / loss_steps).item()  # the host waits for the device here only
                timed = regions.read()
                step_times += timed
                step_ms = statistics.mean(t["step"] for _, t in timed)
                loss_ms = statistics.mean(t.get("calc loss", math.nan) for _, t in timed)  # no region in a graph
                share = "-" if math.isnan(loss_ms) else f"{loss_ms / step_ms:.1%}"
                interval_wall += time.perf_counter() - started
                images_per_s = loss_steps * global_batch / interval_wall
                eta = (time.perf_counter() - run_start) / (step - resumed_at) * (tcfg.steps - step)
                history.append((step, mean_loss))
                say(
                    f"step {step:6d}/{tcfg.steps}  loss {mean_loss:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                    f"step {step_ms:8.1f} ms (loss {share:>5})  data wait "
                    f"{data_wait / loss_steps * 1e3:6.1f} ms  {images_per_s:9.0f} img/s  eta {format_eta(eta)}",
                    flush=True,
                )
                if writer:
                    writer.add_scalar("train/loss", mean_loss, step)
                    writer.add_scalar("train/lr", float(scheduler.get_last_lr()[0]), step)
                    writer.add_scalar("time/step_ms", step_ms, step)
                    writer.add_scalar("time/images_per_s", images_per_s, step)
                    writer.add_scalar("time/data_wait_ms", data_wait / loss_steps * 1e3, step)
                    if not math.isnan(loss_ms):
                        writer.add_scalar("time/loss_share", loss_ms / step_ms, step)
                    if device.type == "cuda":
                        writer.add_scalar("memory/peak_gib", torch.cuda.max_memory_allocated(device) / 2**30, step)
                loss_sum.zero_()
                loss_steps, data_wait, interval_wall = 0, 0.0, 0.0
            else:
                interval_wall += time.perf_counter() - started

            last = step == tcfg.steps or step == tcfg.stop_after
            if env.is_main and (step % tcfg.eval_every == 0 or last):
                metrics = evaluate(model, eval_set, device, autocast)
                evals.append((step, metrics))
                eval_step = step
                say(
                    f"eval   {step:6d}  mean IoU {metrics['mean_iou']:.3f}  recall@0.5 {metrics['recall50']:.3f}  "
                    f"(mean box: {metrics['trivial_mean_iou']:.3f}, {metrics['trivial_recall50']:.3f})  "
                    f"loss {metrics['loss']:.4f}  on {metrics['boxes']} boxes",
                    flush=True,
                )
                for name, value in metrics.items():
                    if name != "boxes":
                        writer.add_scalar(f"eval/{name}", value, step)
            checkpoint_due = tcfg.checkpoint_every and (step % tcfg.checkpoint_every == 0 or step == tcfg.steps)
            if env.is_main and (checkpoint_due or step == tcfg.stop_after):
                state = {
                    "step": step,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng_state(),
                    "data": {"next_index": step * global_batch, "global_batch": global_batch},
                    "fingerprint": expected,
                    "config": OmegaConf.to_container(cfg, resolve=True),
                }
                save_checkpoint(checkpoint_path, state)
                checkpoint_step = step
            if step == tcfg.stop_after:
                say(f"stopping after step {step} (train.stop_after); continue with train.resume=true")
                break
    del batches

    # the summary
    timed = [t for s, t in step_times if s - resumed_at > TIMING_SKIP] or [t for _, t in step_times]
    median_ms = statistics.median(t["step"] for t in timed) if timed else math.nan
    loss_shares = [t["calc loss"] / t["step"] for t in timed if "calc loss" in t]
    summary = {
        "experiment": experiment,
        "run": run_dir.name,
        "strategy": strategy.name,
        "device": device_name(device),
        "world_size": world,
        "global_batch": global_batch,
        "steps": step,
        "resumed_at": resumed_at,
        "final_loss": history[-1][1] if history else math.nan,
        "eval": evals[-1][1] if evals else {},
        "step_ms": median_ms,
        "images_per_s": global_batch / median_ms * 1e3,
        "loss_share": statistics.median(loss_shares) if loss_shares else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "timed_steps": len(timed),
        "history": history,
        "evals": evals,
        "profile_regions_ms": regions.timer.averages() if profiling else None,
        "checkpoint_step": checkpoint_step,
        "eval_step": eval_step,
    }
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        writer.close()
        if profiling:
            say(
                "profiler window (ms per step): "
                + ", ".join(f"{k} {v:.2f}" for k, v in summary["profile_regions_ms"].items())
            )
            say(f"trace in {run_dir / 'profile'}/ (view: make tensorboard)")
        say(
            f"done: {run_dir}  final loss {summary['final_loss']:.4f}  median step {median_ms:.1f} ms  "
            f"{summary['images_per_s']:.0f} img/s (device time)"
        )
    return summary


# ----------------------------------------------------------------------------- experiments and sweeps


def sweep_table(summaries: list[dict], skipped: dict[str, str]) -> str:
    """A markdown table of a sweep; loss gap = largest |loss difference| from the first run's curve."""
    reference = dict(summaries[0]["history"]) if summaries else {}
    lines = [
        "| strategy | final loss | max loss gap | eval mIoU | mean-box mIoU | step ms | loss share | images/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        gap = max((abs(loss - reference[k]) for k, loss in s["history"] if k in reference), default=math.nan)
        share = f"{s['loss_share']:.2%}" if s["loss_share"] is not None else "-"
        metrics, rate = s["eval"], s["images_per_s"]
        lines.append(
            f"| {s['run']} | {s['final_loss']:.4f} | {gap:.1e} | {metrics.get('mean_iou', math.nan):.3f} | "
            f"{metrics.get('trivial_mean_iou', math.nan):.3f} | {s['step_ms']:.1f} | {share} | {rate:.0f} |"
        )
    lines += [f"| {name} | skipped: {reason} |||||||" for name, reason in skipped.items()]
    return "\n".join(lines)


def plot_losses(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in summaries:
        ax.plot([k for k, _ in s["history"]], [loss for _, loss in s["history"]], label=s["run"], linewidth=1)
    ax.set(xlabel="step", ylabel="GIoU loss", title="training loss per strategy (same seed and data)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_training(cfg: DictConfig, experiment: str | None = None) -> list[dict]:
    """`python -m detector train`: one run, or with train.strategy=all one per registered strategy that
    can run here (the others are listed with the reason); returns the runs' summaries."""
    experiment = Path(experiment).stem if experiment else "default"
    env, device = distributed.setup(cfg)
    if cfg.train.strategy != "all":
        summaries = [train(cfg, experiment, env, device)]
        distributed.teardown(env)
        return summaries
    summaries, skipped = [], {}
    for name, strategy in STRATEGIES.items():
        reason = strategy.unavailable(device) or speed_option_refusal(strategy, cfg.train, env, device)
        if reason:
            skipped[name] = reason
            continue
        summaries.append(train(OmegaConf.merge(cfg, {"train": {"strategy": name}}), experiment, env, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next run starts from the same free memory
    distributed.teardown(env)
    if env.is_main:
        table = sweep_table(summaries, skipped)
        out = Path(cfg.train.out_dir) / experiment
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.md").write_text(table + "\n")
        (out / "sweep.json").write_text(json.dumps({"runs": summaries, "skipped": skipped}, indent=2))
        if summaries:
            plot_losses(summaries, out / "loss_curves.png")
        print(f"\n{table}\n\ntable, summaries and loss_curves.png in {out}/")
    return summaries
