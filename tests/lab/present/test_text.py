"""detector/lab/present/text.py: a run's card leads with the time that paced its step, and its tables fit a window."""

from lab_helpers import H100_TRACES, make_run

from detector.lab.present.tables import CONTINUED, TABLE_WIDTH, shown_width
from detector.lab.present.text import run_card, run_table
from detector.lab.record.run import read_summary


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables in ``text``: each its rows (the header first, the rule left out), the cells as written."""
    found, current = [], None
    for line in text.split("\n"):
        if line.startswith("|") and line.endswith("|"):
            if current is None:
                current = []
                found.append(current)
            if not set(line) <= set("|-: "):
                current.append([cell.strip() for cell in line.strip("|").split(" | ")])
        else:
            current = None
    return found


def width(table: list[list[str]]) -> int:
    head, *body = table
    return sum(
        max([shown_width(h, header=True)] + [shown_width(row[k]) for row in body]) + 3 for k, h in enumerate(head)
    )


def test_a_device_paced_runs_card_leads_with_gpu_time_and_its_tables_fit_a_window(tmp_path):
    """padded as recorded on an H100, which the device paced: the card's first table leads with GPU ms, then wall ms;
    its timeline step is the median device step; every table (the run's, its memory's) within TABLE_WIDTH, each
    region in each part."""
    run = make_run(tmp_path, "padded", "20261127-170600", recorded=H100_TRACES["padded"], device="NVIDIA H100")
    record = read_summary(run)
    assert record.leading_time() == "gpu_ms"
    card = run_card(record)
    found = tables(card)
    assert found[0][0][:3] == ["region", "GPU ms", "wall ms"], found[0][0]
    assert "(nearest the medians of the device step and the wall time)" in card and CONTINUED in card
    assert "What paced the step: paced by the device (GPU idle 1% of the step; the host waited" in card
    regions = [row[0] for row in found[0][1:]]
    for table in found:
        assert width(table) <= TABLE_WIDTH, table[0]
        assert [row[0] for row in table[1:]] == regions
    columns = [header for table in tables(run_table(record)) for header in table[0] if header != "region"]
    assert len(columns) == len(set(columns)) > 10  # every measure once, none lost in the split


def test_a_cpu_runs_card_leads_with_wall_time(tmp_path):
    record = read_summary(make_run(tmp_path, "padded", "20261122-031500", gpu=False))
    assert record.leading_time() == "wall_ms"
    card = run_card(record)
    assert tables(card)[0][0][:2] == ["region", "wall ms"] and "(median wall time)" in card
    assert all(width(table) <= TABLE_WIDTH for table in tables(card))
