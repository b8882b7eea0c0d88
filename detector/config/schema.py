"""Typed configuration: every default once, here; YAML files in experiments/ hold only differences.

Merge order (later wins): these dataclass defaults (the seed-scale GPU setting of the article) <- a
preset (``preset=auto`` picks ``experiments/presets/cpu.yaml`` when no GPU is present or ``device=cpu``) <- an
experiment file ``experiments/<name>.yaml`` <- dotlist overrides from the command line
(``data.batch_size=256``).

Each field's allowed values sit next to its default (``ranged``); ``load_config`` checks them all, so a
bad value fails at load, as one ``ConfigError`` line naming the field, the value and what is allowed,
instead of mid-run. How the files and overrides are read as text, and each value checked against its field's rule,
is detector/config/reading.py's.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from detector.config.device import resolve_device
from detector.config.reading import STRATEGY, check_values, load_yaml, parse_overrides, path, path_keys, ranged
from detector.config.sharing import WAYS
from detector.data.annotations import (
    OVER_MAX_BOXES,
    SYNTHETIC,
    AnnotationError,
    describe,
    parse_source,
    read_annotations,
    slots_for,
)
from detector.errors import ConfigError

EXPERIMENTS_DIR = Path(__file__).resolve().parents[2] / "experiments"  # the project: the folder that holds detector/
SHARD_ALIASES = {"True": "blocks", "False": "off"}  # train.shard_optimizer's earlier values, true and false


class ConfigFileNotFound(ConfigError, FileNotFoundError):
    """No such experiment or preset file (still a FileNotFoundError for callers that catch that)."""


@dataclass
class DataConfig:
    # the article's 256x256 grayscale images; targets are uint8 up to 256 px, int16 up to 32768 px
    image_size: int = ranged(256, 4, 32768)
    max_boxes: int = ranged(256, 1)  # slots per image M; the article supports up to 256 faces
    batch_size: int = ranged(1024, 1)  # the article's batch
    length: int = ranged(1_000_000, 1)  # samples are drawn on demand, so a long dataset costs nothing
    seed: int = ranged(0, 0)  # sample i is a pure function of (seed, i) (numpy seeds are >= 0)
    count_std: float = ranged(3.0, 0.0)  # faces per image = floor(|N(0, count_std)|): ~1.9 on average
    tail_fraction: float = ranged(0.0, 0.0, 1.0)  # share of crowded images (tail_min..max_boxes faces); 0 = the article
    tail_min: int = ranged(32, 0)  # fewest faces in a crowded image
    # where each image's boxes come from: synthetic (count_std, tail_*), or an annotation file whose boxes are
    # scaled to image_size, coco:<instances.json> or widerface:<wider_face_*_bbx_gt.txt> (detector/data/annotations.py)
    boxes: str = path(SYNTHETIC)
    # an image of the file with more boxes than max_boxes: truncate (it keeps its max_boxes largest; the run says
    # how many boxes and images lost some), fit (max_boxes becomes the most boxes an image holds), refuse (an error)
    over_max_boxes: str = ranged("truncate", choices=OVER_MAX_BOXES)
    # -1 = a worker per free core, <= 16 (data.resolve_workers): a worker draws many times what a step consumes
    # (detector/data/loader.py; `make bench TARGET=step` measures the data pipeline's images/s)
    num_workers: int = ranged(-1, -1)
    # seconds a data worker may deliver nothing while a batch is due; then the run ends in one line naming it and
    # the batch it holds (a stopped or stuck worker would hang it for good). Generous: hundreds of times what a
    # worker takes for a seed-scale batch (`make bench TARGET=step`); raise it for batches that take a worker longer
    worker_timeout: float = ranged(60.0, 0.1)


@dataclass
class ModelConfig:
    channels: list[int] = ranged([4, 16, 64, 256], 1)  # 4 conv blocks, each pools by 2
    hidden: int = ranged(16384, 1)  # the article's Linear(65536 -> 16384): ~1.1 B parameters
    # that Linear as N Linear layers over slices of its outputs (model.BlockedLinear); 0 = auto: one per
    # process under DDP, where the first block's gradient is sent while the backward computes the other's,
    # and each process updates its own (train.shard_optimizer); 1 on one process, where blocks only cost
    # time. More blocks than processes were slower (`make train NPROC=2 ARGS="model.head_blocks=4"` measures it)
    head_blocks: int = ranged(0, 0)


@dataclass
class ProfileConfig:
    strategy: str = ranged("padded", choices=(STRATEGY,))  # a name from detector.losses.STRATEGIES
    # train: + backward and optimizer step (the training optimizer); forward: the article's protocol
    mode: str = ranged("train", choices=("train", "forward"))
    wait: int = ranged(5, 0)  # torch.profiler schedule, as in the article
    warmup: int = ranged(5, 0)
    active: int = ranged(10, 1)  # the steps recorded: at least one
    out_dir: str = path("runs/profile")  # traces go to <out_dir>/<strategy>[-forward]/
    # a device synchronize at the end of each region (the original article's protocol): each region's wall
    # time then holds its own GPU work, but the host can no longer run ahead, so the step is longer than
    # training's; the profile says by how much
    sync_regions: bool = False
    # steps timed after the profiler's window with neither profiler nor regions: the step as training runs
    # it, beside which the profiled step shows what profiling costs; 0 = none
    timed: int = ranged(10, 0)
    # every allocation and free as an event: the memory measures (detector/lab/record/measures.py) and the Traces tab's
    # memory lanes. They double a loop's trace and its writing time (docs/measures.md measures it); false: time only
    profile_memory: bool = True
    record_shapes: bool = False  # shapes bloat GPU traces of the loop strategy to hundreds of MB


@dataclass
class BenchConfig:
    strategies: list[str] = ranged([], choices=(STRATEGY,))  # empty = every registered strategy
    batch_sizes: list[int] = ranged([1024], 1)
    distributions: list[str] = field(default_factory=lambda: ["seed", "tail"])  # see detector/lab/measure/cases.py
    pred_dtype: str = ranged("bfloat16", choices=("float32", "bfloat16", "float16"))  # what autocast emits
    warmup: int = ranged(10, 0)
    repeats: int = ranged(100, 1)
    max_seconds: float = ranged(5.0, 0.0)  # per case: the loop strategy's call is the slowest (`make bench` times it)
    # bench losses: a strategy whose forward+backward takes longer than this at a batch size is not timed at the
    # larger ones (the loop takes seconds a call at batch 16384), and says so
    max_call_ms: float = ranged(200.0, 0.0)
    # bench step: the speed-option rows timed beside the config's own step (GPU); empty = every row of its ladder
    variants: list[str] = field(default_factory=list)
    out: str = path("runs/bench/bench.json")


@dataclass
class ReportConfig:
    out_dir: str = path("docs/results")  # <out_dir>/<device>.md and its charts in <out_dir>/<device>/
    work_dir: str = path("runs/report")  # the runs it makes: <work_dir>/<device>/<time>/
    strategies: list[str] = ranged([], choices=(STRATEGY,))  # profiled; empty = every registered strategy
    # trained for report.train_steps steps each: the profiles must agree with their measured step
    train_strategies: list[str] = ranged(["padded", "packed"], choices=(STRATEGY,))
    train_steps: int = ranged(40, 11)  # past train's first 5 untimed steps and its first log window
    short: list[str] = ranged(["loop"], choices=(STRATEGY,))  # profiled with fewer steps: its step takes seconds
    # the scaling table (detector/bench/sharding.py: <out_dir>/<device>-x<N>.md): each train.shard_optimizer on 2, 4
    # ... processes up to this many, against one; 0 = one per visible GPU (one GPU or none: no table). On the CPU,
    # gloo processes
    processes: int = ranged(0, 0)
    # the ways of sharing (train.shard_optimizer) the scaling table runs on each number of processes; fewer, sooner
    sharding_modes: list[str] = ranged(list(WAYS), choices=tuple(WAYS))
    # replace a committed <out_dir>/<device>.md with a report whose runs the noise check flags (a busy machine):
    # false keeps the committed one and leaves the new report in the run folder
    force: bool = False


@dataclass
class TrainConfig:
    # a name from detector.losses.STRATEGIES; "all": one run each (strategy_sweep); "auto": the candidates timed in this
    # very step before the first, and the fastest trains (detector/train/run/auto.py), the choice kept for the next run
    strategy: str = ranged("padded", choices=(STRATEGY, "all", "auto"))
    # train.strategy=auto's candidates; empty: the 3 strategies `make shapes` predicts fastest for the data that train
    # here (neither emulated nor refused by the speed options)
    auto_candidates: list[str] = ranged([], choices=(STRATEGY,))
    seed: int = ranged(0, 0)  # model initialisation; the data has its own seed (data.seed)
    steps: int = ranged(1000, 1)  # optimizer steps; every step draws fresh images, none is seen twice
    lr: float = ranged(3e-4, 0.0)  # peak AdamW learning rate
    lr_min_ratio: float = ranged(0.1, 0.0, 1.0)  # the cosine decays to this fraction of lr (nanoGPT's choice)
    warmup_steps: int = ranged(50, 0)  # linear warm-up: a fresh model's first gradients are its largest
    weight_decay: float = ranged(0.01, 0.0)  # AdamW's default
    grad_clip: float = ranged(1.0, 0.0)  # max global gradient norm; 0 = no clipping
    log_every: int = ranged(10, 1)  # progress line and loss scalar; the host waits for the device only then
    eval_every: int = ranged(200, 1)  # steps between evaluations on the held-out range (and one at the end)
    eval_batches: int = ranged(4, 1)  # held-out batches per evaluation (drawn once, kept in memory)
    eval_start: int = ranged(1_000_000_000, 0)  # first held-out sample index: far beyond any run's training indices
    # steps between checkpoints, plus one at the end; 0 = none (timing runs); -1 = auto: as often as the disk keeps up
    # with, at most every minute of steps (detector/train/checkpoints/cadence.py), so that the step never waits for a
    # save
    checkpoint_every: int = ranged(-1, -1)
    out_dir: str = path("runs/train")  # a run writes to <out_dir>/<experiment>/<strategy>[+options]/
    # auto: the same command again continues an unfinished run of this configuration from its checkpoint (another
    # configuration's run is moved aside, a new one starts); true: continue it, and refuse another's; false: start
    # afresh
    resume: str = ranged("auto", choices=("auto", "true", "false"))
    stop_after: int = ranged(0, 0)  # end this run after that step with a checkpoint (time-limited jobs); 0 = never
    # torch.compile of the model (the loss stays the strategy's own: `compiled` is the compiled one): it fuses
    # pooling, ReLU and casts (`make bench-step` times the step with and without); the first steps compile
    compile: bool = True
    # cuDNN times its algorithms once for our fixed shapes and keeps the fastest (no loss measured at seed scale)
    cudnn_benchmark: bool = True
    # NHWC activations: cuDNN's NHWC convolutions run without layout conversions (`make bench-step` times it)
    channels_last: bool = True
    # the first 1 or 2 conv blocks (conv, pool, ReLU) as Triton kernels (detector/model/stem_kernel.py,
    # conv_pool_kernel.py), CUDA only: cuDNN has no fast path for 1 or 4 input channels, and spends many times what
    # their ~0.2 and ~1 GB of data need (`make bench-step` times the step with and without); 0 = cuDNN's layers
    fused_blocks: int = ranged(2, 0, 2)
    # the other blocks' bias, 2x2 max-pool and ReLU after cuDNN's bias-less convolution as one Triton kernel forward
    # and one backward (detector/model/bias_pool_kernel.py), CUDA only: compiled, they are 3 passes each way over
    # the pre-pool output, which the backward keeps; here one each way, keeping a byte per pooled value
    # (`make bench-step` times the step with and without)
    fused_pool: bool = True
    cuda_graphs: bool = False  # capture the whole step in one CUDA graph (padded layout, one GPU)
    # the head's big Linear in float8 (torchao's float8 training, tensorwise dynamic scaling; train/run/float8.py):
    # CUDA only, needs `pip install torchao` and a GPU with float8 tensor cores (sm89+). Off: it changes the
    # losses, and is on only once its curve matches bf16's (`make bench-step` times it, docs/training.md)
    float8: bool = False
    # how several processes share the model, one of the ways of detector/config/sharing.py: blocks, ours,
    # keeps AdamW's state of the head's blocks, and updates them, on their owner only; true/false: blocks/off.
    # `python -m detector scaling` measures them against each other
    shard_optimizer: str = ranged("blocks", choices=tuple(WAYS))
    # one_pass: the gradient clip, AdamW and the head's bf16 weights for the next forward in one pass over the
    # optimizer's state (detector/train/optimizer.py; compiled on CUDA at the first step); torch: clip_grad_norm_,
    # then torch's fused AdamW, then autocast's cast of every weight at the next forward (`make bench-step` times both)
    optimizer: str = ranged("one_pass", choices=("one_pass", "torch"))
    # a non-finite loss: stop (naming the step, the last good checkpoint kept), or skip that step's update
    nonfinite: str = ranged("stop", choices=("stop", "skip"))
    profile: bool = False  # one torch.profiler window (profile.wait/warmup/active) with make profile's regions


@dataclass
class Config:
    preset: str = "auto"  # auto: cpu when no GPU is present or device=cpu, else seed_scale (the defaults here)
    device: str = "auto"  # auto: cuda if available, else cpu
    autocast: bool = True  # bf16 autocast of the forward pass, as in the article
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    report: ReportConfig = field(default_factory=ReportConfig)


def resolve_preset(preset: str, device: str = "auto") -> str:
    """``auto``: the CPU's preset for a run on the CPU (no GPU present, or ``device=cpu`` on a machine with one:
    seed scale's compiled 1024-image steps are a GPU's work), else seed_scale."""
    if preset == "auto":
        return "seed_scale" if torch.cuda.is_available() and not str(device).startswith("cpu") else "cpu"
    return preset


def experiment_path(name: str) -> Path:
    """``experiments/<name>.yaml``; or, for a name with a folder or a .yaml suffix, that file (a bare
    ``<name>.yaml`` not found here is looked for in experiments/)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        candidates = [path] + ([EXPERIMENTS_DIR / path] if len(path.parts) == 1 else [])
        found = [p for p in candidates if p.is_file()]
        if not found:
            where = " or ".join(str(p) for p in candidates)
            raise ConfigFileNotFound(f"no experiment file {name} (looked for {where}, from {Path.cwd()})")
        return found[0]
    path = EXPERIMENTS_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))
        raise ConfigFileNotFound(f"no experiment {name!r} ({path}); known experiments: {', '.join(known)}")
    return path


