"""What a checkpoint holds and means: the state of a run in one process's layout, whatever wrote it, and the resume
that refuses anything it cannot trust. How it lies on disk (torch.distributed.checkpoint's format, checksummed) is
checkpoints/files.py's, and what DCP's save and load are given checkpoints/dcp_io.py's; how a save stays off the
step's path, checkpoints/writer.py's.

One process's layout: each tensor is named as one process's model names it, each BlockedLinear as one Linear
(``<layer>.weight``: the blocks' rows joined, and their optimizer state with them). Every process holds rows of
some of these tensors (``Piece``): the whole of each on one process; under a way of sharing
(train/distributed/sharding/) its own shard, block or parameters, and copies of the rest. On save each row is written by
one process (``Piece.write``: its own rows by their holder, rows that every process holds split among them), all at
once; on resume each process reads the rows it holds, whatever number of processes and way of sharing wrote them.

"The same run" is the same global batch (``world_size x data.batch_size``): the data position is ``step x global
batch`` whoever reads it, so 2 processes of batch B resume on 1 of batch 2B, and the other way round; another global
batch is refused in one line, as is another configuration (``fingerprint``).
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from detector.checked import RecordError, need, read_json, versioned
from detector.config.schema import Config
from detector.model import BlockedLinear
from detector.train.checkpoints import files
from detector.train.checkpoints.files import CheckpointError

# Settings that change how a run is watched or how fast it goes, never its losses: a checkpoint
# written under other values of these still resumes.
RUN_CONTROL = {"resume", "stop_after", "log_every", "eval_every", "checkpoint_every", "out_dir", "profile"}
RUN_CONTROL |= {"compile", "cuda_graphs", "channels_last", "cudnn_benchmark", "fused_blocks", "fused_pool", "nonfinite"}
RUN_CONTROL |= {"shard_optimizer"}  # the checkpoint holds one process's layout whatever shards it
RUN_CONTROL |= {"optimizer"}  # one pass or torch's pieces: the same AdamW and the same state keys
RUN_CONTROL |= {"auto_candidates"}  # how train.strategy=auto chose: the checkpoint holds the strategy it chose
# Not train.float8: its products round to 3 mantissa bits and change the losses (the same state keys, though)

MINE, SPLIT, HELD = "mine", "split", "held"  # Piece.write: see there

__all__ = [
    "BytesRead",
    "CheckpointError",
    "Piece",
    "fingerprint",
    "load_checkpoint",
    "read_checkpoint",
    "read_model",
    "state_pieces",
]
META_VERSION = 1  # meta.json's
META_BYTES = 256 * 2**20  # a loss a step, about 20 bytes: 10^7 steps are 200 MB; a larger file is not one


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


# ----------------------------------------------------------------------------- the pieces a process holds


@dataclass(frozen=True)
class Piece:
    """Rows of one of the checkpoint's tensors that this process holds."""

    key: str  # the checkpoint's tensor: "model/<name>" or "optimizer/<name>/<state>"
    tensor: Tensor  # this process's rows of it: the live tensor (a view), written on save, filled on resume
    row: int  # the first of those rows in the checkpoint's tensor (0-dim: 0)
    shape: tuple[int, ...]  # the checkpoint tensor's whole shape
    # who writes these rows: MINE, this process (it alone holds them); SPLIT, every process holds them and each
    # writes its share; HELD, another process (their owner) does
    write: str

    def rows(self) -> int:
        return self.tensor.shape[0] if self.tensor.dim() else 1

    def offsets(self, first: int) -> torch.Size:
        """Where rows from ``first`` of this piece begin in its checkpoint tensor (0-dim: nowhere)."""
        return torch.Size([self.row + first] + [0] * (len(self.shape) - 1) if self.shape else [])


