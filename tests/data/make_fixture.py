"""Regenerate ``padded_gpu_trace.json.gz``: the recorded H200 trace of the padded strategy, trimmed.

It keeps the first three ProfilerSteps of /work/shared/traces/padded_seed_scale_h200.pt.trace.json.gz
(see that folder's README: MODE=train, seed scale, torch 2.11 on an NVIDIA H200) and, inside their time
window, only what the lab's analysis and timelines read (detector/lab/measure/): user annotations, operators, CUDA
runtime and driver calls, kernels, GPU memcpy and memset, and the thread names. Arguments are cut to
correlation, bytes and stream. The third step (#12) has a 150 ms "data wait" (the DataLoader workers fell
behind), so the steps are not all alike.

    python tests/data/make_fixture.py [SOURCE] [DEST]
"""

import gzip
import json
import sys
from pathlib import Path

SOURCE = "/work/shared/traces/padded_seed_scale_h200.pt.trace.json.gz"
DEST = Path(__file__).with_name("padded_gpu_trace.json.gz")
STEPS = 3
CATEGORIES = {"user_annotation", "cpu_op", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset"}
ARGS = ("correlation", "bytes", "stream")
GPU = {"kernel", "gpu_memcpy", "gpu_memset"}


def trim(trace: dict, steps: int = STEPS) -> dict:
    events = trace["traceEvents"]
    marks = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )[:steps]
    start, end = marks[0]["ts"], marks[-1]["ts"] + marks[-1]["dur"]
    kept = [e for e in events if e.get("ph") == "M" and e["name"] == "thread_name"]
    inside = [e for e in events if e.get("ph") == "X" and e.get("cat") in CATEGORIES and start <= e["ts"] < end]
    # the host runs ahead: the GPU work its calls launched may run after the window, and is kept too
    launched = {e["args"].get("correlation") for e in inside if e["cat"] in ("cuda_runtime", "cuda_driver")}
    later = [e for e in events if e.get("cat") in GPU and e["ts"] >= end and e["args"].get("correlation") in launched]
    for e in inside + later:
        args = {k: e["args"][k] for k in ARGS if k in e.get("args", {})}
        kept.append({k: e[k] for k in ("ph", "cat", "name", "pid", "tid", "ts", "dur")} | {"args": args})
    return {
        "schemaVersion": trace.get("schemaVersion"),
        "displayTimeUnit": "ms",
        "traceName": f"{Path(SOURCE).name}, first {steps} ProfilerSteps, trimmed by tests/data/make_fixture.py",
        "traceEvents": kept,
    }


def main(source: str = SOURCE, dest: Path = DEST) -> None:
    with gzip.open(source, "rt") as f:
        trimmed = trim(json.load(f))
    with gzip.GzipFile(dest, "wb", mtime=0) as f:  # mtime=0: the same input gives the same bytes
        f.write(json.dumps(trimmed, separators=(",", ":")).encode())
    print(f"{dest}: {len(trimmed['traceEvents'])} events, {Path(dest).stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main(*sys.argv[1:3])
