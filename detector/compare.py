"""`make compare`: one table and one bar chart of every profile run's summary.json.

Speed-ups are relative to the ``padded`` strategy of the same mode (x > 1: faster than padded).
"""

from __future__ import annotations

import json
from pathlib import Path

BASELINE = "padded"


def load_summaries(profile_dir: str | Path) -> list[dict]:
    paths = sorted(Path(profile_dir).glob("*/summary.json"))
    if not paths:
        raise FileNotFoundError(f"no {profile_dir}/*/summary.json: run `make profile STRATEGY=<name>` first")
    return [json.loads(p.read_text()) for p in paths]


def format_table(summaries: list[dict]) -> str:
    """A markdown table per mode: regions (rows) x strategies (columns), ms per step and speed-up."""
    lines = []
    for mode in sorted({s["mode"] for s in summaries}, key=lambda m: m != "train"):
        runs = [s for s in summaries if s["mode"] == mode]
        baseline = next((s for s in runs if s["strategy"] == BASELINE), None)
        devices = sorted({f"{s['device']}, torch {s['torch']}, batch {s['batch_size']}" for s in runs})
        lines += [f"\nmode={mode} — ms per step (speed-up vs {BASELINE}) — {'; '.join(devices)}", ""]
        lines.append("| region | " + " | ".join(s["strategy"] for s in runs) + " |")
        lines.append("|---" * (len(runs) + 1) + "|")
        regions = list(runs[0]["regions_ms"]) + ["step"]
        for region in regions:
            cells = []
            for s in runs:
                ms = s["step_ms"] if region == "step" else s["regions_ms"].get(region)
                base = None
                if baseline:
                    base = baseline["step_ms"] if region == "step" else baseline["regions_ms"].get(region)
                cell = "—" if ms is None else f"{ms:.3f}"
                if ms and base:
                    cell += f" ({base / ms:.2f}x)"
                cells.append(cell)
            lines.append(f"| {region} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summaries: list[dict], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    modes = sorted({s["mode"] for s in summaries}, key=lambda m: m != "train")
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        runs = [s for s in summaries if s["mode"] == mode]
        regions = list(runs[0]["regions_ms"])
        width = 0.8 / len(runs)
        for i, s in enumerate(runs):
            xs = [r + i * width for r in range(len(regions))]
            ax.bar(xs, [s["regions_ms"].get(r, 0) for r in regions], width, label=s["strategy"])
        ax.set_xticks([r + 0.4 - width / 2 for r in range(len(regions))], regions)
        ax.set_yscale("log")  # strategies differ by orders of magnitude
        ax.set_ylabel("ms per step (log scale)")
        ax.set_title(f"mode={mode} — {runs[0]['device']}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_compare(profile_dir: str | Path = "runs/profile", png: str | Path | None = None) -> str:
    summaries = load_summaries(profile_dir)
    table = format_table(summaries)
    print(table)
    path = plot(summaries, png or Path(profile_dir) / "compare.png")
    print(f"\nbar chart: {path}")
    return table
