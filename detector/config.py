"""Typed configuration: every default once, here; YAML files in experiments/ hold only differences.

Merge order (later wins): these dataclass defaults (the seed-scale GPU setting of the article) <- a
preset (``preset=auto`` picks ``experiments/presets/cpu.yaml`` when no GPU is present) <- an
experiment file ``experiments/<name>.yaml`` <- dotlist overrides from the command line
(``data.batch_size=256``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent / "experiments"


@dataclass
class DataConfig:
    image_size: int = 256  # the article's 256x256 grayscale images; targets are uint8 up to 256 px
    max_boxes: int = 256  # slots per image M; the article supports up to 256 faces
    batch_size: int = 1024  # the article's batch
    length: int = 1_000_000  # samples are drawn on demand, so a long dataset costs nothing
    seed: int = 0  # sample i is a pure function of (seed, i)
    count_std: float = 3.0  # faces per image = floor(|N(0, count_std)|): ~1.9 on average
    tail_fraction: float = 0.0  # share of crowded images (tail_min..max_boxes faces); 0 = the article
    tail_min: int = 32  # fewest faces in a crowded image
    num_workers: int = -1  # -1 = a worker per free core, <= 16 (data.resolve_workers): each draws ~6k images/s


@dataclass
class ModelConfig:
    channels: list[int] = field(default_factory=lambda: [4, 16, 64, 256])  # 4 conv blocks, each pools by 2
    hidden: int = 16384  # the article's Linear(65536 -> 16384): ~1.1 B parameters


@dataclass
class ProfileConfig:
    strategy: str = "padded"  # a name from detector.losses.STRATEGIES
    mode: str = "train"  # train: + backward and optimizer step; forward: the article's protocol
    wait: int = 5  # torch.profiler schedule, as in the article
    warmup: int = 5
    active: int = 10
    out_dir: str = "runs/profile"  # traces go to <out_dir>/<strategy>[-forward]/
    lr: float = 1e-4  # optimizer of MODE=train (plain Adam step, just to time it)
    profile_memory: bool = True
    record_shapes: bool = False  # shapes bloat GPU traces of the loop strategy to hundreds of MB


@dataclass
class BenchConfig:
    strategies: list[str] = field(default_factory=list)  # empty = every registered strategy
    batch_sizes: list[int] = field(default_factory=lambda: [1024])
    distributions: list[str] = field(default_factory=lambda: ["seed", "tail"])  # see detector/cases.py
    pred_dtype: str = "bfloat16"  # what the model emits under autocast
    warmup: int = 10
    repeats: int = 100
    max_seconds: float = 5.0  # per case: the loop strategy takes ~0.6 s a call at batch 1024
    out: str = "runs/bench/bench.json"


@dataclass
class TrainConfig:
    strategy: str = "padded"  # a name from detector.losses.STRATEGIES, or "all": one run each (strategy_sweep)
    seed: int = 0  # model initialisation; the data has its own seed (data.seed)
    steps: int = 1000  # optimizer steps; every step draws fresh images, none is seen twice
    lr: float = 3e-4  # peak AdamW learning rate
    lr_min_ratio: float = 0.1  # the cosine decays to this fraction of lr (nanoGPT's choice)
    warmup_steps: int = 50  # linear warm-up: a fresh model's first gradients are its largest
    weight_decay: float = 0.01  # AdamW's default
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    log_every: int = 10  # progress line and loss scalar; the host waits for the device only then
    eval_every: int = 200  # steps between evaluations on the held-out range (and one at the end)
    eval_batches: int = 4  # held-out batches per evaluation (drawn once, kept in memory)
    eval_start: int = 1_000_000_000  # first held-out sample index: far beyond any run's training indices
    checkpoint_every: int = 500  # steps between checkpoints, plus one at the end; 0 = none (timing runs)
    out_dir: str = "runs/train"  # a run writes to <out_dir>/<experiment>/<strategy>[+options]/
    resume: bool = False  # continue from the run folder's checkpoint (else the folder starts afresh)
    stop_after: int = 0  # end this run after that step with a checkpoint (time-limited jobs); 0 = never
    compile: bool = False  # torch.compile of the model and (static-shape layouts) the loss
    cuda_graphs: bool = False  # capture the whole step in one CUDA graph (padded layout, one GPU)
    profile: bool = False  # one torch.profiler window (profile.wait/warmup/active) with make profile's regions


@dataclass
class Config:
    preset: str = "auto"  # auto: cpu when no GPU is present, else seed_scale (the defaults here)
    device: str = "auto"  # auto: cuda if available, else cpu
    autocast: bool = True  # bf16 autocast of the forward pass, as in the article
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def resolve_preset(preset: str) -> str:
    if preset == "auto":
        return "seed_scale" if torch.cuda.is_available() else "cpu"
    return preset


def experiment_path(name: str) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    path = EXPERIMENTS_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no experiment {name!r} ({path}); known experiments: {', '.join(known)}")
    return path


def load_config(
    overrides: list[str] | None = None, experiment: str | None = None, schema: type = Config, announce=print
) -> DictConfig:
    """The merged, typed configuration; announces the preset it picked."""
    cli = OmegaConf.from_dotlist(list(overrides or []))
    layers = [OmegaConf.structured(schema)]
    exp = OmegaConf.load(experiment_path(experiment)) if experiment else OmegaConf.create()
    preset = resolve_preset(cli.get("preset", exp.get("preset", "auto")))
    preset_file = EXPERIMENTS_DIR / "presets" / f"{preset}.yaml"
    if not preset_file.exists():
        known = sorted(p.stem for p in (EXPERIMENTS_DIR / "presets").glob("*.yaml"))
        raise FileNotFoundError(f"no preset {preset!r}; known presets: auto, {', '.join(known)}")
    layers += [OmegaConf.load(preset_file), exp, cli]
    cfg = OmegaConf.merge(*layers)
    cfg.preset = preset
    if announce:
        why = "" if preset != "cpu" or torch.cuda.is_available() else " (no GPU found)"
        announce(f"preset: {preset}{why}" + (f", experiment: {experiment}" if experiment else ""))
    return cfg


def resolve_device(cfg: DictConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={cfg.device} but no CUDA device is available (torch {torch.__version__})")
    return device
