"""``bench startup`` (``make bench TARGET=startup``): what `train` pays before its work, against torch's floor.

Each measure is a fresh process, as a user's command is, with the machine's caches warm (one `train` of the same
configuration runs first, unmeasured: it fills the page cache and the compile cache):

- ``--help``: the command line's grammar alone (it imports no torch);
- ``import torch``: the interpreter and torch, nothing else;
- **the floor** (detector/bench/startup_floor.py): the least a process needs to run one training step of this
  configuration: torch, the step's code (the model, the loss, the optimizer), the step built on the device, the
  compile cache that `train` keeps loaded, and one step on a batch already on the device, waited for;
- **train**: ``python -m detector train`` of the configuration for 2 steps (no evaluation, no checkpoint), its
  start-up's parts and first step as its summary.json records them (detector/train/observe/wallclock.py).

``bench.repeats`` rounds at most 5 (each a floor and a train); medians [min–max]. Train's overhead is its start-up and
first step less the floor's: what the command adds to what torch itself needs (the configuration's checks, the
loader's workers, the run folder, TensorBoard's writer, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from detector import bench
from detector.bench.startup_floor import PARTS as FLOOR_PARTS
from detector.config.device import resolve_device
from detector.errors import UserError
from detector.lab.present.tables import markdown_table, significant
from detector.lab.record.provenance import run_header
from detector.lab.record.spread import Spread

ROUNDS = 5  # at most: each round is a train and a floor process, tens of seconds on a GPU
SHOWN_S = 0.01  # train's start-up parts shorter than this are named in one row
SECTIONS = ("data", "model", "train")  # train's own sections, and the top-level keys, passed on to its process


def run_bench(cfg: DictConfig) -> dict:
    device = resolve_device(cfg)
    rounds = min(ROUNDS, cfg.bench.repeats)
    print(f"bench startup: {run_header(device)}; {rounds} round(s), each command a fresh process")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as work:
        work = Path(work)
        config = work / "config.yaml"
        train_cfg = OmegaConf.merge(
            cfg,
            {
                "train": {
                    "steps": 2,
                    "checkpoint_every": 0,
                    "eval_every": 10**9,
                    "resume": "false",
                    "out_dir": str(work / "train"),
                    "log_every": 1,
                }
            },
        )
        OmegaConf.save(train_cfg, config)
        print("  warming the caches: one train, unmeasured ...", flush=True)
        train_once(train_cfg, work)
        helps, imports, floors, trains = [], [], [], []
        for r in range(rounds):
            print(f"  round {r + 1} of {rounds} ...", flush=True)
            helps.append(timed([sys.executable, "-m", "detector", "--help"]))
            imports.append(timed([sys.executable, "-c", "import torch"]))
            floors.append(floor_once(config))
            trains.append(train_once(train_cfg, work))
    results = {
        "help_s": Spread.of(helps).__dict__,
        "import_torch_s": Spread.of(imports).__dict__,
        "floor": {part: Spread.of([f[part] for f in floors]).__dict__ for part in [*FLOOR_PARTS, "total"]},
        "train": {
            part: Spread.of([t.get(part) for t in trains]).__dict__
            for part in dict.fromkeys(part for t in trains for part in t)
        },
    }
    bench.save(cfg, "startup", device, results, tables(results, run_header(device)))
    return results


def timed(command: list[str]) -> float:
    """Seconds of ``command``'s process, from its start to its end."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"bench startup: {' '.join(command[:4])} failed: {done.stderr.strip()[-300:]}")
    return time.perf_counter() - start


def train_once(cfg: DictConfig, work: Path) -> dict[str, float]:
    """One `train` of ``cfg`` in a process of its own: its start-up's parts, its first step and their total (s)."""
    tree = OmegaConf.to_container(cfg, resolve=True)
    tree = {key: value for key, value in tree.items() if key in SECTIONS or not isinstance(value, dict)}
    overrides = [f"{key}={json.dumps(value)}" for key, value in flat(tree)]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "detector", "train", *overrides],
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
    )
    wall = time.perf_counter() - start
    if done.returncode:
        raise UserError(f"bench startup: its train failed: {done.stderr.strip()[-400:]}")
    from detector.train.observe.summary import read

    run = next(Path(cfg.train.out_dir).rglob("summary.json")).parent
    clock = read(run).wall_clock
    shutil.rmtree(run)  # the next round's run starts afresh; the compile cache beside it stays
    parts = dict(clock.startup)
    parts["first step"] = clock.seconds["first step"]
    parts["total"] = clock.seconds["start-up"] + clock.seconds["first step"]
    parts["process"] = wall
    return parts


def flat(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``tree``'s leaves as (dotted key, value), the key=value a command line takes."""
    leaves = []
    for key, value in tree.items():
        if isinstance(value, dict):
            leaves += flat(value, f"{prefix}{key}.")
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves


def floor_once(config: Path) -> dict[str, float]:
    """One floor process (detector/bench/startup_floor.py) of the configuration in ``config``: its parts' seconds."""
    done = subprocess.run(
        [sys.executable, "-m", "detector.bench.startup_floor", str(config)],
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
    )
    if done.returncode:
        raise UserError(f"bench startup: its floor process failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tables(results: dict, header: str) -> str:
    def cell(spread: dict) -> str:
        if not spread or spread["median"] is None:
            return "—"
        return f"{significant(spread['median'])} [{significant(spread['min'])}–{significant(spread['max'])}]"

    floor_rows = [[part, cell(results["floor"][part])] for part in FLOOR_PARTS]
    train = results["train"]
    shown = {part: spread for part, spread in train.items() if part not in ("total", "process")}
    train_rows = [[part, cell(spread)] for part, spread in shown.items() if spread["median"] >= SHOWN_S]
    rest = [part for part, spread in shown.items() if spread["median"] < SHOWN_S]
    if rest:
        train_rows.append([f"under {SHOWN_S} s each: {', '.join(rest)}", "—"])
    total_floor, total_train = results["floor"]["total"]["median"], train["total"]["median"]
    lines = [
        f"## What `train` pays before its work, against torch's floor ({header})",
        "",
        "Seconds, median [min–max] over the rounds; each a fresh process, the caches warm.",
        "",
        markdown_table(
            ["command", "seconds"],
            [
                ["`python -m detector --help`", cell(results["help_s"])],
                ["`python -c 'import torch'`", cell(results["import_torch_s"])],
                ["**the floor**: one step of this configuration, torch alone", cell(results["floor"]["total"])],
                ["**`train`**: start-up and first step", cell(train["total"])],
                ["`train`'s process, start to end (2 steps, no checkpoint)", cell(train["process"])],
            ],
        ),
        "",
        f"`train` adds **{significant(total_train - total_floor)} s** to the floor's {significant(total_floor)} s.",
        "",
        "### The floor's parts",
        "",
        markdown_table(["part", "seconds"], floor_rows),
        "",
        "### `train`'s start-up (its summary.json), then its first step",
        "",
        markdown_table(["part", "seconds"], train_rows),
    ]
    return "\n".join(lines)
