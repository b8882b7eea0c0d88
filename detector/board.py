"""`make tensorboard`: TensorBoard on runs/ with the PyTorch Profiler plugin, patched for new traces.

torch-tb-profiler 0.4.3 maps trace event categories to types by name and knows only the old
``runtime`` category; PyTorch >= 2.x writes ``cuda_runtime`` and ``cuda_driver``. Unmapped, those
launches are dropped and every operator of a GPU trace shows 0 device time. We add the two names to
the plugin's map before TensorBoard starts, and make the plugin's loader processes fork (instead of
spawn, its default) so that they inherit the patched map.
"""

from __future__ import annotations

import os
import sys


def patch_profiler_plugin() -> None:
    os.environ.setdefault("TORCH_PROFILER_START_METHOD", "fork")
    from torch_tb_profiler.profiler import trace

    for category in ("cuda_runtime", "cuda_driver"):
        trace.EventTypeMap.setdefault(category, trace.EventTypes.RUNTIME)


def main(logdir: str = "runs", port: int = 6006, extra: list[str] | None = None) -> None:
    patch_profiler_plugin()
    from tensorboard.main import run_main

    sys.argv = ["tensorboard", "--logdir", logdir, "--port", str(port), "--bind_all", *(extra or [])]
    print(f"TensorBoard on http://localhost:{port}/  (PyTorch Profiler tab: #pytorch_profiler)", flush=True)
    run_main()


def write_profile_events(run_dir, summary: dict, events=None) -> None:
    """TensorBoard scalars of a profile run: wall ms per region per step (placeholder until the viewing branch)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run_dir)) as writer:
        for i, step in enumerate(summary["per_step"]):
            for region, measures in step["regions"].items():
                writer.add_scalar(f"region_ms/{region}", measures["wall_ms"], i)
