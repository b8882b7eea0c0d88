"""The device a run runs on: the configuration's ``device`` resolved on this machine, and the name that the records,
the tables and the log line give it."""

from __future__ import annotations

import contextlib
import os
import threading

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


def synchronize(device: torch.device | str | None = None) -> None:
    """Waits for the GPU's work queued so far (``device``, else the GPU where there is one); nothing on the CPU, whose
    work is done when its call returns."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def begin_context(cfg: DictConfig) -> threading.Thread | None:
    """Create this process's CUDA context (seconds on a large GPU) in a thread begun now, while the command goes on
    importing what its run needs; ``context_ready`` waits for it. None off the GPU. Under torchrun the context is the
    process's own GPU's (LOCAL_RANK), as the process group's set-up picks it."""
    try:
        device = resolve_device(cfg)
    except ConfigError:  # a GPU this machine lacks: the run refuses it in its own line
        return None
    if device.type != "cuda":
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

    def create() -> None:
        with contextlib.suppress(Exception):  # its error, if any, comes again where the run first uses the device
            torch.cuda.mem_get_info(device)  # torch's lazy initialisation, then the context: the driver's work

    thread = threading.Thread(target=create, name="cuda-context", daemon=True)
    thread.start()
    return thread


def context_ready(thread: threading.Thread | None) -> None:
    """Wait for ``begin_context``'s thread (None: nothing to wait for)."""
    if thread is not None:
        thread.join()