@functools.cache
def _defaults(schema: type) -> DictConfig:
    """The schema's defaults as a typed config, built once a process: building one from the dataclasses took 10 ms
    of a load's 25, and the suite and the lab load hundreds; each load merges into a copy of it (2 ms)."""
    return OmegaConf.structured(schema)


def load_config(
    overrides: list[str] | None = None,
    experiment: str | None = None,
    schema: type = Config,
    announce=print,
    strategies: Collection[str] | None = None,
) -> DictConfig:
    """The merged, typed, range-checked configuration; announces the preset it picked.

    ``strategies``: the registered strategy names (``detector.losses.STRATEGIES``, or
    ``detector.losses.KnownStrategies()``, which also takes a strategy from outside, ``my_module:my_loss``) that
    strategy fields are checked against; None skips that check (this module does not import the losses).
    With ``data.boxes`` an annotation file, the file is read and checked here, and ``data.max_boxes`` set by
    ``data.over_max_boxes``; what the run gets of it is announced after the preset.
    Raises ConfigError (one line) for anything wrong in the files, the overrides or the values.
    """
    cli = parse_overrides(list(overrides or []), path_keys(schema))
    exp_file = experiment_path(experiment) if experiment else None
    exp = load_yaml(exp_file) if exp_file else OmegaConf.create()
    asked, device = (cli.get(key, exp.get(key, "auto")) for key in ("preset", "device"))
    preset = resolve_preset(asked, device)
    preset_file = EXPERIMENTS_DIR / "presets" / f"{preset}.yaml"
    if not preset_file.exists():
        known = sorted(p.stem for p in (EXPERIMENTS_DIR / "presets").glob("*.yaml"))
        raise ConfigFileNotFound(f"no preset {preset!r}; known presets: auto, {', '.join(known)}")
    cfg = copy.deepcopy(_defaults(schema))
    for source, layer in ((preset_file, load_yaml(preset_file)), (exp_file, exp), ("the overrides", cli)):
        try:
            cfg.merge_with(layer)
        except OmegaConfBaseException as err:
            key = f"{err.full_key}: " if getattr(err, "full_key", None) else ""
            message = (getattr(err, "msg", None) or str(err)).splitlines()[0]
            raise ConfigError(f"{key}{message} (in {source})") from None
    cfg.preset = preset
    if schema is Config:  # OmegaConf reads a YAML true/false into a str field as "True"/"False"
        cfg.train.shard_optimizer = SHARD_ALIASES.get(cfg.train.shard_optimizer, cfg.train.shard_optimizer)
        cfg.train.resume = {"True": "true", "False": "false"}.get(cfg.train.resume, cfg.train.resume)
    check_values(cfg, schema, strategies)
    if schema is Config:
        check_config(cfg)
    data = fit_slots(cfg.data) if schema is Config and cfg.data.boxes != SYNTHETIC else None
    aside = step_aside(cfg, dotted_keys(exp) | dotted_keys(cli)) if schema is Config else []
    if announce:
        why = ""
        if preset == "cpu" and not torch.cuda.is_available():
            why = " (no GPU found)"
        elif preset == "cpu" and asked == "auto":  # picked for device=cpu on a machine with a GPU
            why = f" (device={device})"
        announce(f"preset: {preset}{why}" + (f", experiment: {experiment}" if experiment else ""))
        for line in ([data] if data else []) + aside:
            announce(line)
    return cfg


