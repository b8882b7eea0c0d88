"""The link alone: each collective that a way of sharing sends in a step, on the head's weight at the configured
scale, timed by itself with nothing computing beside it. It is the floor for the step's communication, as
``bench step`` measures the floor for its compute. The scaling table (detector/bench/sharding.py) measures it in
the same run as its training runs:

    python -m torch.distributed.run --standalone --nproc_per_node=N -m detector link --out=l.json [key=value]

The collectives, on the head's first Linear (65536 × 16384 at seed scale; its bias and the trunk add ~1 %), and the
ways of sharing that send them (``Way.sends``, detector/config/sharing.py):

    reduce       each rank's fp32 gradient of each share of rows, reduced onto the share's owner, in one NCCL group as
                 ShardedBlocks sends them (gloo: one reduce after another)
    all-gather   each rank's updated rows to every rank, as the forward reads them (bf16 under autocast)
    all-reduce   every fp32 gradient, summed on every rank

Each is timed ``bench.repeats`` times after ``bench.warmup`` untimed calls (CUDA events on a GPU; on the CPU the
wall clock between barriers). Rank 0 writes the JSON: per collective its times and the bytes each process sends
(``LinkTimes``, the record the scaling table reads again through ``read_link``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from detector import checked
from detector.checked import RecordError, need, read_json, versioned, write_atomically
from detector.config.device import device_name
from detector.config.schema import load_config
from detector.config.sharing import WAYS
from detector.errors import UserError
from detector.lab.present.tables import markdown_table, significant
from detector.train.distributed import processes as distributed
from detector.train.distributed.sharding.blocks import all_gather_single, reduce_onto_owners

VERSION = 2  # of the link's JSON; 1: no "version" key
LINK_BYTES = 2**20  # three collectives' times: a few kB; a larger file is not one


@dataclass
class LinkTimes:
    """The link alone on ``processes`` processes of ``device``, the head's ``shape``: per collective its ``name``, the
    ``role`` of what the step sends with it, the ``bytes`` each process sends and the ``ms`` of each call."""

    processes: int
    device: str
    shape: list[int]
    collectives: list[dict]
    version: int = VERSION

    def to_json(self) -> dict:
        return asdict(self)

    def write(self, path: Path) -> None:
        write_atomically(path, json.dumps(self.to_json()).encode())

    @classmethod
    def parse(cls, data, where: str) -> LinkTimes:
        """The record of parsed JSON; RecordError naming ``where`` and the first field of the wrong shape."""
        versioned(data, where, VERSION)
        shape = need(data.get("shape"), list, f"{where}.shape")
        if len(shape) != 2:
            raise RecordError(f"{where}.shape has {len(shape)} items, expected [rows, columns]")
        collectives = need(data.get("collectives"), list, f"{where}.collectives")
        if not collectives:
            raise RecordError(f"{where}.collectives is empty: no collective timed")
        for i, c in enumerate(collectives):
            at = f"{where}.collectives[{i}]"
            need(c, dict, at)
            need(c.get("name"), str, f"{at}.name")
            need(c.get("role"), str, f"{at}.role")
            checked.measure(c.get("bytes"), f"{at}.bytes", kind=int)
            times = need(c.get("ms"), list, f"{at}.ms")
            if not times:
                raise RecordError(f"{at}.ms is empty: no call timed")
            for j, ms in enumerate(times):
                checked.measure(ms, f"{at}.ms[{j}]")
        return cls(
            processes=checked.measure(data.get("processes"), f"{where}.processes", low=2, kind=int),
            device=need(data.get("device"), str, f"{where}.device"),
            shape=[checked.measure(n, f"{where}.shape[{i}]", low=1, kind=int) for i, n in enumerate(shape)],
            collectives=collectives,
        )


def read_link(path: Path) -> LinkTimes:
    """The link's times in ``path``; RecordError, one line naming the file and the field, otherwise."""
    return LinkTimes.parse(read_json(path, LINK_BYTES), str(path))


def head_shape(cfg) -> tuple[int, int]:
    """(rows, columns) of the head's first Linear: model.hidden by the flattened last conv block."""
    side = cfg.data.image_size // 2 ** len(cfg.model.channels)
    return cfg.model.hidden, cfg.model.channels[-1] * side * side


