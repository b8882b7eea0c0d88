"""TensorBoard's Traces tab in headless Chromium (tests/browser_helpers.py): several runs' steps on one axis, zoom,
hover and the why panel; the newest run of each strategy ticked and GPU work in its region's colour; a step of thirty
thousand launches still responsive; the ranks of one run on one axis; names and values from a run shown as text (its
lanes of regions and memory: test_traces_lanes.py). Skipped where Debian's ``chromium`` is not installed."""

import gzip
import json
import time

import pytest
from browser_helpers import CHROMIUM, in_traces, keep, serve, wait_for
from lab_helpers import edit_summary, make_run, rank_runs

from detector.lab.measure.analysis import measure_steps, summarise
from detector.lab.measure.trace import load_trace
from detector.lab.record.run import ProfileRecord, write_summary
from detector.lab.record.steps import EXTRACT, Stream, Thread, read_extract, write_extract

POINT_AT = """(doc, win) => {  // the pointer over the middle of the first lane's first drawn event, then %s
  const canvas = doc.getElementById('canvas');
  const box = canvas.getBoundingClientRect();
  const label = [...doc.querySelectorAll('.lane-label')].find((l) => l.textContent === '%s');
  const y = box.top + label.offsetTop + 9;
  const x = box.left + %f * box.width;
  const type = '%s';
  const Event = type === 'wheel' ? win.WheelEvent : win.MouseEvent;
  canvas.dispatchEvent(new Event(type, {clientX: x, clientY: y, bubbles: true, cancelable: true, deltaY: -600}));
  return true;
}"""


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Five profile runs of the recorded H200 step (padded, and four made-up strategies at other speeds)
    served by TensorBoard; their extracts are built on first read, as for any older run."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    logdir = tmp_path_factory.mktemp("traces") / "runs"
    names = [("padded", 1.0), ("synthetic_2x", 0.5), ("synthetic_3x", 0.33), ("synthetic_4x", 0.25), ("slower", 1.5)]
    for i, (strategy, scale) in enumerate(names):
        make_run(logdir / "profile", strategy, f"20261122-03150{i}", scale=scale)
    make_run(logdir / "profile", "padded", "20261121-020000", scale=3.0)  # an older run of padded: not ticked
    url, stop = serve(logdir, [])  # no event files: TensorBoard's own run list stays empty
    yield url
    stop()


def test_the_traces_tab_draws_five_runs_and_explains_what_the_pointer_is_on(traces, browser):
    browser.show(f"{traces}/#traces", ["padded · train · step", "synthetic_2x · train · step", "GPU stream 7"])
    drawn = wait_for(
        browser, "(doc) => doc.body.dataset.readyMs && JSON.parse(doc.getElementById('canvas').dataset.drawn)"
    )
    assert len(drawn) == 5 and all(count > 0 for count in drawn.values())  # every run's lanes have events drawn
    ready = in_traces(browser, "(doc) => Number(doc.body.dataset.readyMs)")
    assert ready <= 2000, f"five seed-scale steps took {ready} ms to show"

    before = in_traces(browser, "(doc) => doc.getElementById('range').textContent")
    in_traces(browser, POINT_AT % ("zoom in", "regions", 0.3, "wheel"))
    after = in_traces(browser, "(doc) => doc.getElementById('range').textContent")
    span = lambda text: float(text.split("–")[1].split()[0]) - float(text.split("–")[0])  # noqa: E731
    assert span(after) < span(before), (before, after)

    in_traces(browser, "(doc) => (doc.getElementById('reset').click(), true)")
    in_traces(browser, POINT_AT % ("hover", "regions", 0.3, "mousemove"))
    tip = wait_for(
        browser,
        "(doc) => doc.getElementById('tooltip').style.display === 'block' && doc.getElementById('tooltip').textContent",
    )
    assert "ms" in tip and any(region in tip for region in ("forward", "calc loss", "backward", "optimizer step"))
    in_traces(browser, POINT_AT % ("click", "regions", 0.3, "click"))
    why = wait_for(browser, "(doc) => doc.getElementById('why').textContent")
    assert "why, in the steps shown" in why and "synthetic_2x" in why and "launches" in why
    keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-five.png"))