def check_config(cfg: DictConfig) -> None:
    """What no one field's rule states: a device our steps run on, an annotation source that parses, an image size the
    model's blocks halve evenly, no more head blocks than outputs; raises ConfigError naming the first bad one."""
    if cfg.device != "auto":
        try:
            kind = torch.device(cfg.device).type
        except RuntimeError:
            kind = None
        if kind not in ("cpu", "cuda"):  # torch names more (mps, xpu, meta), which none of our steps runs on
            raise ConfigError(f"device={cfg.device!r} is out of range: allowed auto, cpu, cuda or cuda:N")
    if cfg.data.boxes != SYNTHETIC:
        try:
            parse_source(cfg.data.boxes)
        except AnnotationError as err:
            raise ConfigError(str(err)) from None
    if cfg.data.image_size % 2 ** len(cfg.model.channels):
        blocks = len(cfg.model.channels)
        allowed = f"multiples of {2**blocks}: each of the model's {blocks} conv blocks (model.channels) pools by 2"
        raise ConfigError(f"data.image_size={cfg.data.image_size} is out of range: allowed {allowed}")
    if cfg.model.head_blocks > cfg.model.hidden:  # 0 (auto) never is
        allowed = f"1 to model.hidden ({cfg.model.hidden}), one output slice per block"
        raise ConfigError(f"model.head_blocks={cfg.model.head_blocks} is out of range: allowed {allowed}")


