"""2 GPUs: plain DDP, ShardedBlocks and FSDP2 side by side, and the scaling from 1 GPU to 2, from the
``summary.json`` of `make train` runs (docs/training.md, "Measuring the sharding on 2 GPUs", runs them):

    python -m detector.bench.sharding runs/sharding    # runs/sharding/{1gpu,off,blocks,fsdp2}/<experiment>/<run>/

prints one row per run (processes, median step, images/s, peak GPU memory of rank 0, images/s against
1 GPU's per process, the largest relative difference of its per-step losses from the plain DDP run's) and
the choice the issue set: FSDP2 stays unless ShardedBlocks's median step is more than 3 % shorter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detector.lab.tables import markdown_table

RUNS = ("1gpu", "off", "blocks", "fsdp2")  # the folders the documented sequence writes, in table order
KEEP_FSDP2_UNLESS = 1.03  # ShardedBlocks must be more than 3 % faster to be kept in FSDP2's place


def read_summaries(folder: Path) -> dict[str, dict]:
    """The newest summary.json under each of ``folder``'s RUNS subfolders that has one."""
    found = {}
    for name in RUNS:
        paths = sorted((folder / name).rglob("summary.json"), key=lambda p: p.stat().st_mtime)
        if paths:
            found[name] = json.loads(paths[-1].read_text())
    return found


def loss_gap(run: dict, base: dict) -> float | None:
    """The largest relative difference of ``run``'s losses from ``base``'s: step by step, or by log window
    where a summary has no per-step losses (one written before they were kept); None if they do not pair."""
    if "losses" in run and "losses" in base:
        ours, theirs = run["losses"], base["losses"]
    else:
        ours, theirs = ([loss for _, loss in s["history"]] for s in (run, base))
    if not ours or len(ours) != len(theirs):
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


def table(summaries: dict[str, dict]) -> str:
    base = summaries.get("off")
    one = summaries.get("1gpu")
    rows = []
    for name, s in summaries.items():
        scaling = s["images_per_s"] / (s["world_size"] * one["images_per_s"]) if one else None
        diff = loss_gap(s, base) if base and name != "1gpu" else None
        rows.append(
            [
                name,
                s["world_size"],
                f"{s['step_ms']:.1f}",
                f"{s['images_per_s']:.0f}",
                "-" if s["peak_memory_gib"] is None else f"{s['peak_memory_gib']:.1f}",
                "-" if scaling is None else f"{scaling:.1%}",
                "-" if diff is None else f"{diff:.1e}",
            ]
        )
    headers = ["run", "processes", "step ms", "images/s", "peak GiB", "per process vs 1 GPU", "loss vs DDP"]
    return markdown_table(headers, rows)


def verdict(summaries: dict[str, dict]) -> str:
    if "blocks" not in summaries or "fsdp2" not in summaries:
        return "no verdict: the blocks and fsdp2 runs are both needed"
    blocks, fsdp2 = summaries["blocks"]["step_ms"], summaries["fsdp2"]["step_ms"]
    if fsdp2 > blocks * KEEP_FSDP2_UNLESS:
        return f"ShardedBlocks is {fsdp2 / blocks - 1:.1%} faster than FSDP2 (> 3 %): keep ShardedBlocks as the default"
    return f"ShardedBlocks is {fsdp2 / blocks - 1:+.1%} against FSDP2 (not > 3 % faster): FSDP2 becomes the default"


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else "runs/sharding")
    summaries = read_summaries(folder)
    if not summaries:
        print(f"error: no summary.json under {folder}/{{{','.join(RUNS)}}}", file=sys.stderr)
        return 2
    print(table(summaries))
    print(verdict(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
