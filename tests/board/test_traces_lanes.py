"""TensorBoard's Traces tab in headless Chromium (tests/browser_helpers.py), its lanes of regions and memory: each
run's memory in a lane of its own, on one scale, coloured by region, the operator that allocated named; GPU runs'
memory lanes with their scale whole; a clicked region highlighted; one precision along the axis; two recorded
strategies on one axis; a CPU run's wide region in its colour. Skipped where Debian's ``chromium`` is not installed."""

import itertools
import time

import pytest
from browser_helpers import CHROMIUM, in_traces, keep, serve, wait_for
from conftest import REAL_SAMPLE_SECONDS
from lab_helpers import H100_TRACES, TINY_PROFILE, make_run

from detector.config.schema import load_config
from detector.lab.measure import cpu_load
from detector.lab.profile import run_profile
from detector.lab.record.measures import memory_text
from detector.lab.record.run import read_summary, representative_step
from detector.lab.record.steps import EXTRACT, StepMemory, read_extract, write_extract

SHOWN_TIP = (
    "(doc) => doc.getElementById('tooltip').style.display === 'block' && doc.getElementById('tooltip').textContent"
)

MEMORY_LANES = """(doc) => {  // per memory lane: its label's parts and the colours along its foot (bars rise from it)
  const canvas = doc.getElementById('canvas');
  const ratio = canvas.width / canvas.clientWidth;
  return [...doc.querySelectorAll('.lane-label.memory')].map((label) => {
    const y = Math.round((label.offsetTop + label.offsetHeight - 4) * ratio);
    const row = canvas.getContext('2d').getImageData(0, y, canvas.width, 1).data;
    const seen = new Set();
    for (let i = 0; i < row.length; i += 4) if (row[i + 3]) seen.add([row[i], row[i + 1], row[i + 2]].join(','));
    return [[...label.children].map((part) => part.textContent), [...seen]];
  });
}"""

POINT_AT_MEMORY = """(doc, win) => {  // the pointer %s at %f of the canvas's width, near the foot of memory lane %d
  const canvas = doc.getElementById('canvas');
  const box = canvas.getBoundingClientRect();
  const label = doc.querySelectorAll('.lane-label.memory')[%d];
  const type = '%s';
  const Event = type === 'wheel' ? win.WheelEvent : win.MouseEvent;
  const at = {clientX: box.left + %f * box.width, clientY: box.top + label.offsetTop + label.offsetHeight - 4};
  canvas.dispatchEvent(new Event(type, {...at, bubbles: true, cancelable: true, deltaY: -900}));
  return true;
}"""


