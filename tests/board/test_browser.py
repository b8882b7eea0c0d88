"""TensorBoard serving profile and compare runs, checked through its HTTP API and in headless Chromium.

A runs/ folder is built from the recorded H200 trace: padded, and ``synthetic_2x``, the same trace with
every time halved (a made-up strategy, named so in the screenshots), with each run's events
(detector/board/events.py) and a `make compare` run (detector/lab/compare.py); the launcher
(detector/board/launcher.py) serves it on 127.0.0.1. The browser tests run Chromium offline (every host but
127.0.0.1 unresolvable) and drive it over the DevTools protocol on a pipe (no extra packages): TensorBoard's
Images and Text dashboards draw into shadow DOM, which ``--dump-dom`` does not show. They are skipped where Debian's
``chromium`` is not installed. Screenshots go to the test's tmp folder, and to $TENSORBOARD_SCREENSHOTS
when set (``TENSORBOARD_SCREENSHOTS=docs pytest tests/test_browser.py`` regenerates the README's
docs/tensorboard-*.png, taken after the CPU quick start).
"""

import base64
import fcntl
import gzip
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import child_env
from lab_helpers import make_run

from detector import cli
from detector.board.events import COMPARE_GROUP, RUN_GROUP, scalar_tag, write_compare_events, write_profile_events
from detector.config import load_config
from detector.lab.analysis import measure_steps, summarise
from detector.lab.compare import run_compare
from detector.lab.record import EXTRACT, ProfileRecord, read_extract, read_summary, write_extract, write_summary
from detector.lab.trace import load_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PADDED, FAST = "profile/padded/20261122-031500", "profile/synthetic_2x/20261122-031600"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def get_json(url: str):
    return json.loads(get(url))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{"url", "runs", "compare", "shots"}: TensorBoard on 127.0.0.1 over a runs/ folder of two profile
    runs and their comparison; stopped (its whole process group) after the module."""
    logdir = tmp_path_factory.mktemp("board") / "runs"
    for strategy, stamp, scale in (("padded", "20261122-031500", 1.0), ("synthetic_2x", "20261122-031600", 0.5)):
        run = make_run(logdir / "profile", strategy, stamp, scale=scale)
        write_profile_events(run, read_summary(run), read_extract(run / "extract.json.gz"))
    compare = run_compare(logdir / "profile", out_dir=logdir / "compare" / "20261122-032000")
    write_compare_events(compare.out, compare.texts, compare.images)
    runs = [PADDED, FAST, "compare/20261122-032000"]
    url, stop = serve(logdir, runs)
    yield {"url": url, "runs": runs, "compare": compare, "shots": logdir.parent}
    stop()


def test_tensorboard_serves_our_runs(served):
    url = served["url"]
    assert set(served["runs"]) <= set(get_json(f"{url}/data/runs"))

    scalars = get_json(f"{url}/data/plugin/scalars/tags")
    expected = {
        scalar_tag(m, r) for m, r in (("wall_ms", "forward"), ("launches", "calc loss"), ("gpu_ms", "backward"))
    }
    assert expected <= set(scalars[PADDED]) and expected <= set(scalars[FAST])
    tag = urllib.parse.quote(scalar_tag("wall_ms", "forward"))
    points = get_json(f"{url}/data/plugin/scalars/scalars?run={urllib.parse.quote(FAST)}&tag={tag}")
    assert [p[1] for p in points] == [10, 11, 12] and all(14 < p[2] < 15 for p in points)  # [wall, step, ms]

    texts = get_json(f"{url}/data/plugin/text/tags")
    assert texts[PADDED] == ["summary/tables/text_summary"]
    assert texts["compare/20261122-032000"] == ["compare/train/text_summary"]
    query = "run=compare/20261122-032000&tag=compare/train/text_summary"
    html = get_json(f"{url}/data/plugin/text/text?{query}")[0]["text"]
    assert "<table>" in html and "synthetic_2x" in html and "2×" in html

    images = get_json(f"{url}/data/plugin/images/tags")
    assert {f"{RUN_GROUP}/timeline of the median step", f"{RUN_GROUP}/ms per region"} <= set(images[PADDED])
    charts = {f"{COMPARE_GROUP}/{chart}, train" for chart in ("1 ms per step", "2 counts", "3 timeline")}
    assert charts <= set(images["compare/20261122-032000"])
    query = urllib.parse.urlencode({"run": "compare/20261122-032000", "tag": f"{COMPARE_GROUP}/3 timeline, train"})
    sample = get_json(f"{url}/data/plugin/images/images?{query}")[0]
    assert get(f"{url}/data/plugin/images/individualImage?{sample['query']}")[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- in the browser

DEEP_TEXT = """(() => {  // text of the page, shadow roots included, and how many images have loaded
  const texts = []; let images = 0;
  const visit = (node) => {
    if (node.nodeType === Node.TEXT_NODE) texts.push(node.data);
    if (node.tagName === 'IMG' && node.complete && node.naturalWidth > 0) images++;
    if (node.shadowRoot) visit(node.shadowRoot);
    if (node.tagName === 'IFRAME' && node.contentDocument) visit(node.contentDocument);  // a plugin's page
    for (const child of node.childNodes) visit(child);
  };
  visit(document);
  return JSON.stringify({text: texts.join(' ').replace(/\\s+/g, ' '), images});
})()"""

CLICK_ACTUAL_SIZE = """(() => {  // tick the Images dashboard's "Show actual image size"
  const find = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'PAPER-CHECKBOX' && el.textContent.includes('Show actual image size')) return el;
      const inner = el.shadowRoot && find(el.shadowRoot);
      if (inner) return inner;
    }
    return null;
  };
  const box = find(document);
  if (box && !box.checked) box.click();
  return Boolean(box);
})()"""


class Chromium:
    """Headless Chromium, offline, driven with the DevTools protocol over --remote-debugging-pipe
    (NUL-terminated JSON: commands on its fd 3, replies and events on its fd 4)."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000):
        self.profile = profile
        to_browser, self.commands = os.pipe()
        self.replies, from_browser = os.pipe()

        def as_fds_3_and_4():  # in the child; via fds >= 10 so that neither dup2 overwrites the other pipe
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
            + ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
            + ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", f"--user-data-dir={profile}"]
            + ["--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank"],
            preexec_fn=as_fds_3_and_4,
            close_fds=False,  # keep fds 3 and 4 (dup2 makes them inheritable; Python's own fds are not)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_browser)
        os.close(from_browser)
        self.buffer, self.last_id = b"", 0
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def send(self, method: str, timeout: float = 30, **params) -> dict:
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params}
        if getattr(self, "session", None):
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self.buffer:
                ready, _, _ = select.select([self.replies], [], [], max(0.0, deadline - time.monotonic()))
                assert ready, f"Chromium did not answer {method} within {timeout} s"
                chunk = os.read(self.replies, 1 << 20)
                assert chunk, "Chromium closed its DevTools pipe"
                self.buffer += chunk
            raw, _, self.buffer = self.buffer.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") == self.last_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    def evaluate(self, expression: str):
        return self.send("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def show(self, url: str, expected: list[str], images: int = 0, timeout: float = 60) -> str:
        """Open ``url``; wait until its text (shadow DOM included) holds every ``expected`` string and at
        least ``images`` images have loaded. Returns the text; fails naming what is missing."""
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while True:
            page = json.loads(self.evaluate(DEEP_TEXT) or '{"text": "", "images": 0}')
            missing = [s for s in expected if s not in page["text"]]
            if not missing and page["images"] >= images:
                return page["text"]
            assert time.monotonic() < deadline, f"{url}: after {timeout} s, missing {missing}, {page['images']} images"
            time.sleep(0.5)

    def screenshot(self, path: Path) -> Path:
        time.sleep(1)  # let the last layout settle
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self):
        try:
            self.send("Browser.close", timeout=10)
        except (AssertionError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        os.close(self.commands)
        os.close(self.replies)


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    chromium = Chromium(tmp_path / "chromium-profile", width=1950, height=1000)  # the timeline at actual size
    yield chromium
    chromium.close()


def keep(shot: Path) -> None:
    """Copy a screenshot to $TENSORBOARD_SCREENSHOTS (docs/) when set."""
    if os.environ.get("TENSORBOARD_SCREENSHOTS"):
        shutil.copy(shot, Path(os.environ["TENSORBOARD_SCREENSHOTS"]) / shot.name)


def test_images_dashboard_shows_the_timelines(served, browser):
    url = served["url"]
    text = browser.show(
        f"{url}/#images&tagFilter=timeline",
        ["timeline of the median step", "3 timeline, train", PADDED, FAST, "compare/20261122-032000"],
        images=3,
    )
    assert "No image data was found" not in text
    browser.show(f"{url}/#images&tagFilter=3%20timeline%2C%20train", ["3 timeline, train"], images=1)
    assert browser.evaluate(CLICK_ACTUAL_SIZE), "no 'Show actual image size' checkbox"
    shot = browser.screenshot(served["shots"] / "tensorboard-images.png")
    assert shot.stat().st_size > 20_000


def test_text_dashboard_shows_the_tables(served, browser):
    text = browser.show(
        f"{served['url']}/#text",
        [
            "compare/train/text_summary",
            "Verdicts",
            "Why (mode=train)",
            "synthetic_2x",
            "· 2×",
            "padded, train, NVIDIA H200",
        ],
    )
    assert "No text data was found" not in text
    shot = browser.screenshot(served["shots"] / "tensorboard-text.png")
    assert shot.stat().st_size > 20_000


# ----------------------------------------------------------------------------- after the CPU quick start


def serve(logdir: Path, runs: list[str]):
    """TensorBoard (detector/board/launcher.py) on 127.0.0.1 over ``logdir``, once it lists ``runs``: (url, stop),
    stop() ending its whole process group."""
    port = free_port()
    env = child_env()
    script = "import sys; from detector.board.launcher import main; main(sys.argv[1], int(sys.argv[2]))"
    log = open(logdir.parent / "tensorboard.log", "wb")  # noqa: SIM115  closed by stop()
    server = subprocess.Popen(
        [sys.executable, "-c", script, str(logdir), str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )

    def stop():
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()

    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            if set(runs) <= set(get_json(f"{url}/data/runs")) and get_json(f"{url}/data/plugins_listing"):
                return url, stop
        except OSError:
            pass  # not listening yet
        if server.poll() is not None or time.monotonic() > deadline:
            stop()
            raise AssertionError((logdir.parent / "tensorboard.log").read_text()[-3000:])
        time.sleep(1)


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The README's quick start on this machine: `make profile` of padded and concat with the preset it
    picks, then `make compare`, served by `make tensorboard`."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    logdir = tmp_path_factory.mktemp("quick") / "runs"
    for strategy in ("padded", "concat"):
        cfg = load_config([f"profile.strategy={strategy}", f"profile.out_dir={logdir / 'profile'}"], announce=None)
        cli.profile(cfg)
    assert cli.main(["compare", "--dir", str(logdir / "profile"), "--out", str(logdir / "compare" / "now")]) == 0
    url, stop = serve(logdir, ["compare/now"])
    yield url
    stop()


def test_the_landing_page_opens_on_the_comparison(quick_start, browser):
    """TensorBoard's first page (Time Series) shows the comparison's charts first, then the step's wall time."""
    text = browser.show(f"{quick_start}/", ["1 compare", "1 ms per step, train", "2 wall ms"], images=1)
    assert text.index("1 compare") < text.index("1 ms per step, train") < text.index("2 wall ms")
    keep(browser.screenshot(browser.profile.parent / "tensorboard-landing.png"))


def test_the_comparison_text_leads_with_the_verdicts(quick_start, browser):
    text = browser.show(f"{quick_start}/#text", ["compare/train/text_summary", "Verdicts", "Traces tab: align on"])
    assert text.index("Verdicts") < text.index("Wall ms per step") < text.index("Why (mode=train)")
    assert "concat" in text and "slices" in text and "operators" in text
    keep(browser.screenshot(browser.profile.parent / "tensorboard-compare.png"))


# ----------------------------------------------------------------------------- the Traces tab

IN_TRACES = """((body) => {  // run body(doc, win) inside the Traces tab's iframe; JSON of its result
  const find = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'IFRAME' && (el.src || '').includes('name=traces')) return el;
      const inner = el.shadowRoot && find(el.shadowRoot);
      if (inner) return inner;
    }
    return null;
  };
  const frame = find(document);
  if (!frame || !frame.contentDocument) return JSON.stringify(null);
  return JSON.stringify(body(frame.contentDocument, frame.contentWindow));
})(%s)"""

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


def in_traces(browser, body: str):
    return json.loads(browser.evaluate(IN_TRACES % body) or "null")


def wait_for(browser, body: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        found = in_traces(browser, body)
        if found:
            return found
        assert time.monotonic() < deadline, f"the Traces tab did not show {body!r} within {timeout} s"
        time.sleep(0.25)


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
    keep(browser.screenshot(browser.profile.parent / "tensorboard-traces.png"))


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


PAYLOAD = '<img src=x onerror="document.body.dataset.pwned=1">'

SHOWN_AS_TEXT = """(doc) => ({  // what the tooltip and the why panel hold, and whether any markup in them ran
  tip: doc.getElementById('tooltip').textContent,
  why: doc.getElementById('why').textContent,
  images: doc.querySelectorAll('img').length,
  pwned: doc.body.dataset.pwned || window.top.document.body.dataset.pwned || null,
})"""


def test_the_traces_tab_shows_names_and_values_from_a_run_as_text(tmp_path, browser):
    """A thread's name, an operator's name and a why value holding markup are shown as written, and none runs."""
    logdir = tmp_path / "runs"
    run = make_run(logdir / "profile", "padded", "20261122-031500")
    found = read_extract(run / EXTRACT)
    found.names.append(PAYLOAD)
    for step in found.steps.values():
        step["threads"][1] = {"tid": PAYLOAD, "ops": [[0, step["dur"], len(found.names) - 1]]}  # one op: the step
        for measures in step["why"].values():
            measures["launches"] = PAYLOAD
    write_extract(run, found)
    url, stop = serve(logdir, [])
    try:
        browser.show(f"{url}/#traces", ["padded · train · step", f"thread {PAYLOAD}: operators"])
        wait_for(browser, "(doc) => doc.body.dataset.readyMs")
        in_traces(browser, POINT_AT % ("hover", f"thread {PAYLOAD}: operators", 0.1, "mousemove"))
        wait_for(browser, "(doc) => doc.getElementById('tooltip').style.display === 'block'")
        in_traces(browser, POINT_AT % ("click", "regions", 0.3, "click"))
        wait_for(browser, "(doc) => doc.getElementById('why').textContent")
        time.sleep(1)  # an image that failed to load would have run its onerror by now
        seen = in_traces(browser, SHOWN_AS_TEXT)
        assert seen["tip"].startswith(PAYLOAD) and f"thread {PAYLOAD}, in " in seen["tip"], seen["tip"]
        assert PAYLOAD in seen["why"] and "launches" in seen["why"], seen["why"]
        assert seen["images"] == 0 and seen["pwned"] is None
        keep(browser.screenshot(browser.profile.parent / "tensorboard-traces-as-text.png"))
    finally:
        stop()