def loop_like_trace(images: int = 1024, per_image: int = 28) -> dict:
    """One profiled step shaped like the loop strategy's on a GPU: ~29k kernel launches in calc loss, each
    with its operator and kernel, and the lab's other regions around them."""
    pid, tid, events, corr = 1, 1, [], 0

    def x(cat, name, ts, dur, **args):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": pid if cat != "kernel" else 0,
            "tid": tid,
            "ts": ts,
            "dur": dur,
            "args": args,
        }

    events.append(x("user_annotation", "ProfilerStep#7", 0, 2_000_000))
    events.append(x("user_annotation", "forward", 1_000, 20_000))
    events.append(x("user_annotation", "calc loss", 21_000, images * per_image * 30 + 1_000))
    t = 21_500
    for _ in range(images * per_image):
        corr += 1
        events.append(x("cpu_op", "aten::mul", t, 20))
        events.append(x("cuda_runtime", "cudaLaunchKernel", t + 5, 8, correlation=corr))
        events.append(x("kernel", "elementwise_kernel", t + 40, 3, correlation=corr, stream=7) | {"tid": 7})
        t += 30
    return {"traceEvents": events}


def test_the_traces_tab_stays_responsive_on_a_step_of_thirty_thousand_launches(tmp_path, browser):
    logdir = tmp_path / "runs"
    run = logdir / "profile" / "loop" / "20261122-040000"
    (run / "trace").mkdir(parents=True)
    trace = run / "trace" / "loop.pt.trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps(loop_like_trace()).encode(), compresslevel=1))
    parsed = load_trace(trace)
    steps = measure_steps(parsed)
    record = ProfileRecord("loop", "train", "NVIDIA H200", "2.11", 1024, 256, 256, summarise(parsed, steps), steps)
    record.trace = "trace/" + trace.name
    write_summary(run, record)
    url, stop = serve(logdir, [])
    try:
        browser.show(f"{url}/#traces", ["loop · train · step 7", "GPU stream 7"], timeout=60)
        drawn = wait_for(
            browser, "(doc) => doc.body.dataset.readyMs && JSON.parse(doc.getElementById('canvas').dataset.drawn)"
        )
        events = 3 * 1024 * 28  # operators, launches and kernels
        assert 0 < sum(drawn.values()) < events / 10  # merged at the whole step's zoom
        for _ in range(3):
            in_traces(browser, POINT_AT % ("zoom in", "GPU stream 7", 0.5, "wheel"))
        redraw = in_traces(browser, "(doc) => Number(doc.body.dataset.drawMs)")
        assert redraw < 300, f"a redraw of the loop-like step took {redraw} ms"
    finally:
        stop()


GPU_LANE_COLOURS = """(doc) => {  // the distinct colours along the middle of the first 'GPU stream 7' lane
  const canvas = doc.getElementById('canvas');
  const label = [...doc.querySelectorAll('.lane-label')].find((l) => l.textContent === 'GPU stream 7');
  const ratio = canvas.width / canvas.clientWidth;
  const y = Math.round((label.offsetTop + 9) * ratio);
  const row = canvas.getContext('2d').getImageData(0, y, canvas.width, 1).data;
  const seen = new Set();
  for (let i = 0; i < row.length; i += 4) if (row[i + 3]) seen.add([row[i], row[i + 1], row[i + 2]].join(','));
  return [...seen];
}"""


def test_the_traces_tab_ticks_the_newest_run_of_each_strategy_and_colours_gpu_work_by_region(traces, browser):
    browser.show(f"{traces}/#traces", ["padded · train · step", "GPU stream 7"])
    runs = wait_for(
        browser,
        "(doc) => doc.body.dataset.readyMs && [...doc.querySelectorAll('.run')].map((r) => "
        "[r.querySelector('input').checked, r.querySelector('span').textContent, r.querySelector('span').title])",
    )
    padded = [(checked, label, run) for checked, label, run in runs if label.startswith("padded")]
    assert padded == [
        (True, "padded · train · NVIDIA H200 · 2026-11-22 03:15", "profile/padded/20261122-031500"),
        (False, "padded · train · NVIDIA H200 · 2026-11-22 02:00", "profile/padded/20261121-020000"),
    ]  # the newest first and ticked; the labels tell the two apart
    colours = set(in_traces(browser, GPU_LANE_COLOURS))
    regions = {"forward": (31, 119, 180), "backward": (148, 103, 189), "optimizer step": (44, 160, 44)}
    shaded = lambda rgb: tuple(round(v * 0.7) for v in rgb)  # noqa: E731  events merged at this zoom
    found = {r for r, rgb in regions.items() if {",".join(map(str, rgb)), ",".join(map(str, shaded(rgb)))} & colours}
    assert found == set(regions), colours  # the GPU work of each region in its colour, not one colour for all
    legend = in_traces(browser, "(doc) => doc.getElementById('legend').textContent")
    assert "forward" in legend and "kernel launch" in legend and "memset" not in legend
    keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-regions.png"))


RANGE_END = "(doc) => doc.body.dataset.readyMs && doc.getElementById('range').textContent.split('–')[1]"


