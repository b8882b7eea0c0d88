"""torch.distributed.checkpoint's side of a checkpoint (DCP): what its save and load are given, and those calls.

- ``RowsSavePlanner`` and ``write``: a save's rows as chunks of DCP's tensors, written by ``Writer`` (DCP's file
  writer in threads, at a lower priority beside the steps, its threads' failures raised);
- ``RowsLoadPlanner`` and ``load_pieces``: a resume's rows read straight into the live tensors, by ``Reader`` (DCP's
  reader in READERS threads, whose .metadata is unpickled only into DCP's own classes: ``MetadataUnpickler``);
- ``read_metadata``, ``tensors`` and ``read_into``: a checkpoint's tensors whole, for export and tools.

Imported only where a checkpoint is written or read (the first save's thread, a resume, export): DCP brings DTensor
and sympy with it, a fraction of a second of imports that a fresh run does not need before its first save. What the
files are and how they are checked is checkpoints/files.py's, what a checkpoint holds checkpoints/state.py's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from detector.errors import ThreadFailures
from detector.train.checkpoints import files
from detector.train.checkpoints.files import (
    DCP_METADATA,
    FIX,
    CheckpointError,
    one_line,
)

# ----------------------------------------------------------------------------- the plans


class RowsSavePlanner(DefaultSavePlanner):
    """DCP's save plan of this process's rows: each (key, offsets, rows) it writes (``staged``) is one chunk of the
    checkpoint tensor ``key``; DCP's global plan checks that the processes' chunks cover every tensor once."""

    def __init__(self, staged: list[tuple[str, torch.Size, torch.Size, Tensor]]):
        super().__init__(flatten_state_dict=False)
        self.staged = {(key, tuple(offsets)): (shape, tensor) for key, offsets, shape, tensor in staged}

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), (shape, tensor) in self.staged.items():
            whole = tuple(tensor.shape) == tuple(shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
            data = TensorWriteData(chunk, TensorProperties.create_from_tensor(tensor), torch.Size(shape))
            kind = WriteItemType.TENSOR if whole else WriteItemType.SHARD
            items.append(WriteItem(MetadataIndex(key, torch.Size(offsets)), kind, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Tensor:
        return self.staged[(write_item.index.fqn, tuple(write_item.index.offset))][1]


class RowsLoadPlanner(DefaultLoadPlanner):
    """DCP's load plan of this process's pieces: the rows of each, read from whichever chunks of the checkpoint hold
    them (DCP's resharding), straight into the live tensors. A tensor of another shape or dtype than the model's is
    refused in one line naming ``name``. ``pieces``: state.py's ``Piece`` each (this module imports nothing of
    state.py, which imports it where it reads)."""

    def __init__(self, pieces: list, name: Path):
        super().__init__(flatten_state_dict=False)
        self.pieces, self.name = pieces, name

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for i, piece in enumerate(self.pieces):
            saved = self.metadata.state_dict_metadata.get(piece.key)
            if saved is None and piece.key.startswith("optimizer/"):
                continue  # a parameter that never had a gradient: AdamW makes its state at its first
            found = "nothing" if saved is None else "not a tensor"
            if isinstance(saved, TensorStorageMetadata):
                found = f"{list(saved.size)} {str(saved.properties.dtype).removeprefix('torch.')}"
            wanted = f"{list(piece.shape)} {str(piece.tensor.dtype).removeprefix('torch.')}"
            if found != wanted:
                raise CheckpointError(f"checkpoint {self.name} holds {piece.key} as {found}, this model as {wanted}")
            local = ChunkStorageMetadata(offsets=piece.offsets(0), sizes=piece.tensor.size())
            items = create_read_items_for_chunk_list(piece.key, saved, [local])
            covered = sum(math.prod(item.lengths) for item in items)
            if covered != piece.tensor.numel():  # chunks that leave rows out: those would keep the model's values
                raise CheckpointError(
                    f"checkpoint {self.name}: the chunks of {piece.key} hold {covered} of the {piece.tensor.numel()} "
                    f"values of its rows {piece.row}..{piece.row + piece.rows() - 1}: {files.FIX}"
                )
            requests += [dataclasses.replace(it, dest_index=MetadataIndex(piece.key, local.offsets, i)) for it in items]
        self.plan = LoadPlan(requests)
        return self.plan

    def resolve_tensor(self, read_item) -> Tensor:
        tensor = self.pieces[read_item.dest_index.index].tensor.detach()
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def commit_tensor(self, read_item, tensor: Tensor) -> None:
        pass  # DCP copied the rows into the live tensor's view itself


# ----------------------------------------------------------------------------- DCP's files, read safely

ALLOWED = {  # what DCP's .metadata pickle may build: its metadata classes, torch's sizes and dtypes, paths
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = ALLOWED.get(module, set())
        if module not in ALLOWED or (allowed is not None and name not in allowed):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
        return super().find_class(module, name)


class Reader(FileSystemReader):
    """DCP's reader of a save folder whose .metadata is unpickled by ``MetadataUnpickler`` (the caller has checked its
    checksum first). ``refused``: why it refused the .metadata, kept because DCP's load catches what read_metadata
    raises and, in some torch versions, says only "metadata is None"."""

    refused: CheckpointError | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / DCP_METADATA
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
            self.refused = CheckpointError(f"{path} is not DCP's metadata ({err}): {FIX}")
            raise self.refused from None
        if not isinstance(metadata, Metadata):
            self.refused = CheckpointError(f"{path} is not DCP's metadata (a {type(metadata).__name__}): {FIX}")
            raise self.refused
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """DCP's read of ``plan``, its items split among READERS threads: each thread reads a run of items that lie
        one after the other in a file (DCP's own reader runs them all in one thread)."""
        groups = read_groups(plan.items, self.storage_data, files.READERS)
        if len(groups) <= 1:
            return super().read_data(plan, planner)
        read = super().read_data
        with concurrent.futures.ThreadPoolExecutor(len(groups), thread_name_prefix="checkpoint-read") as pool:
            for done in [pool.submit(read, dataclasses.replace(plan, items=group), planner) for group in groups]:
                done.result()
        future: Future = Future()
        future.set_result(None)
        return future


def read_groups(items: list, storage: dict, parts: int) -> list[list]:
    """``items`` (DCP's ReadItems) in file order, cut into at most ``parts`` runs of about equal bytes."""
    where = {id(item): storage[item.storage_index] for item in items}
    ordered = sorted(items, key=lambda item: (where[id(item)].relative_path, where[id(item)].offset))
    total = sum(where[id(item)].length for item in ordered)
    groups, size = [[]], 0
    for item in ordered:
        length = where[id(item)].length
        # a new run where this item would end past the current run's share by more than half of itself
        if groups[-1] and len(groups) < parts and size + length / 2 > total * len(groups) / parts:
            groups.append([])
        groups[-1].append(item)
        size += length
    return [group for group in groups if group]


class Writer(FileSystemWriter):
    """DCP's writer, in ``threads`` files of each process, its IO threads at the priority of the thread that writes
    (the checkpointer's: lower beside the steps). An IO thread of DCP's that raises (a full disk) leaves its items
    unwritten and its exception to the thread's hook, and DCP carries on: the save raises it (``ThreadFailures``),
    never commits without them."""

    def __init__(self, path: Path, threads: int):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=threads)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        written = {result.index for result in future.value()}
        lost = sum(item.index not in written for item in plan.items)
        if lost:
            failed = ThreadFailures.take("_write_files_from_queue")  # the thread's name, after its target
            raise failed or CheckpointError(
                f"DCP's writer threads wrote {len(plan.items) - lost} of {len(plan.items)} items"
            )
        return future


