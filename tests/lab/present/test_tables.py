"""detector/lab/present/tables.py: number formatting, the ≈ rule of speed-ups, spread cells and the table writer, which
splits a table too wide for a window by its columns."""

import pytest
import torch
from lab_helpers import MARKUP_NAME, SHOWN, rendered, tables_whole

from detector.lab.present.tables import (
    CONTINUED,
    cell_text,
    code_block,
    code_text,
    markdown_table,
    markdown_tables,
    ms,
    shown_width,
    significant,
    speedup_cell,
    spread_cell,
)
from detector.lab.record.provenance import run_header
from detector.lab.record.spread import Spread


@pytest.mark.parametrize(
    "value, text",
    [(1238.8, "1239"), (306.1, "306"), (4.84, "4.84"), (0.575, "0.575"), (0.04391, "0.0439"), (0.0, "0")],
)
def test_significant_digits_never_use_exponents(value, text):
    assert significant(value) == text


def test_ms_of_none_is_a_dash():
    assert ms(None) == "—" and spread_cell(None) == "—"


def test_spread_cell_prints_median_and_interval():
    assert spread_cell(Spread(0.575, 0.561, 0.590)) == "0.575 [0.561–0.590]"


def test_speedup_only_where_the_spreads_are_apart():
    padded = Spread(2.75, 2.70, 2.80)
    assert speedup_cell(padded, Spread(0.842, 0.84, 0.85)) == "3.3×"  # apart: a speed-up
    assert speedup_cell(padded, Spread(75.9, 75.0, 77.0)) == "0.036×"  # apart, slower
    assert speedup_cell(padded, Spread(2.60, 2.50, 2.71)) == "≈"  # intervals share [2.70, 2.71]
    assert speedup_cell(padded, Spread(2.60, 2.50, 2.70)) == "≈"  # touching counts as overlap
    assert speedup_cell(padded, padded) == "≈"
    assert speedup_cell(None, padded) == "—"


def test_markdown_table_shape_and_alignment():
    table = markdown_table(["strategy", "ms", "layout"], [["padded", 1.5, "padded"], ["loop", None, "list"]], "lrl")
    assert table.splitlines() == [
        "| strategy | ms | layout |",
        "|---|---:|---|",
        "| padded | 1.5 | padded |",
        "| loop | — | list |",
    ]
    assert markdown_table(["a", "b"], []).splitlines()[1] == "|---|---:|"  # default: labels, then numbers


def test_markdown_table_rejects_ragged_rows_and_bad_alignment():
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        markdown_table(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [], align="lc")


def test_run_header_names_device_and_torch():
    assert run_header(torch.device("cpu")) == f"cpu, torch {torch.__version__}"


def test_a_cell_from_a_file_cannot_break_its_table_or_carry_html():
    """A strategy named with a pipe, a line break and a script tag: one cell, no tag; ``3 < 4`` stays as it is."""
    name = "evil|name\n<script>alert(1)</script> 3 < 4"
    assert cell_text(name) == "evil\\|name &lt;script>alert(1)&lt;/script> 3 < 4"
    table = markdown_table(["strategy", "ms"], [[name, 1]])
    assert len(table.splitlines()) == 3 and table.splitlines()[2].count(" | ") == 1
    assert "<script>" not in table


def test_a_name_with_an_escaped_pipe_or_an_entity_is_shown_as_written():
    """A backslash before a pipe cannot undo the pipe's escape (a cell of its own), and ``&lt;`` is not a ``<``."""
    assert cell_text("x\\|y &lt;b&gt; & co") == "x\\\\\\|y &amp;lt;b&amp;gt; & co"
    page = rendered(markdown_table(["strategy", "ms"], [[MARKUP_NAME, 1], ["&lt;b&gt;", 2]]))
    assert tables_whole(page) and "<script" not in page
    assert f"<td>{SHOWN}</td>" in page and "<td>&amp;lt;b&amp;gt;</td>" in page


@pytest.mark.parametrize(
    "value, span",
    [
        ("runs/profile/padded", "`runs/profile/padded`"),
        ("a`b", "``a`b``"),
        ("`x``", "``` `x`` ```"),  # its own backtick beside the fence: a space between
        ("two\nlines", "`two lines`"),
    ],
)
def test_a_code_span_shows_its_value_as_written(value, span):
    assert code_text(value) == span
    one_line = value.replace("\n", " ")
    assert rendered(f"run {span}") == f"<p>run <code>{one_line}</code></p>"


def test_a_code_block_is_fenced_past_the_backticks_its_commands_hold():
    assert code_block(["python -m detector train", "make profile ARGS='a```b'"]) == [
        "````",
        "python -m detector train",
        "make profile ARGS='a```b'",
        "````",
    ]
    assert code_block(["one\ntwo"]) == ["```", "one two", "```"]
    page = rendered("\n".join(code_block([f"make profile STRATEGY='{MARKUP_NAME}'", "```", "<b>"])))
    assert "<script" not in page and "<b>" not in page and page.count("<pre>") == 1


def parts(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The tables of ``markdown_tables``' text: (headers, rows) each, the cells as written."""
    found = []
    for block in text.split(f"\n\n{CONTINUED}\n\n"):
        lines = block.split("\n")
        split = lambda line: [cell.strip() for cell in line.strip("|").split(" | ")]  # noqa: E731
        found.append((split(lines[0]), [split(line) for line in lines[2:]]))
    return found


def test_a_table_too_wide_for_a_window_is_split_by_its_columns_repeating_its_labels():
    """Twelve columns of spreads beside a region and a strategy: tables of at most 100 characters (each column as wide
    as its widest cell, a header's longest word 1.25 times, and 3 of padding), each starting with the two label
    columns, every other column in one of them, in order; a table that fits stays whole; a column wider than the
    width alone has a table of its own."""
    headers = ["region", "strategy"] + [f"measure {k}" for k in range(12)]
    rows = [["optimizer step", "my|strategy"] + [f"{k}.25 [{k}.2–{k}.31]" for k in range(12)] for _ in range(3)]
    text = markdown_tables(headers, rows, keep=2)
    tables = parts(text)
    assert len(tables) > 1 and text.count(CONTINUED) == len(tables) - 1
    seen = []
    for head, body in tables:
        assert head[:2] == ["region", "strategy"] and all(
            row[:2] == ["optimizer step", "my\\|strategy"] for row in body
        )
        widths = [
            max([shown_width(h, header=True)] + [shown_width(row[k]) for row in body]) + 3 for k, h in enumerate(head)
        ]
        assert sum(widths) <= 100, (head, widths)
        seen += head[2:]
    assert seen == headers[2:]  # each once, in order
    assert [row[2:] for row in tables[0][1]] == [r[2 : 2 + len(tables[0][0]) - 2] for r in rows]  # whole numbers kept
    assert markdown_tables(headers[:4], [r[:4] for r in rows], keep=2) == markdown_table(
        headers[:4], [r[:4] for r in rows], "llrr"
    )
    wide = markdown_tables(["region", "a", "b"], [["step", "x" * 120, "1"]])
    assert [head for head, _ in parts(wide)] == [["region", "a"], ["region", "b"]]
