"""Tables and numbers shared by the commands (profile, compare, bench, sweep, report): one markdown table
writer, one way to print milliseconds, spreads and speed-ups, and one line naming the machine a run came
from.

A *spread* is anything with ``median``, ``low`` and ``high`` attributes (``detector.lab.measure.timing.Stats``,
or ``detector.lab.record.run.Spread``): a median and its interquartile range [q1–q3]. The one rule for calling a
difference a speed-up, everywhere: two spreads whose interquartile ranges overlap are the same within the
noise (``≈``); otherwise the speed-up is the ratio of their medians.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

MISSING = "—"  # a cell without a value (not measured, not applicable)
# The widest table ``markdown_tables`` writes, in characters: each column as wide as its longest cell, or 1.25 times its
# header's longest word (TensorBoard's Text tab sets a header in a monospace <pre>, detector/board/events.py), and 3 for
# its padding. The Text tab shows 6.9-7.9 px a character (its digits are the widest): at most 790 px, within its card
# in a 1,280 px window (844 px); and a line a terminal shows whole.
TABLE_WIDTH = 100
CONTINUED = "*continued:*"  # the line over each part of a table split by its columns, after the first
WHICH_HEADING = "### Which strategy should I use?"  # bench losses writes it; make report opens its document with it


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits, never in exponent notation: 1239, 4.84, 0.0439."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def ms(value: float | None, digits: int = 3) -> str:
    """Milliseconds with ``digits`` significant digits, or ``—`` for None."""
    return MISSING if value is None else significant(value, digits)


def spread_cell(stats, digits: int = 3) -> str:
    """``median [low–high]``, e.g. ``0.575 [0.561–0.590]``; ``—`` for None."""
    if stats is None:
        return MISSING
    return f"{ms(stats.median, digits)} [{ms(stats.low, digits)}–{ms(stats.high, digits)}]"


def overlap(a, b) -> bool:
    """Whether two spreads' intervals [low, high] share a point."""
    return a.low <= b.high and b.low <= a.high


def speedup(base, new) -> float | None:
    """How many times faster ``new`` is than ``base`` (base median / new median); None where their spreads
    overlap (the same within the noise), either is missing, or a median is not positive."""
    if base is None or new is None or base.median <= 0 or new.median <= 0 or overlap(base, new):
        return None
    return base.median / new.median


def times(x: float | None) -> str:
    """A speed-up as ``3.3×``, ``2×``, ``0.036×``; ``≈`` for None (the same within the noise)."""
    if x is None:
        return "≈"
    text = significant(x, 2)
    if text == "1.0":  # 1.03x is not 1x: a third digit where two say nothing
        text = significant(x, 3)
    return (text[:-2] if text.endswith(".0") else text) + "×"


def speedup_cell(base, new) -> str:
    """``3.3×`` or ``0.04×`` (see ``speedup``), ``≈`` where their spreads overlap, ``—`` if either is missing."""
    if base is None or new is None:
        return MISSING
    return times(speedup(base, new))


TAG = re.compile(r"<(?=[A-Za-z/!?])")  # the start of an HTML tag: `<script>`, `</b>`, `<!--`
ENTITY = re.compile(r"&(?=#?\w+;)")  # the start of an HTML entity: `&lt;`, `&#60;`
BACKTICKS = re.compile(r"`+")


def one_line(value: object) -> str:
    """``value`` as text with its line breaks as spaces."""
    return " ".join(str(value).replace("\r", "\n").split("\n"))


def cell_text(value: object) -> str:
    """Text from a file a user or another program wrote (a strategy's name, a run folder's, a device's, a warning) as
    markdown that shows it as written, in a table's cell or in a sentence: it cannot end the cell or the line (``|`` and
    the ``\\`` that would undo that escape are escaped, line breaks are spaces), nor start an HTML tag or entity (their
    ``<`` and ``&`` as ``&lt;`` and ``&amp;``)."""
    text = one_line(value).replace("\\", "\\\\").replace("|", "\\|")
    return TAG.sub("&lt;", ENTITY.sub("&amp;", text))