# ----------------------------------------------------------------------------- the calls


def quiet_dcp() -> None:
    """DCP warns on every save and load of one process that it assumes one process, which we asked for (no_dist)."""
    warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to (save|load)")


def write(folder: Path, staged: list, threads: int, group) -> None:
    """Write this process's ``staged`` rows ((key, offsets, shape, tensor) each) as chunks of one DCP checkpoint in
    ``folder``, in ``threads`` files, at the calling thread's priority; ``group``: the processes' gloo group of DCP's
    plans (None: one process)."""
    quiet_dcp()
    writer = Writer(folder, threads)
    dcp.save({}, storage_writer=writer, planner=RowsSavePlanner(staged), process_group=group, no_dist=group is None)


def load_pieces(folder: Path, pieces: list, name: Path, group) -> None:
    """Read the rows of ``pieces`` from the checkpoint in ``folder`` (whose manifest is ``name``) into the live
    tensors; one CheckpointError, on every process alike, for anything DCP or our checks refuse."""
    quiet_dcp()
    reader = Reader(folder)
    try:
        dcp.load(
            {}, storage_reader=reader, planner=RowsLoadPlanner(pieces, name), process_group=group, no_dist=group is None
        )
    except (Exception, CheckpointException) as err:  # ours or DCP's own checks, raised on any process
        found = reader.refused or files.root(err)
        if isinstance(found, CheckpointError):
            raise found from err
        raise CheckpointError(f"checkpoint {folder} could not be read ({one_line(found)}): {FIX}") from err


def read_metadata(folder: Path) -> Metadata:
    """The .metadata of the checkpoint in ``folder`` (its checksum checked first by the caller)."""
    return Reader(folder).read_metadata()


def tensors(metadata: Metadata) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Each tensor of a checkpoint's .metadata: its key -> (its whole size, its dtype)."""
    return {
        key: (md.size, md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def read_into(folder: Path, tensors: dict[str, Tensor]) -> None:
    """Fill ``tensors`` (whole, by key) from the checkpoint in ``folder``: DCP reads the items of these keys alone."""
    quiet_dcp()
    dcp.load(tensors, storage_reader=Reader(folder), no_dist=True)
