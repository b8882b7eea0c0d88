"""The device a run runs on: the configuration's ``device`` resolved on this machine, and the name that the records,
the tables and the log line give it."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from detector.errors import ConfigError


def resolve_device(cfg: DictConfig) -> torch.device:
    """The device of ``cfg.device`` (auto: the GPU where there is one); a GPU this machine lacks is the user's mistake,
    refused in one line."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device={cfg.device}: no CUDA device is available here (torch {torch.__version__}); use device=cpu or auto"
        )
    count = torch.cuda.device_count()
    if (device.index or 0) >= count:
        raise ConfigError(
            f"device={cfg.device}: no such GPU here (this machine has {count}: cuda:0 to cuda:{count - 1})"
        )
    return device


def device_name(device: torch.device | str) -> str:
    """The GPU's name for a CUDA device (``NVIDIA H200``), else the device type (``cpu``)."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
