"""TensorBoard events of a profile run (detector/board/events.py) read back with TensorBoard's own reader, the
run's text card, and the `make tensorboard` launcher (detector/board/launcher.py)."""

import re

import pytest
from lab_helpers import make_run, read_events
from tensorboard.plugin_util import markdown_to_safe_html

from detector.board import events as board
from detector.board.launcher import main as launch
from detector.board.plugin import TracesPlugin
from detector.lab.present.text import run_card
from detector.lab.record.measures import MEASURES
from detector.lab.record.run import read_summary
from detector.lab.record.steps import read_extract


def write_events(run):
    record = read_summary(run)
    board.write_profile_events(run, record, read_extract(run / "extract.json.gz"))
    return record


def test_profile_events_scalars_text_images(tmp_path):
    run = make_run(tmp_path / "profile", "padded", "20261122-031500")
    summary = write_events(run)

    assert sorted(p.name for p in (run / "trace").iterdir()) == [summary.trace.split("/")[1]]  # trace/ stays clean
    events = read_events(run)
    tags = events.Tags()
    # one tag per measure and region, the same in every run: TensorBoard overlays the strategies; numbered
    # so that TensorBoard's name order is the vocabulary's, the whole step first
    assert board.scalar_tag("wall_ms", "step") == "2 wall ms/0 step"
    assert board.scalar_tag("gpu_ms", "backward") == "3 GPU ms/5 backward"
    for measure, region in (("wall_ms", "forward"), ("launches", "calc loss"), ("device_step_ms", "step")):
        assert board.scalar_tag(measure, region) in tags["scalars"], (measure, region)
    assert board.scalar_tag("gpu_idle_share", "step") in tags["scalars"]  # the step's alone
    assert board.scalar_tag("gpu_idle_share", "forward") not in tags["scalars"]
    assert board.scalar_tag("sync_wait_ms", "step") not in tags["scalars"]  # 0 throughout: not written
    assert board.scalar_tag("slices", "copy data") not in tags["scalars"]  # 0 in this region: no flat chart
    assert board.scalar_tag("slices", "calc loss") in tags["scalars"]
    forward = events.Scalars(board.scalar_tag("launches", "forward"))
    assert [e.step for e in forward] == [s.step for s in summary.per_step] == [10, 11, 12]
    assert [e.value for e in forward] == [s.regions["forward"]["launches"] for s in summary.per_step]
    wall = [e.value for e in events.Scalars("2 wall ms/0 step")]
    assert wall == pytest.approx([s.regions["step"]["wall_ms"] for s in summary.per_step])

    assert tags["tensors"] == ["summary/tables/text_summary"]
    text = events.Tensors("summary/tables/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "padded, train, NVIDIA H200" in text and "| calc loss |" in text and "launches" in text
    assert text == board.text_tab(run_card(summary))  # its tables' headers set for the Text tab
    assert "As training runs it (no profiler, no regions; 5 steps): step 101 [100–101] ms" in text
    assert "Noise: quiet (other processes' load, in cores of 16: 0.02 before, 0.05 during, 0.01 after)." in text
    assert "need a GPU" not in text and "**warning**" not in text

    assert sorted(tags["images"]) == [
        f"{board.RUN_GROUP}/ms per region",
        f"{board.RUN_GROUP}/timeline of the median step",
    ]
    image = events.Images(f"{board.RUN_GROUP}/timeline of the median step")[0]
    assert image.width > 1000 and image.height > 100 and image.encoded_image_string[:4] == b"\x89PNG"


def test_profile_events_of_a_cpu_trace(tmp_path):
    """No GPU: the GPU-only measures are None in the summary, have no scalar, and the text says so once."""
    run = make_run(tmp_path / "profile", "padded", "20261122-031500", gpu=False)
    summary = write_events(run)

    tags = read_events(run).Tags()
    assert board.scalar_tag("wall_ms", "forward") in tags["scalars"]
    assert board.scalar_tag("ops", "forward") in tags["scalars"]
    gpu_only = [name for name, m in MEASURES.items() if m.gpu_only]
    assert not [t for t in tags["scalars"] if any(t.split("/")[0].endswith(MEASURES[m].header) for m in gpu_only)]
    text = run_card(summary)
    assert text.count("need a GPU") == 1 and "| GPU ms |" not in text and "launches" in text.split("need a GPU")[0]
    assert f"{board.RUN_GROUP}/timeline of the median step" in tags["images"]


TABLE = """Before.

| region | strategy | operators | step ms as training runs it |
|---|---|---:|---:|
| optimizer step | my\\|strategy | 12 | 101 [100–101] |

After: | not a table |"""


def test_the_text_tabs_tables_have_their_headers_in_pre_as_wide_as_their_columns_words():
    """TensorBoard's Text tab breaks a squeezed table's words anywhere, but not a <pre>'s: each header is one, as wide
    as its column's longest word (in a <pre>'s narrower characters), its words whole on lines no wider."""
    text = board.text_tab(TABLE)
    lines = text.split("\n")
    assert lines[:2] + lines[3:] == TABLE.split("\n")[:2] + TABLE.split("\n")[3:]  # all but the header row kept
    headers = re.findall(r"<pre>(.*?)</pre>", lines[2])
    assert len(headers) == 4 and lines[2].startswith("| <pre>") and lines[2].endswith("</pre> |")
    shown = [header.split("&#10;") for header in headers]
    # the widths: 1.25 × "optimizer", × "my|strategy", "operators" itself, 1.25 × "[100–101]"
    words = {"region": 12, "strategy": 14, "operators": 9, "step ms as training runs it": 12}
    for (header, width), header_lines in zip(words.items(), shown, strict=True):
        assert {len(line) for line in header_lines} == {width}, header_lines
        assert " ".join(line.strip() for line in header_lines) == header  # broken between words only
    assert [line.strip() for line in shown[3]] == ["step ms as", "training", "runs it"]
    html = markdown_to_safe_html(text)  # what the Text tab gets: the <pre> kept by its sanitiser
    assert "<th><pre>   region   </pre></th>" in html and "<td>my|strategy</td>" in html


def test_a_summary_with_warnings_shows_them(tmp_path):
    summary = read_summary(make_run(tmp_path / "profile", "padded", "20261122-031500"))
    summary.analysis.warnings = ["3 of 9 kernel launches have no kernel <b>"]
    assert "**warning**: 3 of 9 kernel launches have no kernel &lt;b>" in run_card(summary)


def test_tensorboard_launcher_serves_the_traces_tab_on_the_loopback_interface(monkeypatch, capsys):
    started = []
    monkeypatch.setattr("absl.app.run", lambda main, argv, flags_parser: started.append((main, argv)))
    monkeypatch.setattr("tensorboard.default.get_dynamic_plugins", lambda: [])  # as if not installed

    launch("somewhere/runs", 6123)

    ((main, argv),) = started
    assert argv == ["tensorboard", "--logdir", "somewhere/runs", "--port", "6123", "--host", "127.0.0.1"]
    assert main.__self__.plugin_loaders[-1].plugin_class is TracesPlugin  # added: no entry point here
    out = capsys.readouterr().out
    assert "http://localhost:6123/" in out and "#traces" in out and "#timeseries" in out and "#text" in out
    assert "reachable from the network" not in out
    launch("somewhere/runs", 6123, host="0.0.0.0")
    assert started[-1][1][-2:] == ["--host", "0.0.0.0"]
    assert "(listening on 0.0.0.0: reachable from the network)" in capsys.readouterr().out


def test_tags_never_move_when_a_measure_is_added(monkeypatch):
    """A measure added anywhere in the list takes a number of its own: every tag written before stays as it was, so
    runs of the version before overlay runs of the version after."""
    from detector.lab.record.measures import Measure
    from detector.regions import REGIONS

    before = {(m, r): board.scalar_tag(m, r) for m in MEASURES for r in REGIONS}
    assert (
        before[("wall_ms", "step")] == "2 wall ms/0 step" and before[("syncs", "calc loss")] == "11 syncs/4 calc loss"
    )
    new = Measure("new_ms", "new ms", "ms", "a measure added after", tag=max(m.tag for m in MEASURES.values()) + 1)
    monkeypatch.setattr(board, "MEASURES", {"new_ms": new, **MEASURES})  # first in the list, say
    assert {(m, r): board.scalar_tag(m, r) for m in MEASURES for r in REGIONS} == before
    tags = [m.tag for m in MEASURES.values()]
    assert len(set(tags)) == len(tags) and max(tags) < int(board.RUN_GROUP.split()[0])  # one each, below the pictures