def collectives(rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """(name, what the step sends with it, bytes each process sends, call) of each collective, on tensors made once."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grads = torch.randn(rows, columns, device=device)
    shares = grads.chunk(world)
    gathered = torch.empty(rows, columns, device=device, dtype=dtype)
    mine = gathered.chunk(world)[rank]
    elements, share = rows * columns, (world - 1) / world

    def reduce() -> None:  # as ShardedBlocks sends the head's gradients
        for work in reduce_onto_owners([(part, owner) for owner, part in enumerate(shares)]):
            work.wait()

    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    found = [
        ("reduce", "the fp32 gradients onto their owners", int(elements * 4 * share), reduce),
        (
            "all-gather",
            f"the updated rows, {precision}",
            int(elements * dtype.itemsize * share),
            lambda: all_gather_single(gathered, mine),
        ),
        ("all-reduce", "every fp32 gradient", int(2 * elements * 4 * share), lambda: dist.all_reduce(grads)),
    ]
    return [(name, f"{senders(name)}: {what}", sent, call) for name, what, sent, call in found]


def senders(collective: str) -> str:
    """The ways of sharing whose step sends ``collective``: ``blocks``, ``off``."""
    return ", ".join(name for name, way in WAYS.items() if collective in way.sends) or "none"


def timed(call: Callable, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            dist.barrier()
            began = time.perf_counter()
            call()
            dist.barrier()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def measure(cfg) -> dict:
    """Every collective's times on this process group (every rank calls it); the same dict on every rank."""
    env, device = distributed.setup(cfg)
    if env.world_size < 2:
        raise UserError("python -m detector link needs 2 processes or more: run it under torchrun")
    rows, columns = head_shape(cfg)
    if rows % env.world_size:
        raise UserError(f"model.hidden={rows} is not a multiple of the {env.world_size} processes")
    dtype = torch.bfloat16 if cfg.autocast and device.type == "cuda" else torch.float32
    found = []
    for name, role, sent, call in collectives(rows, columns, dtype, device):
        times = timed(call, device, cfg.bench.warmup, cfg.bench.repeats)
        found.append({"name": name, "role": role, "bytes": sent, "ms": times})
    return {"processes": env.world_size, "device": device_name(device), "shape": [rows, columns], "collectives": found}


def summary_lines(link: dict) -> list[str]:
    """The link's table for the scaling document: per collective its median [min–max] ms, bytes and rate, and what
    each way of sharing sends a step."""
    rows, medians = [], {c["name"]: statistics.median(c["ms"]) for c in link["collectives"]}
    for c in link["collectives"]:
        median = medians[c["name"]]
        spread = f"{significant(median)} [{significant(min(c['ms']))}–{significant(max(c['ms']))}]"
        rows.append(
            [c["name"], c["role"], spread, significant(c["bytes"] / 1e9), significant(c["bytes"] / median / 1e6)]
        )
    table = markdown_table(["collective", "what the step sends", "ms", "GB per process", "GB/s"], rows, "llrrr")
    rows_, columns = link["shape"]
    sent = "; ".join(step_sends(way, medians) for way in WAYS.values() if way.sends and set(way.sends) <= set(medians))
    return [
        f"The link alone on {link['processes']} processes, the head's {rows_} × {columns} weight, nothing computing "
        f"beside it (median [min–max] of {len(link['collectives'][0]['ms'])}; `python -m detector link`):",
        "",
        table,
        "",
        f'{sent[:1].upper()}{sent[1:]}. The step hides what it can under its compute (docs/training.md, "Where the '
        'time goes").',
    ]


def step_sends(way, medians: dict[str, float]) -> str:
    """``a step of `blocks` sends the reduce and the all-gather, 10.7 ms of the link by themselves``."""
    ms = significant(sum(medians[c] for c in way.sends))
    alone = "itself" if len(way.sends) == 1 else "themselves"
    return f"a step of `{way.name}` sends {' and '.join(f'the {c}' for c in way.sends)}, {ms} ms of the link by {alone}"


def run_link(overrides: list[str], out: Path) -> dict:
    """``measure`` on every rank, rank 0 writing the times to ``out`` and printing their table:
    ``python -m detector link`` (detector/cli/main.py)."""
    cfg = load_config(overrides, announce=None)
    link = measure(cfg)
    if dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        LinkTimes(**link).write(out)
        print("\n".join(summary_lines(link)))
    dist.barrier()
    dist.destroy_process_group()
    return link