def test_the_ranks_of_one_run_are_drawn_on_one_axis_where_each_ran(tmp_path, browser):
    """Two ranks of one `make profile NPROC=2` run, rank 1's steps 5 ms after rank 0's on the host's clock: both are
    ticked at one step, rank 1 drawn 5 ms to the right, the status says how they are placed, and a stream of NCCL
    kernels alone is labelled as the collectives'."""
    logdir = tmp_path / "runs"
    group = rank_runs(logdir, "20261122-031500", [1e9, 1e9 + 5000])
    found = read_extract(group / "rank1" / EXTRACT)  # NCCL's all-reduce on a stream of its own, as on 2 GPUs
    found.names.append("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    for step in found.steps.values():
        step.streams.append(Stream("99", [[50_000, 2_000, 0, len(found.names) - 1, 0]]))
    write_extract(group / "rank1", found)
    url, stop = serve(logdir, [])
    try:
        browser.show(
            f"{url}/#traces",
            ["padded · train · rank 1 · step", "padded · train · rank 0 · step", "GPU stream 99: collectives"],
        )
        both = float(wait_for(browser, RANGE_END).removesuffix(" ms"))
        status = in_traces(browser, "(doc) => doc.getElementById('status').textContent")
        assert "1 rank(s) placed against their run's lowest rank on the host's clock" in status
        labels = in_traces(browser, "(doc) => [...doc.querySelectorAll('.run span')].map((s) => s.textContent)")
        assert [label.split(" · NVIDIA")[0] for label in labels] == [
            "padded · train · rank 0 of 2",
            "padded · train · rank 1 of 2",
        ]
        keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-ranks.png"))
        in_traces(browser, "(doc) => (doc.querySelectorAll('.run input')[1].click(), true)")  # rank 1 unticked
        wait_for(browser, "(doc) => !doc.getElementById('canvas').dataset.drawn.includes('rank1')")
        alone = float(wait_for(browser, RANGE_END).removesuffix(" ms"))
        assert both - alone == pytest.approx(5.0, abs=0.1)  # the same step, 5 ms later
    finally:
        stop()


PAYLOAD = '<img src=x onerror="document.body.dataset.pwned=1">'
STRATEGY = f"<script>alert(1)</script>|x{PAYLOAD}"  # a run's strategy is any text its summary holds

SHOWN_AS_TEXT = """(doc) => ({  // what the run list, the lanes, the tooltip and the why panel hold; whether markup ran
  runs: [...doc.querySelectorAll('.run span')].map((s) => s.textContent),
  lanes: [...doc.querySelectorAll('.lane-label.header')].map((l) => l.textContent),
  tip: doc.getElementById('tooltip').textContent,
  why: doc.getElementById('why').textContent,
  elements: doc.querySelectorAll('img, script:not([type=module]):not([src])').length,
  pwned: doc.body.dataset.pwned || window.top.document.body.dataset.pwned || null,
})"""


def test_the_traces_tab_shows_names_from_a_run_as_text(tmp_path, browser):
    """A strategy's name, a thread's name and an operator's name holding markup are shown as written, and none runs."""
    logdir = tmp_path / "runs"
    run = make_run(logdir / "profile", "padded", "20261122-031500")
    edit_summary(run, lambda summary: summary.update(strategy=STRATEGY))
    found = read_extract(run / EXTRACT)
    found.names.append(PAYLOAD)
    for step in found.steps.values():
        step.threads[1] = Thread(PAYLOAD, [[0, step.dur, len(found.names) - 1]])  # one op: the whole step
    write_extract(run, found)
    url, stop = serve(logdir, [])
    try:
        browser.show(f"{url}/#traces", [f"{STRATEGY} · train · step", f"thread {PAYLOAD}: operators"])
        wait_for(browser, "(doc) => doc.body.dataset.readyMs")
        in_traces(browser, POINT_AT % ("hover", f"thread {PAYLOAD}: operators", 0.1, "mousemove"))
        wait_for(browser, "(doc) => doc.getElementById('tooltip').style.display === 'block'")
        in_traces(browser, POINT_AT % ("click", "regions", 0.3, "click"))
        wait_for(browser, "(doc) => doc.getElementById('why').textContent")
        time.sleep(1)  # an image that failed to load would have run its onerror by now
        seen = in_traces(browser, SHOWN_AS_TEXT)
        assert seen["runs"] == [f"{STRATEGY} · train · NVIDIA H200 · 2026-11-22 03:15"], seen["runs"]
        assert seen["lanes"][0].startswith(f"{STRATEGY} · train · step "), seen["lanes"]
        assert seen["tip"].startswith(PAYLOAD) and f"thread {PAYLOAD}, in " in seen["tip"], seen["tip"]
        assert f"{STRATEGY}step " in seen["why"] and "launches" in seen["why"], seen["why"]
        assert seen["elements"] == 0 and seen["pwned"] is None
        keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-as-text.png"))
    finally:
        stop()