def code_text(value: object) -> str:
    """``value`` as a markdown code span, shown as written (a path, a command, a run's name): on one line, between more
    backticks than it holds in a row. In a table's cell it still goes through ``cell_text``: a ``|`` ends the cell."""
    text = one_line(value)
    fence = "`" * (max(map(len, BACKTICKS.findall(text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""  # a span's own backtick next to the fence
    return f"{fence}{pad}{text}{pad}{fence}"


def code_block(lines: Sequence[str]) -> list[str]:
    """``lines`` (commands) as a fenced markdown block: each on one line, fenced by more backticks than they hold."""
    lines = [one_line(line) for line in lines]
    fence = "`" * max([3] + [len(run) + 1 for line in lines for run in BACKTICKS.findall(line)])
    return [fence, *lines, fence]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A markdown table. ``align`` has one letter per column, ``l`` or ``r``; by default the first column
    is left-aligned and the others right-aligned (labels, then numbers). None cells print as ``—``."""
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one of 'l'/'r' per column ({len(headers)}), got {align!r}")
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells for {len(headers)} columns: {row!r}")
    lines = ["| " + " | ".join(map(cell_text, headers)) + " |"]
    lines += ["|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(MISSING if c is None else cell_text(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


MARKS = re.compile(r"\*\*|`|\\(?=.)")  # bold, code spans and escapes: markdown's, not shown


def shown_width(text: str, header: bool = False) -> int:
    """How many characters a cell of markdown ``text`` takes as a table shows it (a header: its longest word in a
    TensorBoard <pre>, 1.25 times as wide), without its padding."""
    shown = MARKS.sub("", text.replace("&lt;", "<").replace("&amp;", "&"))
    return math.ceil(1.25 * max(map(len, shown.split()), default=0)) if header else len(shown)


def split_columns(headers: Sequence[str], rows: Sequence[Sequence[str]], keep: int, width: int) -> list[list[int]]:
    """The columns of a table of ``headers`` and ``rows`` (markdown text) in groups, in their order, each group after
    the ``keep`` label columns that every group repeats, so that each table is at most ``width`` characters wide (a
    column wider than that alone gets a table of its own)."""
    widths = [
        max([shown_width(h, header=True)] + [shown_width(row[k]) for row in rows]) + 3 for k, h in enumerate(headers)
    ]
    labels = sum(widths[:keep])
    groups: list[list[int]] = []
    for k in range(keep, len(headers)):
        if groups and labels + sum(widths[j] for j in groups[-1]) + widths[k] <= width:
            groups[-1].append(k)
        else:
            groups.append([k])
    return [list(range(keep)) + group for group in groups] or [list(range(len(headers)))]


def markdown_tables(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    align: str | None = None,
    keep: int = 1,
    width: int = TABLE_WIDTH,
) -> str:
    """``markdown_table`` of ``headers`` and ``rows``, split by its columns into as few tables as keep each within
    ``width`` characters (``split_columns``), each one repeating the ``keep`` label columns (the region, the strategy):
    a wide table fits a window, wrapping none of its numbers, instead of running past its edge. Each one after the
    first under a line of its own, CONTINUED (TensorBoard sets tables one under the other with no space between); one
    table where it fits."""
    align = align or "l" * keep + "r" * (len(headers) - keep)
    text = [[MISSING if c is None else cell_text(c) for c in row] for row in rows]
    tables = []
    for group in split_columns([cell_text(h) for h in headers], text, keep, width):
        columns, sides = [headers[k] for k in group], "".join(align[k] for k in group)
        tables.append(markdown_table(columns, [[row[k] for k in group] for row in rows], sides))
    return f"\n\n{CONTINUED}\n\n".join(tables)
