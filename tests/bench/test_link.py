"""The link alone (detector/bench/link.py): its collectives on 2 gloo processes, the table the scaling document
shows, and its refusals in one line."""

import json
import os
import socket

import pytest
from train_helpers import spawn_two

from detector.bench import link
from detector.cli import main as cli

SMALL = ["device=cpu", "preset=cpu", "data.image_size=32", "model.hidden=64", "model.channels=[4,8]"]


def _two_processes(rank: int, out: str) -> None:
    os.environ |= {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": str(rank)}
    os.environ["MASTER_PORT"] = open(f"{out}/port").read()
    assert cli.main(["link", f"--out={out}/link.json", *SMALL, "bench.warmup=1", "bench.repeats=3"]) == 0


def test_each_collective_is_timed_with_the_bytes_each_process_sends(tmp_path):
    with socket.socket() as s:  # a free port for the process group's store
        s.bind(("127.0.0.1", 0))
        (tmp_path / "port").write_text(str(s.getsockname()[1]))
    spawn_two(_two_processes, str(tmp_path), timeout=120)
    found = json.loads((tmp_path / "link.json").read_text())
    assert found["processes"] == 2 and found["shape"] == [64, 8 * 8 * 8]  # hidden by 8 channels of 8 x 8
    elements = 64 * 512
    sent = {c["name"]: c["bytes"] for c in found["collectives"]}
    # each process sends the half it does not own (reduce, all-gather: fp32 on the CPU), the all-reduce twice that
    assert sent == {"reduce": elements * 4 // 2, "all-gather": elements * 4 // 2, "all-reduce": elements * 4}
    assert all(len(c["ms"]) == 3 and min(c["ms"]) > 0 for c in found["collectives"])


def test_the_document_table_names_each_collective_and_what_each_way_sends():
    times = {"reduce": [6.7, 6.8, 6.6], "all-gather": [4.0, 4.1, 3.9], "all-reduce": [12.7, 12.8, 12.6]}
    sent = {"reduce": 2_147_483_648, "all-gather": 1_073_741_824, "all-reduce": 4_294_967_296}
    data = {"processes": 2, "device": "x", "shape": [16384, 65536]}
    data["collectives"] = [{"name": n, "role": f"role of {n}", "bytes": sent[n], "ms": t} for n, t in times.items()]
    text = "\n".join(link.summary_lines(data))
    assert "the head's 16384 × 65536 weight" in text and "(median [min–max] of 3;" in text
    assert "| reduce | role of reduce | 6.70 [6.60–6.80] | 2.15 | 321 |" in text  # 2.15 GB in 6.7 ms
    assert "| all-reduce | role of all-reduce | 12.7 [12.6–12.8] | 4.29 | 338 |" in text
    assert "A step of `off` sends the all-reduce, 12.7 ms of the link by itself" in text  # the ways' own (sharing.py)
    assert "; a step of `blocks` sends the reduce and the all-gather, 10.7 ms of the link by themselves." in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["device=cpu"], "error: python -m detector link: give --out=<file.json> for the times\n"),
        (["--out=x.json", "device=cpu"], "error: python -m detector link needs 2 processes or more"),
    ],
)
def test_a_wrong_call_is_refused_in_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    assert cli.main(["link", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and not (tmp_path / "x.json").exists()


def link_times() -> link.LinkTimes:
    collectives = [{"name": "reduce", "role": "blocks: the fp32 gradients", "bytes": 4096, "ms": [0.5, 0.75, 1.0]}]
    return link.LinkTimes(processes=2, device="cpu", shape=[64, 512], collectives=collectives)


def test_the_links_times_are_one_record_written_and_read_again(tmp_path):
    link_times().write(tmp_path / "link.json")
    assert link.read_link(tmp_path / "link.json") == link_times()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written atomically: no temporary left
    old = link_times().to_json()
    del old["version"]  # version 1, as link.main writes it: read as it is
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert link.read_link(tmp_path / "old.json") == link_times()


def test_a_damaged_links_times_are_refused_in_one_line_naming_the_file_and_field(tmp_path):
    data = link_times().to_json()
    data["collectives"][0]["ms"][1] = "fast"
    (tmp_path / "link.json").write_text(json.dumps(data))
    with pytest.raises(link.RecordError) as err:
        link.read_link(tmp_path / "link.json")
    assert (
        str(err.value) == f"{tmp_path}/link.json.collectives[0].ms[1] is 'fast', expected a finite number in [0, 1e15]"
    )
