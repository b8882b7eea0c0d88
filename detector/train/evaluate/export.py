"""What a run trained, usable outside it: the model's own ``state_dict`` in one file that plain torch reads.

``detector export <run folder>`` (``make export RUN=...``) writes ``<run>/export/model.pt``::

    {"format": "detector-export", "version": 1,
     "arguments": {"image_size": ..., "max_boxes": ..., "channels": [...], "hidden": ...},  # FaceDetector's
     "state_dict": {...},   # FaceDetector's own names, the head as one block (one process's model)
     "step": ..., "config": {...}}  # the checkpoint's step and the run's configuration

read with ``torch.load(path, weights_only=True)`` (tensors, numbers, text: nothing runs when it is read)::

    import torch; from detector.model import FaceDetector
    saved = torch.load("runs/train/seed_scale/padded+compile/export/model.pt", weights_only=True)
    model = FaceDetector(**saved["arguments"]); model.load_state_dict(saved["state_dict"])
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from detector.errors import UserError
from detector.model import FaceDetector
from detector.train import checkpoints
from detector.train.checkpoints import human_bytes
from detector.train.checkpoints.manager import BytesRead, layout, read_model

FORMAT, VERSION = "detector-export", 1
EXPORT = Path("export") / "model.pt"


def model_arguments(config: dict) -> dict:
    """FaceDetector's arguments of a run's configuration (a dict, as meta.json and config.yaml hold it)."""
    data, model = config["data"], config["model"]
    return {
        "image_size": data["image_size"],
        "max_boxes": data["max_boxes"],
        "channels": list(model["channels"]),
        "hidden": model["hidden"],
    }


def trained_state(run_dir: Path) -> tuple[dict, dict]:
    """(FaceDetector's state_dict of ``run_dir``'s last checkpoint, its meta) on the CPU: the checkpoint's model tensors
    in one process's layout, cut into the model's own parameters (one head block); the optimizer's state left unread
    (meta's ``read``: the BytesRead)."""
    if not checkpoints.exists(run_dir):
        raise UserError(f"{run_dir} holds no checkpoint (checkpoint.json): train it first (make train)")
    saved = read_model(run_dir)
    arguments = model_arguments(saved["config"])
    with torch.device("meta"):  # names and shapes only: no weights drawn
        model = FaceDetector(**arguments)
    where, state = layout(model), {}
    for name, param in model.named_parameters():
        whole, first, _ = where[name]
        tensor = saved["model"].get(whole)
        if tensor is None:
            raise UserError(f"{run_dir}'s checkpoint has no model/{whole}: not a checkpoint of this detector")
        rows = tensor[first : first + param.shape[0]] if param.dim() else tensor
        state[name] = rows if rows.shape == tensor.shape else rows.clone()  # a part: torch.save writes its rows alone
    return state, saved


def described(read: BytesRead) -> str:
    """What a read of a checkpoint's model took of its files, in the command's words."""
    return (
        f"read {human_bytes(read.read)} of the checkpoint's {human_bytes(read.total)}: the checksummed chunks that "
        f"hold the model's {human_bytes(read.tensors)}"
    )


def export(run_dir: Path, out: Path | None = None) -> tuple[Path, str]:
    """Write ``out`` (default ``<run>/export/model.pt``; a folder: model.pt in it) from ``run_dir``'s last checkpoint;
    returns where, and what it read of the checkpoint (in words)."""
    state, saved = trained_state(run_dir)
    out = out or run_dir / EXPORT
    out = out / EXPORT.name if out.is_dir() else out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    body = {"format": FORMAT, "version": VERSION, "arguments": model_arguments(saved["config"]), "state_dict": state}
    torch.save(body | {"step": saved["step"], "config": saved["config"]}, partial)
    partial.replace(out)  # a failed export never replaces an earlier one
    return out, described(saved["read"])


def load_model(path: Path) -> tuple[FaceDetector, dict]:
    """The trained detector of a run folder (its last checkpoint's model, the optimizer's state left unread) or of an
    export file (memory-mapped), on the CPU, and its record (an export's keys; ``read``: what was read, in words)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such run folder or export file")
    if path.is_dir():
        state, saved = trained_state(path)
        read = described(saved["read"])
        saved = {**saved, "arguments": model_arguments(saved["config"]), "state_dict": state, "read": read}
    else:
        if not zipfile.is_zipfile(path):  # torch.save's archive, which a memory-mapped load needs
            raise UserError(f"{path} is not an export of detector (not the zip archive that torch.save writes)")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, RuntimeError, EOFError) as err:
            raise UserError(f"{path} is not an export of detector ({' '.join(str(err).split())[:200]})") from None
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise UserError(f"{path} is not an export of detector (detector export <run folder> writes one)")
        saved["read"] = f"read the export's {human_bytes(path.stat().st_size)}, memory-mapped"
    with torch.device("meta"):  # no weights drawn: the loaded tensors become the parameters (assign), uncopied
        model = FaceDetector(**saved["arguments"])
    model.load_state_dict(saved["state_dict"], assign=True)
    return model.eval(), saved