def dotted_keys(layer: DictConfig, prefix: str = "") -> set[str]:
    """The dotted keys a YAML layer or the overrides set (``train.fused_blocks``)."""
    keys = set()
    for key, value in layer.items():
        keys |= dotted_keys(value, f"{prefix}{key}.") if isinstance(value, DictConfig) else {f"{prefix}{key}"}
    return keys


def step_aside(cfg: DictConfig, given: set[str]) -> list[str]:
    """The speed options that a preset or the defaults left on and that cannot run for this model on this device,
    turned down to what can (a line each, saying why). A value the user gave (``given``: the experiment file's keys
    and the overrides') is left as it is: the model's build refuses it in one line (train/run/speed_options.py)."""
    # imported here, not with this module: the kernels read TRITON_INTERPRET once, when first imported, and the CLI
    # sets it (no GPU) after importing the configuration and before loading the strategies
    from detector.model import fused_blocks_unavailable
    from detector.model.bias_pool_kernel import bias_pool_unavailable

    try:
        device = resolve_device(cfg)
    except ConfigError:  # device=cuda without a GPU: the run refuses it in its own line
        return []
    lines, tcfg = [], cfg.train
    if "train.fused_blocks" not in given and tcfg.fused_blocks:
        first = tcfg.fused_blocks
        reason = fused_blocks_unavailable(first, list(cfg.model.channels), device)
        while tcfg.fused_blocks and fused_blocks_unavailable(tcfg.fused_blocks, list(cfg.model.channels), device):
            tcfg.fused_blocks -= 1
        if reason:
            lines.append(f"train.fused_blocks={tcfg.fused_blocks} here, not the default {first}: {reason}")
    if "train.fused_pool" not in given and tcfg.fused_pool and (reason := bias_pool_unavailable(device)):
        tcfg.fused_pool = False
        lines.append(f"train.fused_pool=false here, not the default true: {reason}")
    return lines


def fit_slots(data: DictConfig) -> str:
    """Read data.boxes's file (detector/data/annotations.py checks it), set data.max_boxes by data.over_max_boxes
    (fit: from the data; refuse: an error where an image has more); one line on what the run gets of it."""
    annotations = read_annotations(data.boxes)
    data.max_boxes = slots_for(annotations, data.max_boxes, data.over_max_boxes)
    return describe(annotations, data.max_boxes, data.over_max_boxes)
