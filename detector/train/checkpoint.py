"""Checkpoints: atomic writes with a checksum, and a resume that refuses anything it cannot trust.

File format: one header line ``detector-checkpoint v1 sha256=<hex> bytes=<n>`` followed by the n bytes
of a ``torch.save`` payload. A torn, truncated, overwritten or foreign file fails the check on load
with one line naming the file, instead of resuming on silently wrong (or NaN) weights.

Resharding: the payload holds one process's state, whatever number of processes wrote it, and each
BlockedLinear as one Linear (``one_linear``: the blocks' rows joined, and their optimizer state with them),
so any number of processes, and so of blocks (``model.head_blocks=0``: one per process), resumes it
(``into_blocks``). "The same run" is the same global batch (``world_size x data.batch_size``): the data
position is ``step x global batch`` whoever reads it, so 2 processes of batch B resume on 1 of batch 2B, and
the other way round; another global batch is refused in one line.

Why one file and not ``torch.distributed.checkpoint``'s (DCP) save: DCP writes a folder of per-rank files
and a metadata file, in the layout of the run that wrote them. The integrity check (a header and a sha256
over the whole payload, an atomic rename, a damaged file refused in one line) would need a checksum per
file, a manifest and a folder swap; and gathering the whole state onto rank 0 fits in its host memory at
seed scale (~13 GB). DCP's ``state_dict`` API is what gathers and shards the state under FSDP2
(``sharding.FullyShardedModel``), ``full_state_dict=True``: one process's layout, as here.
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
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from detector.config import Config
from detector.errors import UserError
from detector.model import BlockedLinear

MAGIC = b"detector-checkpoint v1"
LAYOUT = 2  # the payload's layout: 2 = one process's, the head as one Linear, the fingerprint's global batch
HEADER_VALUES = re.compile(re.escape(MAGIC) + rb" sha256=[0-9a-f]{64} bytes=[0-9]{1,20}")  # what save_checkpoint writes
# Settings that change how a run is watched or how fast it goes, never its losses: a checkpoint
# written under other values of these still resumes.
RUN_CONTROL = {"resume", "stop_after", "log_every", "eval_every", "checkpoint_every", "out_dir", "profile"}
RUN_CONTROL |= {"compile", "cuda_graphs", "channels_last", "cudnn_benchmark", "fused_blocks", "fused_pool", "nonfinite"}
RUN_CONTROL |= {"shard_optimizer"}  # the checkpoint holds one process's layout whatever shards it
RUN_CONTROL |= {"optimizer"}  # one pass or torch's pieces: the same AdamW and the same state keys
# Not train.float8: its products round to 3 mantissa bits and change the losses (the same state keys, though)


class CheckpointError(UserError):
    pass


def fingerprint(cfg: DictConfig, world_size: int) -> dict:
    """What determines a run's losses; a checkpoint resumes only under the same fingerprint. The batch is
    the global one: how many processes share it changes the order of the sums, not the run."""
    c = OmegaConf.to_container(cfg, resolve=True)
    return {
        "data": {k: v for k, v in c["data"].items() if k not in ("num_workers", "batch_size", "worker_timeout")},
        "global_batch": c["data"]["batch_size"] * world_size,
        "model": c["model"],
        "train": {k: v for k, v in c["train"].items() if k not in RUN_CONTROL},
        "autocast": c["autocast"],
    }


def differences(saved: dict, now: dict, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """What differs between a checkpoint's fingerprint and the run's. A setting the checkpoint does not name (it
    was added after the checkpoint was written) is the same where the run leaves it at its default."""
    defaults = fingerprint(OmegaConf.structured(Config), 1) if defaults is None else defaults
    out = []
    for key in sorted(set(saved) | set(now)):
        default = defaults.get(key, "<missing>") if isinstance(defaults, dict) else "<missing>"
        a, b = saved.get(key, default), now.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.", default if isinstance(default, dict) else {})
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the checkpoint, {b!r} now")
    return out


def checkpoint_names(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """Each parameter's name -> (its name in a checkpoint, its block): block i of a BlockedLinear
    (``<layer>.blocks.<i>.weight``) holds rows of ``<layer>.weight``; any other parameter keeps its name."""
    blocks = {}
    for name, module in model.named_modules():
        if isinstance(module, BlockedLinear):
            for i, block in enumerate(module.blocks):
                blocks |= {f"{name}.blocks.{i}.{part}": (f"{name}.{part}", i) for part, _ in block.named_parameters()}
    return {name: blocks.get(name, (name, 0)) for name, _ in model.named_parameters()}


def join(parts: list[Tensor]) -> Tensor:
    """The blocks' values of one Linear's: rows concatenated; a scalar (AdamW's step) is the same in each."""
    return torch.cat(parts) if len(parts) > 1 and parts[0].dim() else parts[0]


def in_order(pairs: list[tuple[int, object]]) -> list:
    return [value for _, value in sorted(pairs, key=lambda pair: pair[0])]


def one_linear(model: torch.nn.Module, model_state: dict, optimizer_state: dict) -> tuple[dict, dict]:
    """A checkpoint's layout of one process's state dicts (optimizer state indexed in ``model``'s parameter
    order): each BlockedLinear's blocks joined into one Linear's weight and bias, and their optimizer state
    with them."""
    where = checkpoint_names(model)
    names, joined = list(where), list(dict.fromkeys(whole for whole, _ in where.values()))
    parts: dict[str, list] = {}  # name in the checkpoint -> [(block, tensor)]
    for key, value in model_state.items():
        whole, block = where.get(key, (key, 0))  # a buffer, if any, keeps its name
        parts.setdefault(whole, []).append((block, value))
    model_out = {key: join(in_order(values)) for key, values in parts.items()}
    states: dict[int, list] = {}  # index in the checkpoint -> [(block, its optimizer state)]
    for i, state in optimizer_state["state"].items():
        whole, block = where[names[i]]
        states.setdefault(joined.index(whole), []).append((block, state))
    optimizer_out = {}
    for j, values in states.items():
        blocks = in_order(values)
        optimizer_out[j] = {key: join([state[key] for state in blocks]) for key in blocks[0]}
    (group,) = optimizer_state["param_groups"]  # build_optimizer makes one group
    return model_out, {"state": optimizer_out, "param_groups": [{**group, "params": list(range(len(joined)))}]}


def into_blocks(model: torch.nn.Module, model_state: dict, optimizer_state: dict) -> tuple[dict, dict]:
    """``one_linear``'s inverse for ``model``'s blocks (BlockedLinear's own split of its rows, ``tensor_split``)."""
    where = checkpoint_names(model)
    joined = list(dict.fromkeys(whole for whole, _ in where.values()))
    count = {whole: sum(w == whole for w, _ in where.values()) for whole in joined}

    def part(value: Tensor, whole: str, i: int) -> Tensor:
        # a scalar is cloned: blocks sharing one step tensor would each step it
        return value.tensor_split(count[whole])[i] if value.dim() else value.clone()

    model_out = {key: value for key, value in model_state.items() if key not in count}  # buffers, if any
    model_out |= {name: part(model_state[whole], whole, i) for name, (whole, i) in where.items()}
    optimizer_out = {}
    for i, (whole, block) in enumerate(where.values()):
        state = optimizer_state["state"].get(joined.index(whole))
        if state is not None:
            optimizer_out[i] = {key: part(value, whole, block) for key, value in state.items()}
    (group,) = optimizer_state["param_groups"]
    return model_out, {"state": optimizer_out, "param_groups": [{**group, "params": list(range(len(where)))}]}


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


def shared_checkpoint(path: Path, world_size: int) -> bool:
    """Whether ``path`` exists, once every rank has found the same file there (its header, checksum
    included): on several nodes the run folder must be one they share, or ranks would resume from
    different steps (or none). Refused in one line, on every rank alike."""
    header = path.open("rb").readline(200) if path.exists() else None
    if world_size > 1:
        headers = [None] * world_size
        dist.all_gather_object(headers, header)
        others = [rank for rank, h in enumerate(headers) if h != headers[0]]
        if others:
            raise CheckpointError(
                f"train.resume=true: rank(s) {others} do not find the checkpoint {path} that rank 0 finds (or the "
                "other way round): on several nodes train.out_dir must be a folder that every node shares"
            )
    return header is not None


def load_checkpoint(path: Path, step_state, expected: dict, global_batch: int) -> dict:
    """Restore model, optimizer, schedule and RNG of ``step_state`` (a TrainStep) from ``path``, with any
    number of processes; return the saved state (step, losses, evals). Refuses a checkpoint of another
    configuration or another global batch."""
    state = read_checkpoint(path)
    if state.get("layout") != LAYOUT:
        raise CheckpointError(
            f"checkpoint {path} was written by an earlier version of detector (in its processes' layout): set "
            "train.resume=false to start this folder afresh"
        )
    saved, processes = state["fingerprint"]["global_batch"], step_state.world_size
    if saved != global_batch:
        fix = f"data.batch_size={saved // processes} on {processes} process(es)"
        if saved % processes:
            fix = f"a number of processes that divides {saved}, each with {saved} / processes images"
        raise CheckpointError(
            f"checkpoint {path} was written with a global batch of {saved} images (data.batch_size x processes), "
            f"this run's is {global_batch} ({processes} process(es) x {global_batch // processes}): resume it with "
            f"{fix}, or set train.resume=false to start this folder afresh"
        )
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
    model, optimizer = into_blocks(step_state.model, state["model"], state["optimizer"])
    step_state.load_model_state(model)
    step_state.load_optimizer_state(optimizer)
    step_state.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