def layout(model: torch.nn.Module) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Each parameter's name -> (its name in a checkpoint, its first row there, the checkpoint tensor's shape): block
    i of a BlockedLinear (``<layer>.blocks.<i>.weight``) is rows starts[i].. of ``<layer>.weight``."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, BlockedLinear):
            starts = module.starts()
            for i, block in enumerate(module.blocks):
                for part, param in block.named_parameters():
                    out[f"{name}.blocks.{i}.{part}"] = (f"{name}.{part}", starts[i], (starts[-1], *param.shape[1:]))
    return {name: out.get(name, (name, 0, tuple(p.shape))) for name, p in model.named_parameters()}


def local_rows(tensor: Tensor) -> tuple[Tensor, int]:
    """(this process's rows of ``tensor``, the first's index): a DTensor's shard (FSDP2 shards dim 0), else all."""
    if hasattr(tensor, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), (offset[0] if tensor.dim() else 0)
    return tensor, 0


def state_pieces(step_fn) -> list[Piece]:
    """Every piece of the state that this process holds: the model's parameters and its optimizer's state (made
    first where the optimizer has not stepped yet, so that a resume has somewhere to put it)."""
    model, sharing = step_fn.model, step_fn.sharing
    optimizer = sharing.local(step_fn.optimizer)
    sharing.at_rest()
    init_state(optimizer)
    out, where = [], layout(model)
    for name, param in model.named_parameters():
        whole, first, shape = where[name]
        tensor, offset = local_rows(param.detach())
        out.append(Piece(f"model/{whole}", tensor, first + offset, shape, sharing.writes(param, state=False)))
        write = sharing.writes(param, state=True)
        for key, value in optimizer.state.get(param, {}).items():
            if value.dim():
                tensor, offset = local_rows(value)
                out.append(Piece(f"optimizer/{whole}/{key}", tensor, first + offset, shape, write))
            else:  # AdamW's step: one value for the whole tensor, the same in each of its blocks
                out.append(Piece(f"optimizer/{whole}/{key}", value, 0, (), write))
    return out


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state of every parameter that has none yet, as AdamW makes it at its first step (zeros; the step
    on the device for the fused and capturable kernels and the one pass, else on the CPU)."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable") or not isinstance(optimizer, torch.optim.AdamW)
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def written_rows(piece: Piece, rank: int, world_size: int) -> tuple[int, int] | None:
    """The rows of ``piece`` (indices into its tensor) that process ``rank`` writes, or None."""
    if piece.write == HELD or (piece.write == SPLIT and not piece.tensor.dim() and rank != 0):
        return None
    rows = piece.rows()
    if piece.write == MINE or not piece.tensor.dim():
        return 0, rows
    share, extra = divmod(rows, world_size)  # torch.tensor_split's shares
    start = rank * share + min(rank, extra)
    stop = start + share + (rank < extra)
    return (start, stop) if stop > start else None


# ----------------------------------------------------------------------------- what else a checkpoint holds: meta.json


def rng_state() -> dict:
    """Every RNG's state, as JSON can hold it."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return {
        "torch": encode(torch.get_rng_state()),
        "cuda": [encode(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "python": [version, list(state), gauss_next],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(decode(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        # the GPUs both the saving and this process see: a run saved where 2 were visible resumes where 1 is
        # (each process draws on its own device's generator; the saver's state of another device is its default)
        for device, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(decode(saved), device)
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, values, gauss_next = state["python"]
    random.setstate((version, tuple(values), gauss_next))


def encode(t: Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def decode(text: str) -> Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


SCHEDULED = ("lr", "initial_lr")  # what of an optimizer's parameter groups changes in a run (LambdaLR's)


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The learning rate of each parameter group (the rest is the configuration's, in the fingerprint)."""
    return [{k: float(g[k]) for k in SCHEDULED if k in g} for g in optimizer.param_groups]


def set_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        for key, value in values.items():
            if isinstance(group.get(key), Tensor):  # a device learning rate (CUDA graphs read its address)
                group[key].fill_(value)
            else:
                group[key] = value


