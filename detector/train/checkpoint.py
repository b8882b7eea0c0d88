"""Checkpoints: atomic writes with a checksum, and a resume that refuses anything it cannot trust.

File format: one header line ``detector-checkpoint v1 sha256=<hex> bytes=<n>`` followed by the n bytes
of a ``torch.save`` payload. A torn, truncated, overwritten or foreign file fails the check on load
with one line naming the file, instead of resuming on silently wrong (or NaN) weights.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from detector.errors import UserError

MAGIC = b"detector-checkpoint v1"
HEADER_VALUES = re.compile(re.escape(MAGIC) + rb" sha256=[0-9a-f]{64} bytes=[0-9]{1,20}")  # what save_checkpoint writes
# Settings that change how a run is watched or how fast it goes, never its losses: a checkpoint
# written under other values of these still resumes.
RUN_CONTROL = {"resume", "stop_after", "log_every", "eval_every", "checkpoint_every", "out_dir", "profile"}
RUN_CONTROL |= {"compile", "cuda_graphs", "channels_last", "cudnn_benchmark", "fused_blocks", "nonfinite"}
RUN_CONTROL |= {"shard_optimizer"}  # the checkpoint holds one process's layout either way


class CheckpointError(UserError):
    pass


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
    """Write header + payload to a temporary file of this process, fsync, then rename over ``path``:
    a run killed mid-write leaves the previous checkpoint intact."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = MAGIC + f" sha256={hashlib.sha256(payload).hexdigest()} bytes={len(payload)}\n".encode()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C or a full disk mid-write: the previous checkpoint stands, no stray file
        tmp.unlink(missing_ok=True)
        raise


def read_checkpoint(path: Path) -> dict:
    """The state saved in ``path``, after checking its header and checksum."""
    fix = "delete it or set train.resume=false to start this run afresh"
    data = path.read_bytes()
    header, _, payload = data.partition(b"\n")
    if not HEADER_VALUES.fullmatch(header):
        raise CheckpointError(f"{path} is not a detector checkpoint (empty, foreign or garbled header): {fix}")
    fields = dict(field.split(b"=", 1) for field in header[len(MAGIC) :].split())
    if len(payload) != int(fields[b"bytes"]):
        raise CheckpointError(f"{path} is truncated ({len(payload)} of {int(fields[b'bytes'])} bytes): {fix}")
    if hashlib.sha256(payload).hexdigest().encode() != fields[b"sha256"]:
        raise CheckpointError(f"{path} is corrupt (its checksum does not match its contents): {fix}")
    # Our own file, holding numpy and Python RNG states: not loadable with weights_only=True.
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def load_checkpoint(path: Path, step_state, expected: dict, global_batch: int) -> dict:
    """Restore model, optimizer, schedule and RNG of ``step_state`` (a TrainStep) from ``path``; return
    the saved state (step, losses, evals). Refuses a checkpoint of another configuration."""
    state = read_checkpoint(path)
    diffs = differences(state["fingerprint"], expected)
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was written by another configuration ({'; '.join(diffs)}): resume with the "
            "checkpoint's settings, or set train.resume=false to start this folder afresh"
        )
    if state["data"]["next_index"] != state["step"] * global_batch:
        raise CheckpointError(
            f"checkpoint {path}: data position {state['data']['next_index']} != step {state['step']} x {global_batch}"
        )
    step_state.model.load_state_dict(state["model"])
    step_state.load_optimizer_state(state["optimizer"])
    step_state.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
