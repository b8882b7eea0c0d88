"""TensorBoard serving profile and compare runs, checked through its HTTP API and in headless Chromium (the Traces
tab has tests/board/test_traces_tab.py and test_traces_lanes.py).

A runs/ folder is built from the recorded H200 trace: padded, and ``synthetic_2x``, the same trace with every time
halved (a made-up strategy, named so in the screenshots), with each run's events (detector/board/events.py) and a
`make compare` run (detector/lab/compare.py); the launcher serves it on 127.0.0.1. TensorBoard's Images and Text
dashboards draw into shadow DOM, which ``--dump-dom`` does not show: the tests read it over the DevTools protocol
(tests/browser_helpers.py). They are skipped where Debian's ``chromium`` is not installed.
``TENSORBOARD_SCREENSHOTS=docs pytest tests/board/test_browser.py`` regenerates the README's docs/tensorboard-*.png,
taken after the CPU quick start.
"""

import json
import time
import urllib.parse

import pytest
from browser_helpers import CHROMIUM, CLICK_ACTUAL_SIZE, get, get_json, keep, serve
from lab_helpers import make_run

from detector.board.events import COMPARE_GROUP, RUN_GROUP, scalar_tag, write_compare_events, write_profile_events
from detector.cli import main as cli
from detector.config.schema import load_config
from detector.lab.compare import run_compare
from detector.lab.record.run import read_summary
from detector.lab.record.steps import read_extract

PADDED, FAST = "profile/padded/20261122-031500", "profile/synthetic_2x/20261122-031600"


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


BROKEN_WORDS = """(() => {  // the words of the Text tab's table cells that its layout broke across lines
  const broken = [];
  const check = (cell) => {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const word of node.data.matchAll(/[^\\s–]+/g)) {  // a line may break after a dash: "[1.2–" "1.4]"
        const range = document.createRange();
        range.setStart(node, word.index);
        range.setEnd(node, word.index + word[0].length);
        const lines = new Set([...range.getClientRects()].filter((r) => r.width).map((r) => Math.round(r.top)));
        if (lines.size > 1) broken.push(`${cell.tagName}: ${word[0]}`);
      }
    }
  };
  const visit = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) visit(el.shadowRoot);
      const cell = (el.tagName === 'TH' || el.tagName === 'TD') && !el.querySelector('table'); // not TB's frame
      if (cell && el.closest('#markdown')) check(el);
    }
  };
  visit(document);
  return JSON.stringify(broken);
})()"""


def test_text_dashboard_breaks_table_words_only_between_them(served, browser):
    """In a window too narrow for the why table, no header nor cell is broken inside a word ("operat/ors"): the
    tables scroll instead (detector/board/events.py text_tab)."""
    browser.send("Emulation.setDeviceMetricsOverride", width=1000, height=1000, deviceScaleFactor=1, mobile=False)
    browser.show(f"{served['url']}/#text", ["compare/train/text_summary", "Why (mode=train)", "operators"])
    time.sleep(1)  # the last card's layout
    assert json.loads(browser.evaluate(BROKEN_WORDS)) == []
    keep(browser.screenshot(served["shots"] / "tensorboard-text-narrow.png"))


TABLES_PAST_THEIR_CARD = """(() => {  // the Text tab's tables past their card's edge, its cards that scroll sideways
  const past = [];
  const visit = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) visit(el.shadowRoot);
      const markdown = el.tagName === 'TABLE' && !el.querySelector('table') && el.closest('#markdown');
      if (markdown && el.getBoundingClientRect().right > markdown.getBoundingClientRect().right + 0.5) {
        past.push(el.querySelector('tr').textContent.replace(/\\s+/g, ' ').trim());
      }
      if (el.id === 'steps-container' && el.scrollWidth > el.clientWidth + 1) past.push(`card ${el.scrollWidth} px`);
    }
  };
  visit(document);
  return JSON.stringify(past);
})()"""


def test_text_dashboard_tables_fit_a_1280_px_window(served, browser):
    """At a 1,280 px window every table of the run cards and the comparison lies inside its card, which scrolls
    only down (the run table's 12 columns were 1,394 px wide, in a card of 844): the tables too wide are split by
    their columns (detector/lab/present/tables.py markdown_tables), and no number in them is broken across lines."""
    browser.send("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
    browser.show(
        f"{served['url']}/#text",
        ["compare/train/text_summary", "summary/tables/text_summary", "Why (mode=train)", "CUDA API ms", "continued"],
    )
    time.sleep(1)  # the last card's layout
    assert json.loads(browser.evaluate(TABLES_PAST_THEIR_CARD)) == []
    assert json.loads(browser.evaluate(BROKEN_WORDS)) == []
    keep(browser.screenshot(served["shots"] / "tensorboard-text-1280.png"))


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