META_KEYS = {  # meta.json's fields and their JSON types
    "step": int,
    "param_groups": list,
    "scheduler": dict,
    "rng": dict,
    "data": dict,
    "losses": list,
    "evals": list,
    "fingerprint": dict,
    "config": dict,
}


def meta_bytes(meta: dict) -> bytes:
    """meta.json's bytes (written through write_atomically by the checkpoint's writer thread). Its own ``default``:
    under train.cuda_graphs the learning rate is a one-value device tensor, in the schedule's state too, which JSON
    has no type for: it is written as its number; anything else that is not JSON's is a TypeError, never a string
    that the resume would read back as a value."""

    def number(value):
        if isinstance(value, Tensor) and value.numel() == 1:
            return value.item()
        raise TypeError(f"{type(value).__name__} in a checkpoint's meta")

    return json.dumps({"version": META_VERSION, **meta}, default=number).encode()


def read_meta(path: Path) -> dict:
    """meta.json, of a version this code reads and each field of its type; one line naming the file otherwise."""
    try:
        meta = read_json(path, META_BYTES)
        versioned(meta, str(path), META_VERSION)
        for key, kind in META_KEYS.items():
            need(meta.get(key), kind, f"{path}.{key}")
    except RecordError as err:
        raise CheckpointError(f"{path} is not a checkpoint's meta.json ({err}): {files.FIX}") from None
    return meta


# ----------------------------------------------------------------------------- resume


def load_checkpoint(
    run_dir: Path, step_fn, expected: dict, global_batch: int, group=None, checked: files.Verification | None = None
) -> dict:
    """Restore model, optimizer, schedule and RNG of ``step_fn`` (a TrainStep) from ``run_dir``'s checkpoint, with any
    number of processes and way of sharing, each process reading the rows it holds (every file it reads checked
    first, in parallel); return the saved meta (step, losses, evaluations). Refuses a checkpoint of another
    configuration or another global batch. ``group``: the processes' gloo group of DCP's plans (None: one process).
    ``checked``: the checks begun before the model was built, taken where they were of this manifest."""
    manifest = files.read_manifest(run_dir)
    folder, name = run_dir / manifest.folder, run_dir / files.MANIFEST
    if checked is None or not checked.result(manifest):
        files.verify(folder, manifest)
    meta = read_meta(folder / files.META)
    check_meta(meta, name, expected, global_batch, step_fn.world_size)
    from detector.train.checkpoints import dcp_io  # DCP's imports, only where a checkpoint is read (its docstring)

    dcp_io.load_pieces(folder, state_pieces(step_fn), name, group)
    set_param_groups(step_fn.optimizer, meta["param_groups"])
    step_fn.sharing.loaded()
    step_fn.scheduler.load_state_dict(meta["scheduler"])
    set_rng_state(meta["rng"])
    return meta


def check_meta(meta: dict, name: Path, expected: dict, global_batch: int, processes: int) -> None:
    saved = meta["fingerprint"]["global_batch"]
    if saved != global_batch:
        fix = f"data.batch_size={saved // processes} on {processes} process(es)"
        if saved % processes:
            fix = f"a number of processes that divides {saved}, each with {saved} / processes images"
        raise CheckpointError(
            f"checkpoint {name} was written with a global batch of {saved} images (data.batch_size x processes), "
            f"this run's is {global_batch} ({processes} process(es) x {global_batch // processes}): resume it with "
            f"{fix}, or set train.resume=false to start this folder afresh"
        )
    diffs = differences(meta["fingerprint"], expected)
    if diffs:
        raise CheckpointError(
            f"checkpoint {name} was written by another configuration ({'; '.join(diffs)}): resume with the "
            "checkpoint's settings, or set train.resume=false to start this folder afresh"
        )
    if meta["data"].get("next_index") != meta["step"] * global_batch:
        raise CheckpointError(
            f"checkpoint {name}: data position {meta['data'].get('next_index')} != step {meta['step']} x {global_batch}"
        )


