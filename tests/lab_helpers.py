"""Profile run folders as `make profile` writes them, built from the recorded H200 trace of the padded strategy
(tests/data), for the tests of compare, report, TensorBoard's events and the Traces tab; and a bench losses result of
known costs, for the prediction of `make shapes` and the ranking of train.strategy=auto."""

import gzip
import html
import json
import re
import shutil
from functools import cache
from pathlib import Path

import markdown
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from detector.lab.measure import extract
from detector.lab.measure.analysis import measure_steps, summarise
from detector.lab.measure.cases import sample_counts
from detector.lab.measure.trace import load_trace
from detector.lab.record.noise import Noise
from detector.lab.record.run import ProfileRecord, Timed, write_summary
from detector.lab.record.steps import EXTRACT, read_extract, write_extract

# A profile of a detector of a few thousand parameters on 32 px images: seconds on the CPU.
TINY_PROFILE = [
    "preset=cpu",
    "data.batch_size=4",
    "data.image_size=32",
    "data.num_workers=0",
    "model.channels=[4,8]",
    "model.hidden=16",
    "profile.wait=1",
    "profile.warmup=1",
    "profile.active=2",
]
DATA = Path(__file__).parent / "data"
GPU_TRACE = DATA / "padded_gpu_trace.json.gz"
H100_TRACES = {name: DATA / f"{name}_h100_trace.json.gz" for name in ("padded", "packed")}  # make_fixture.py trimmed
GPU_EVENTS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
QUIET = Noise(cores=16, load_before=0.02, load_during=0.05, load_after=0.01, timed_spread=0.01)
BUSY = Noise(cores=2, load_before=1.9, load_during=1.95, load_after=1.9, timed_spread=0.3)  # two busy loops beside


@cache
def _fixture_json(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode()


def make_run(
    profile_dir: Path,
    strategy: str,
    stamp: str,
    mode: str = "train",
    scale: float = 1.0,
    gpu: bool = True,
    noise: Noise | None = QUIET,
    batch_size: int = 1024,
    timed_spread: float = 0.01,
    recorded: Path = GPU_TRACE,
    device: str = "NVIDIA H200",
) -> Path:
    """``profile_dir/<strategy>[-forward]/<stamp>/`` with trace/, summary.json and extract.json.gz, as `make
    profile` writes them, from a recorded trace (``recorded`` on ``device``; by default the padded strategy's on an
    H200): ``scale`` multiplies every time (0.5: a run twice as fast); ``gpu=False`` drops the GPU events (a CPU-only
    trace); ``noise`` is what the run recorded of the machine's load. Returns the run folder."""
    trace = json.loads(_fixture_json(recorded))
    if scale != 1.0:
        for e in trace["traceEvents"]:
            if e.get("ph") == "X":
                e["ts"], e["dur"] = e["ts"] * scale, e["dur"] * scale
    if not gpu:
        trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in GPU_EVENTS]
    run = profile_dir / (strategy if mode == "train" else f"{strategy}-forward") / stamp
    timed = [100.0 * scale * (1 + timed_spread * i / 2) for i in range(5)]  # steps timed without the profiler
    (run / "trace").mkdir(parents=True)
    path = run / "trace" / f"{strategy}.1795312409264487939.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode(), compresslevel=1))
    parsed = load_trace(path)
    steps = measure_steps(parsed)
    record = ProfileRecord(
        strategy=strategy,
        mode=mode,
        device=device if gpu else "cpu",
        torch="2.11.0+cu130",
        batch_size=batch_size,
        image_size=256,
        max_boxes=256,
        analysis=summarise(parsed, steps),
        per_step=steps,
        timed=Timed.of(timed),
        noise=noise,
        preset="seed_scale",
        run=stamp,
        created=f"2026-11-22T{stamp[-6:-4]}:{stamp[-4:-2]}:{stamp[-2:]}",
        trace=f"trace/{path.name}",
        config={"profile": {"strategy": strategy, "mode": mode}},
        folder=run,
    )
    write_summary(run, record)
    write_extract(run, extract.build(parsed, steps, extract.about(record)))
    return run