def test_the_traces_tab_draws_each_runs_memory_on_one_scale_coloured_by_region(tmp_path, browser, monkeypatch):
    """Real CPU profiles of padded and loop: a memory lane each, both on the one scale the labels state, their bars in
    their regions' colours; hovering one names the operator and the bytes."""
    # the load sampled for as long as a user's run samples it: with the suite's 0.05 s the hover below often found no
    # bar in the loop's memory lane; with the full samples it finds one every time
    monkeypatch.setattr(cpu_load, "SAMPLE_SECONDS", REAL_SAMPLE_SECONDS)
    logdir = tmp_path / "runs"
    for strategy in ("padded", "loop"):
        run_profile(
            load_config(TINY_PROFILE + [f"profile.strategy={strategy}", f"profile.out_dir={logdir / 'profile'}"])
        )
    url, stop = serve(logdir, [])
    try:
        browser.show(f"{url}/#traces", ["padded · train · step", "loop · train · step", "memory on cpu: allocated"])
        wait_for(browser, "(doc) => doc.body.dataset.readyMs")
        lanes = in_traces(browser, MEMORY_LANES)
        assert len(lanes) == 2 and lanes[0][0] == lanes[1][0], lanes  # one scale: the same label's range
        name, top, foot = lanes[0][0]
        assert name == "memory on cpu: allocated" and top != foot, lanes[0][0]
        regions = {"forward": "31,119,180", "backward": "148,103,189"}
        for label, colours in lanes:
            assert all(rgb in colours for rgb in regions.values()), (label, colours)
        legend = in_traces(browser, "(doc) => doc.getElementById('legend').textContent")
        assert "calc loss" in legend
        # into the loop's step, where it allocates image by image: zoomed at its bars (the axis is the longer step's,
        # and a loaded machine can make either run's step the longer)
        for _ in range(2):
            xs = in_traces(browser, BARS_AT % (1, 1))
            assert xs, "no bar along the foot of the loop's memory lane"
            at = xs[len(xs) // 2]
            in_traces(browser, POINT_AT_MEMORY % ("zooms", at, 1, 1, "wheel", at))
        # hover where the loop's lane has bars along its foot, as drawn: its bars are image by image, with gaps
        # between them that a pointer at a fixed place can fall into
        xs = in_traces(browser, BARS_AT % (1, 1))
        assert xs, "no bar along the foot of the loop's memory lane after the zoom"
        tip = None
        for x in sorted(xs, key=lambda x: abs(x - at))[:12]:
            in_traces(browser, POINT_AT_MEMORY % ("hovers", x, 1, 1, "mousemove", x))
            shown_by = time.monotonic() + 2.0  # a browser that shares its cores with the suite draws the tip late
            while not (tip := in_traces(browser, SHOWN_TIP)) and time.monotonic() < shown_by:
                time.sleep(0.1)
            if tip:
                break
        if not tip:
            keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-memory-no-tip.png"))
        assert tip and "allocated" in tip and ("aten::" in tip or "Backward" in tip or "no operator" in tip), tip
        keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-memory.png"))
    finally:
        stop()


# ----------------------------------------------------------------------------- two GPU runs with memory


def with_gpu_memory(run) -> tuple[int, int]:
    """The allocator's events in every step of ``run``'s extract, shaped as a GPU profile records them: 13.5 GiB held
    from before the step, four 256 MiB allocations by aten::empty_strided in forward, each freed outside any operator
    early in backward (autograd releasing what it saved). Returns the lowest and highest bytes allocated."""
    found = read_extract(run / EXTRACT)
    found.names.append("aten::empty_strided")
    op, start, chunk = len(found.names) - 1, 27 * 2**29, 2**28
    for step in found.steps.values():
        regions = {name: (s, d) for name, s, d in step.regions}
        (fs, fd), (bs, bd) = regions["forward"], regions["backward"]
        rows = [[round(fs + fd * (i + 1) / 5), start + chunk * (i + 1), chunk, op] for i in range(4)]
        rows += [[round(bs + bd * (i + 1) / 10), start + chunk * (3 - i), -chunk, -1] for i in range(4)]
        step.memory = StepMemory("cuda:0", start, len(rows), rows)
    write_extract(run, found)
    return start, start + 4 * chunk


@pytest.fixture(scope="module")
def gpu_memory(tmp_path_factory):
    """(url, lowest, highest): two GPU runs of the recorded H200 step (padded, and a made-up strategy twice as fast),
    each with memory (``with_gpu_memory``), served by TensorBoard."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    logdir = tmp_path_factory.mktemp("gpu-memory") / "runs"
    for i, (strategy, scale) in enumerate((("padded", 1.0), ("synthetic_2x", 0.5))):
        low, high = with_gpu_memory(make_run(logdir / "profile", strategy, f"20261122-03150{i}", scale=scale))
    url, stop = serve(logdir, [])
    yield url, low, high
    stop()


BARS_AT = """(doc) => {  // the middles of the runs of coloured pixels (bars in their regions' colours, not the grey
  // grid lines) along the foot of memory lane %d, as fractions of the canvas's width (the row MEMORY_LANES reads, the
  // height POINT_AT_MEMORY points at)
  const canvas = doc.getElementById('canvas');
  const ratio = canvas.width / canvas.clientWidth;
  const label = doc.querySelectorAll('.lane-label.memory')[%d];
  const y = Math.round((label.offsetTop + label.offsetHeight - 4) * ratio);
  const row = canvas.getContext('2d').getImageData(0, y, canvas.width, 1).data;
  const out = [];
  let start = -1;
  for (let x = 0; x <= canvas.width; x++) {
    const [r, g, b, a] = x < canvas.width ? row.slice(4 * x, 4 * x + 4) : [0, 0, 0, 0];
    const drawn = a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 30;
    if (drawn && start < 0) start = x;
    if (!drawn && start >= 0) { if (x - start >= 2) out.push((start + x - 1) / 2 / canvas.width); start = -1; }
  }
  return out;
}"""

SPAN = """(doc) => {  // [x0, x1] px of the canvas where lane '%s' of run %d has colour %s along its middle row, or null
  const canvas = doc.getElementById('canvas');
  const label = [...doc.querySelectorAll('.lane-label')].filter((l) => l.textContent === '%s')[%d];
  const ratio = canvas.width / canvas.clientWidth;
  const row = canvas.getContext('2d').getImageData(0, Math.round((label.offsetTop + 9) * ratio), canvas.width, 1).data;
  const xs = [];
  for (let i = 0; i < row.length; i += 4) if ([row[i], row[i + 1], row[i + 2]].join(',') === '%s') xs.push(i / 4);
  return xs.length ? [Math.min(...xs) / ratio, Math.max(...xs) / ratio] : null;
}"""

POINTER = """(doc, win) => {  // a %s event at (%f, %f) px of the canvas
  const canvas = doc.getElementById('canvas');
  const box = canvas.getBoundingClientRect();
  const type = '%s';
  const Event = type === 'wheel' ? win.WheelEvent : win.MouseEvent;
  const at = {clientX: box.left + %f, clientY: box.top + %f, bubbles: true, cancelable: true, deltaY: -300};
  canvas.dispatchEvent(new Event(type, at));
  return true;
}"""

LANE_TOP = "(doc) => [...doc.querySelectorAll('.lane-label')].filter((l) => l.textContent === '%s')[%d].offsetTop"

EDGES = """(doc) => {  // per regions lane: how many pixels of its top rows have the picked region's outline colour
  const canvas = doc.getElementById('canvas');
  const ratio = canvas.width / canvas.clientWidth;
  return [...doc.querySelectorAll('.lane-label.regions')].map((label) => {
    const y = Math.round((label.offsetTop + 1) * ratio);
    const row = canvas.getContext('2d').getImageData(0, y, canvas.width, 1).data;
    let n = 0;
    for (let i = 0; i < row.length; i += 4) if (row[i] === 33 && row[i + 1] === 33 && row[i + 2] === 33) n++;
    return n;
  });
}"""

WHOLE = """(doc) => {  // the lane labels whose text is cut (clipped, or a memory lane's name over its scale, or its
  // scale reaching out of the lane)
  const clipped = (el) => getComputedStyle(el).overflow !== 'visible' &&
    (el.scrollWidth > el.clientWidth || el.scrollHeight > el.clientHeight);
  const over = (a, b) => a.right > b.left && b.right > a.left && a.bottom > b.top && b.bottom > a.top;
  const crossed = (label) => [...label.querySelectorAll('.scale')].some(
    (scale) => over(label.querySelector('.name').getBoundingClientRect(), scale.getBoundingClientRect()));
  // a memory lane's scale outside its lane: the foot's label on the line between two runs
  const outside = (label) => [...label.querySelectorAll('.scale')].some((scale) => {
    const [lane, box] = [label.getBoundingClientRect(), scale.getBoundingClientRect()];
    return box.top < lane.top || box.bottom > lane.bottom;
  });
  const cut = [...doc.querySelectorAll('.lane-label, .lane-label *')].filter(clipped);
  const memory = [...doc.querySelectorAll('.lane-label.memory')];
  return cut.concat(memory.filter(crossed), memory.filter(outside)).map((el) => el.textContent);
}"""

BACKWARD, FORWARD, CALC_LOSS = "148,103,189", "31,119,180", "255,127,14"


def pointer(browser, kind: str, x: float, y: float) -> None:
    in_traces(browser, POINTER % (kind, x, y, kind, x, y))


def test_the_memory_lanes_of_gpu_runs_show_their_scale_whole_and_say_what_allocated(gpu_memory, browser):
    """The memory lanes' labels are not cut and show the shared scale's two ends; hovering late in backward, where
    frees set the level, says the bytes allocated at the pointer and the operator that allocated last."""
    url, low, high = gpu_memory
    browser.show(f"{url}/#traces", ["padded · train · step", "synthetic_2x · train · step", "memory on cuda:0"])
    wait_for(browser, "(doc) => doc.body.dataset.readyMs")
    assert in_traces(browser, WHOLE) == []
    scales = in_traces(browser, "(doc) => [...doc.querySelectorAll('.lane-label.memory')].map((l) => l.textContent)")
    assert scales == [f"memory on cuda:0: allocated{memory_text(high)}{memory_text(low)}"] * 2  # its top, its foot
    x0, x1 = in_traces(browser, SPAN % ("regions", 0, BACKWARD, "regions", 0, BACKWARD))
    y = in_traces(browser, "(doc) => doc.querySelector('.lane-label.memory').offsetTop") + 22
    pointer(browser, "mousemove", x0 + 0.75 * (x1 - x0), y)  # after backward's frees: 13.5 GiB again
    tip = wait_for(browser, SHOWN_TIP).replace("\xa0", " ")  # a number and its unit are kept on one line
    assert tip.startswith(f"{memory_text(low)} allocated at ") and ", in backward" in tip, tip
    assert "a free of 256 MiB outside any operator" in tip and "allocated last by aten::empty_strided: 256 MiB" in tip


def test_a_clicked_region_is_highlighted_and_keeps_its_why_numbers(gpu_memory, browser):
    """Clicking forward outlines it in both runs and shows its why numbers; they stay through a zoom, and a pan that
    ends over another region does not pick it."""
    url, _, _ = gpu_memory
    browser.show(f"{url}/#traces", ["padded · train · step", "synthetic_2x · train · step"])
    wait_for(browser, "(doc) => doc.body.dataset.readyMs")
    assert in_traces(browser, EDGES) == [0, 0]
    x0, x1 = in_traces(browser, SPAN % ("regions", 0, FORWARD, "regions", 0, FORWARD))
    y = in_traces(browser, LANE_TOP % ("regions", 0)) + 9
    pointer(browser, "click", (x0 + x1) / 2, y)
    why = wait_for(browser, "(doc) => doc.getElementById('why').textContent")
    assert why.startswith("forward: why, in the steps shown"), why
    edges = in_traces(browser, EDGES)
    assert all(n > 0 for n in edges), edges  # outlined in each run's regions lane
    pointer(browser, "wheel", (x0 + x1) / 2, y)
    assert all(n > 0 for n in in_traces(browser, EDGES))
    assert in_traces(browser, "(doc) => doc.getElementById('why').textContent").startswith("forward: why")
    c0, c1 = in_traces(browser, SPAN % ("regions", 0, CALC_LOSS, "regions", 0, CALC_LOSS))
    pointer(browser, "mousedown", (c0 + c1) / 2 + 60, y)  # a pan that ends over calc loss
    pointer(browser, "mousemove", (c0 + c1) / 2, y)
    pointer(browser, "mouseup", (c0 + c1) / 2, y)
    pointer(browser, "click", (c0 + c1) / 2, y)
    assert in_traces(browser, "(doc) => doc.getElementById('why').textContent").startswith("forward: why")
    keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-picked.png"))


def test_the_axis_keeps_one_precision_and_the_button_fits_its_text(gpu_memory, browser):
    """Every label of the time axis has the decimals of its step, whole steps or zoomed, and lies whole inside the
    canvas, apart from its neighbours, wherever the view ends; the button is as wide as its words."""
    url, _, _ = gpu_memory
    browser.show(f"{url}/#traces", ["padded · train · step", "synthetic_2x · train · step"])
    wait_for(browser, "(doc) => doc.body.dataset.readyMs")
    decimals = lambda label: len(label.removesuffix(" ms").partition(".")[2])  # noqa: E731
    axis = "(doc) => JSON.parse(doc.getElementById('canvas').dataset.axis || '[]')"
    whole = in_traces(browser, axis)
    assert len(whole) > 3 and {decimals(label) for label in whole} == {0}, whole  # "0 ms", "20 ms", ...
    for _ in range(4):
        pointer(browser, "wheel", 300, 40)
    zoomed = in_traces(browser, axis)
    assert len({decimals(label) for label in zoomed}) == 1 and zoomed != whole, zoomed
    canvas = "doc.getElementById('canvas')"
    extents = f"(doc) => [JSON.parse({canvas}.dataset.axisExtents), {canvas}.clientWidth]"
    placed, width = in_traces(browser, extents)
    tick = placed[-1][0] - 2  # the last label's tick, which its label starts just right of
    pointer(browser, "mousedown", 100, 40)  # a pan that brings it 10 px from the right edge: its label would not fit
    pointer(browser, "mousemove", 100 + (width - 10 - tick), 40)
    pointer(browser, "mouseup", 100 + (width - 10 - tick), 40)
    for x in (None, 900, 700, 650, 500, 320, 150, 60, 5):  # then zooms about: whichever label comes near an edge
        if x is not None:
            pointer(browser, "wheel", x, 40)
        placed, width = in_traces(browser, extents)
        assert placed and all(0 <= a < b <= width for a, b in placed), (x, placed, width)  # none cut at an edge
        assert all(b0 < a1 for (_, b0), (a1, _) in itertools.pairwise(placed)), (x, placed)  # none over the next
    width = in_traces(browser, "(doc) => doc.getElementById('reset').getBoundingClientRect().width")
    assert width < 150, width


@pytest.fixture(scope="module")
def h100_pair(tmp_path_factory):
    """(url, {strategy: its summary}): padded and packed as `make profile` recorded them on an H100 (tests/data, three
    steps each), served by TensorBoard."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    logdir = tmp_path_factory.mktemp("h100") / "runs"
    records = {}
    for stamp, (strategy, trace) in zip(("20261127-170600", "20261127-170800"), H100_TRACES.items(), strict=True):
        run = make_run(logdir / "profile", strategy, stamp, recorded=trace, device="NVIDIA H100 80GB HBM3")
        records[strategy] = read_summary(run / "summary.json")
    url, stop = serve(logdir, [])
    yield url, records
    stop()


def test_two_recorded_strategies_on_one_axis_with_a_region_picked(h100_pair, browser):
    """padded and packed as `make profile` recorded them on an H100: each one's median step on one axis, backward
    picked: outlined in both, its why numbers side by side. The README's picture (TENSORBOARD_SCREENSHOTS=docs)."""
    url, _ = h100_pair
    browser.show(f"{url}/#traces", ["padded · train · step", "packed · train · step"])
    wait_for(browser, "(doc) => doc.body.dataset.readyMs")
    x0, x1 = in_traces(browser, SPAN % ("regions", 0, BACKWARD, "regions", 0, BACKWARD))
    pointer(browser, "click", (x0 + x1) / 2, in_traces(browser, LANE_TOP % ("regions", 0)) + 9)
    why = wait_for(browser, "(doc) => doc.getElementById('why').textContent")
    assert why.startswith("backward: why, in the steps shown") and "packed" in why, why
    assert all(n > 0 for n in in_traces(browser, EDGES))
    keep(browser.screenshot(browser.profile.parent / "tensorboard-traces.png"))


HEADERS = "(doc) => [...doc.querySelectorAll('.lane-label.header')].map((l) => [l.textContent, l.title])"
PICKERS = "(doc) => [...doc.querySelectorAll('.run select')].map((s) => [...s.options].map((o) => o.text))"
TIP_BOX = """(doc, win) => {  // the tooltip's text and whether it lies whole inside the window
  const tip = doc.getElementById('tooltip');
  const box = tip.getBoundingClientRect();
  const inside = box.left >= 0 && box.top >= 0 && box.right <= win.innerWidth && box.bottom <= win.innerHeight;
  return tip.style.display === 'block' && [tip.textContent, inside, [box.left, box.right, win.innerWidth]];
}"""


def test_a_device_paced_runs_header_gives_the_device_step_and_the_tooltip_stays_in_the_window(h100_pair, browser):
    """On a GPU run the device paced, the run's header gives its device step (the host ran ahead: its ProfilerStep is
    the time it took to launch), as the lab's tables lead with it; the step picker lists each step's device time and
    marks the representative one. A kernel hovered at the window's right edge has its name and its launch in a box whole
    inside the window."""
    url, records = h100_pair
    browser.show(f"{url}/#traces", ["padded · train · step", "packed · train · step", "GPU stream 7"])
    wait_for(browser, "(doc) => doc.body.dataset.readyMs")
    headers = in_traces(browser, HEADERS)
    for (text, title), (strategy, record) in zip(headers, records.items(), strict=True):
        assert record.leading_time() == "gpu_ms"  # the device paced both
        device = {s.step: s.regions["step"]["device_step_ms"] for s in record.per_step}
        step = record.analysis.representative_step
        # the step nearest the medians of the device step and the wall time (the first of equal device steps may be
        # one the host rushed through), as the card and compare's chart show
        assert step == representative_step(record.per_step).step
        assert text == f"{strategy} · train · step {step} · device {device[step]:.1f} ms", text
        assert title.startswith("device: the GPU's step") and "paced by the device" in title, title
        wall = next(s.regions["step"]["wall_ms"] for s in record.per_step if s.step == step)
        assert f"{wall:.1f} ms" in title  # the host's ProfilerStep, said for what it is
    pickers = in_traces(browser, PICKERS)
    for options, record in zip(pickers, records.values(), strict=True):
        step = record.analysis.representative_step
        assert [o for o in options if o.endswith("(median)")] == [next(o for o in options if f"step {step} " in o)]
        assert all(" · device " in o for o in options), options
    top = in_traces(browser, LANE_TOP % ("GPU stream 7", 1))
    width = in_traces(browser, "(doc) => doc.getElementById('canvas').clientWidth")
    for x in (width - 2, width - 6, width - 12, width - 24):  # the last kernel drawn: at the right edge
        pointer(browser, "mousemove", x, top + 9)
        found = in_traces(browser, TIP_BOX)
        if found:
            break
    text, inside, where = found
    assert "launched by" in text and inside, (text, where)
    keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-right-edge.png"))


MERGED_ORANGE = "179,89,10"  # calc loss's colour as a bar of merged events draws it (0.7 of each channel)


def test_a_cpu_run_keeps_a_wide_region_in_its_colour_and_its_why_names_no_gpu(tmp_path, browser):
    """A CPU run (no GPU events) whose calc loss takes 5 µs, well under a pixel at the whole step's zoom, just before
    backward's 52 ms: backward is drawn alone in its own colour, not merged into the sub-pixel bar before it (which
    drew it in calc loss's colour, darkened); the why panel of a CPU run explains no GPU column; its header and step
    picker time its steps by the wall clock, and say so."""
    run = make_run(tmp_path / "runs" / "profile", "padded", "20261122-031500", gpu=False)
    extract = read_extract(run / EXTRACT)
    for step in extract.steps.values():
        regions = {row[0]: row for row in step.regions}
        regions["calc loss"][1:] = [regions["backward"][1] - 5.0, 5.0]
    write_extract(run, extract)
    url, stop = serve(tmp_path / "runs", [])
    try:
        browser.show(f"{url}/#traces", ["padded · train · cpu"])
        wait_for(browser, "(doc) => doc.body.dataset.readyMs")
        [(header, title)] = in_traces(browser, HEADERS)  # on the CPU the host is the device: the wall time leads
        step = extract.steps[str(extract.representative_step)]
        assert header == f"padded · train · step {extract.representative_step} · wall {step.dur / 1e3:.1f} ms", header
        assert title.startswith("wall: the host's ProfilerStep") and "paced by the host" in title, title
        assert all(" · wall " in option for option in in_traces(browser, PICKERS)[0])
        x0, x1 = in_traces(browser, SPAN % ("regions", 0, BACKWARD, "regions", 0, BACKWARD))
        assert x1 - x0 > 100, (x0, x1)  # 52 ms of a 109 ms step
        assert in_traces(browser, SPAN % ("regions", 0, MERGED_ORANGE, "regions", 0, MERGED_ORANGE)) is None
        pointer(browser, "click", (x0 + x1) / 2, in_traces(browser, LANE_TOP % ("regions", 0)) + 9)
        why = wait_for(browser, "(doc) => doc.getElementById('why').textContent")
        assert why.startswith("backward: why, in the steps shown") and "GPU" not in why, why
    finally:
        stop()