def same_run(run_dir: Path, expected: dict, global_batch: int) -> int:
    """The step of ``run_dir``'s committed checkpoint where it is of this very configuration and global batch (the same
    command again continues it), else 0."""
    try:
        manifest = files.read_manifest(run_dir)
        meta = read_meta(run_dir / manifest.folder / files.META)
    except CheckpointError:
        return 0
    ok = meta["fingerprint"].get("global_batch") == global_batch and not differences(meta["fingerprint"], expected)
    return manifest.step if ok else 0


def saved_strategy(run_dir: Path) -> tuple[str, int] | None:
    """(the strategy, the step) of ``run_dir``'s committed checkpoint, from its fingerprint: what a run of
    train.strategy=auto chose; None where there is no checkpoint to read."""
    try:
        manifest = files.read_manifest(run_dir)
        meta = read_meta(run_dir / manifest.folder / files.META)
    except CheckpointError:
        return None
    train = meta["fingerprint"].get("train")
    name = train.get("strategy") if isinstance(train, dict) else None
    return (name, manifest.step) if isinstance(name, str) else None


def shared_checkpoint(run_dir: Path, world_size: int) -> bool:
    """Whether ``run_dir`` holds a checkpoint, once every rank has found the same one there: on several nodes the run
    folder must be one they share, or ranks would resume from different steps (or none). Refused in one line, on
    every rank alike."""
    digest = files.manifest_digest(run_dir)
    if world_size > 1:
        digests = [None] * world_size
        dist.all_gather_object(digests, digest)
        others = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if others:
            raise CheckpointError(
                f"train.resume=true: rank(s) {others} do not find the checkpoint in {run_dir} that rank 0 finds (or "
                "the other way round): on several nodes train.out_dir must be a folder that every node shares"
            )
    return digest is not None


@dataclass(frozen=True)
class BytesRead:
    """What a read of a checkpoint took of its files."""

    read: int  # bytes read: the checksum chunks that hold the tensors read, .metadata and meta.json
    tensors: int  # the tensors' own bytes among them
    total: int  # the checkpoint's bytes, every file


def read_checkpoint(run_dir: Path, only: tuple[str, ...] | None = None) -> dict:
    """A committed checkpoint as one dict, for tools and tests: its meta, and every tensor whole under ``tensors``
    (``model`` too: the model's alone, by its name in one process's layout), each file checked first; ``read``: its
    BytesRead. ``only``: the tensors of these parts alone (``("model",)``: ``model/<name>``), their chunks checked
    and read, the rest of the files left unread (their sizes checked)."""
    manifest = files.read_manifest(run_dir)
    folder = run_dir / manifest.folder
    records = {name: [(0, manifest.files[name].bytes)] for name in (files.DCP_METADATA, files.META)}
    read = files.verify(folder, manifest, spans=None if only is None else records)  # .metadata is checked first
    meta = read_meta(folder / files.META)
    from detector.train.checkpoints import dcp_io  # DCP's imports, only where a checkpoint is read (its docstring)

    metadata = dcp_io.read_metadata(folder)
    tensors = {
        key: torch.empty(size, dtype=dtype)
        for key, (size, dtype) in dcp_io.tensors(metadata).items()
        if only is None or key.split("/")[0] in only
    }
    where = files.tensor_spans(metadata, tensors)
    if only is not None:
        read += files.verify(folder, manifest, spans=where)
    dcp_io.read_into(folder, tensors)  # DCP reads the items of these keys alone
    meta["tensors"] = tensors
    meta["model"] = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    rows = sum(length for ranges in where.values() for _, length in ranges)
    meta["read"] = BytesRead(read, rows, manifest.total_bytes())
    return meta


def read_model(run_dir: Path) -> dict:
    """``read_checkpoint`` of the model's tensors alone (``model``), the optimizer's state left unread: what a run
    trained, for use outside it."""
    return read_checkpoint(run_dir, only=("model",))