def edit_summary(run: Path, change) -> None:
    """Rewrite a run's summary.json with ``change(summary_dict)`` applied."""
    summary = json.loads((run / "summary.json").read_text())
    change(summary)
    (run / "summary.json").write_text(json.dumps(summary))


def read_events(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def rank_runs(root: Path, stamp: str, starts: list[float]) -> Path:
    """``root/profile/padded/<stamp>/rank<r>/`` as make profile NPROC=2 writes them, rank r's steps starting at
    ``starts[r]`` µs on the host's clock (their first step; the later ones as in the recorded trace)."""
    group = root / "profile" / "padded" / stamp
    for rank, start in enumerate(starts):
        made = make_run(root / "made", "padded", f"{stamp[:-2]}{rank:02d}")
        edit_summary(made, lambda s, rank=rank: s.update(run=f"rank{rank}"))
        found = read_extract(made / EXTRACT)
        first = min(step.start for step in found.steps.values())
        for step in found.steps.values():
            step.start += start - first
        write_extract(made, found)
        group.mkdir(parents=True, exist_ok=True)
        made.rename(group / f"rank{rank}")
    shutil.rmtree(root / "made")
    return group


# A name from a file (a strategy's, a run's, a device's: a summary holds any text) with a tag, a pipe and an escaped
# pipe: every markdown document the lab writes shows it as written, no tag and no cell of its own.
MARKUP_NAME = "<script>alert(1)</script>|x\\|y"
SHOWN = html.escape(MARKUP_NAME, quote=False)  # the name as rendered HTML shows it: as text


def rendered(text: str) -> str:
    """The HTML that markdown makes of ``text`` as GitHub and TensorBoard's Text tab read it (tables, fenced code),
    before any sanitiser: what a name would do to the page if it were not escaped."""
    return markdown.markdown(text, extensions=["tables", "fenced_code"])


def tables_whole(page: str) -> bool:
    """Whether every row of each table in the HTML ``page`` has as many cells as its header."""
    for table in re.findall(r"<table>.*?</table>", page, flags=re.DOTALL):
        head, _, body = table.partition("</thead>")
        rows = re.findall(r"<tr>(.*?)</tr>", body, flags=re.DOTALL)
        if any(len(re.findall(r"<td[ >]", row)) != len(re.findall(r"<th[ >]", head)) for row in rows):
            return False
    return True


# ----------------------------------------------------------------------------- bench losses' result file

# Known costs (ms): padded pays for every slot and nothing a box; packed a little a slot and much a box.
PER_SLOT = {"padded": 1e-3, "packed": 1e-4}
PER_BOX = {"padded": 0.0, "packed": 2e-3}


def bench_file(folder, device="cpu", slots=32, batch=16, record_slots=False):
    """A bench losses result, as `make bench` writes it, whose times follow PER_SLOT and PER_BOX exactly."""
    results = []
    for name in PER_SLOT:
        for distribution in ("seed", "tail"):
            boxes = int(sample_counts(distribution, batch, slots, torch.Generator().manual_seed(batch)).sum())
            ms = PER_SLOT[name] * batch * slots + PER_BOX[name] * boxes
            spread = {"median": ms, "low": ms, "high": ms, "n": 5}
            results.append(
                {"strategy": name, "layout": "x", "batch_size": batch, "distribution": distribution}
                | {"valid_boxes": boxes, "forward_ms": spread, "forward_backward_ms": spread}
            )
    payload = {"device": device, "torch": "2.13.0", "target": "losses", "config": {}, "results": results}
    payload |= {"max_boxes": slots} if record_slots else {}
    (folder / "bench").mkdir(exist_ok=True)
    (folder / "bench" / "losses.json").write_text(json.dumps(payload))
    return folder / "bench" / "losses.json"
