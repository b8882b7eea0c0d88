"""The 2-GPU sharding table and its verdict, from summaries written by hand."""

import json

from detector.bench import sharding


def summary(world_size: int, step_ms: float, losses: list[float]) -> dict:
    return {
        "world_size": world_size,
        "step_ms": step_ms,
        "images_per_s": 1024 * world_size / step_ms * 1e3,
        "peak_memory_gib": 30.0,
        "history": [(len(losses), sum(losses) / len(losses))],  # one log window's mean
        "losses": losses,  # every step's
    }


def test_the_table_and_the_three_percent_rule(tmp_path):
    runs = {"1gpu": summary(1, 100, [1.0, 0.5]), "off": summary(2, 110, [1.0, 0.5])}
    runs |= {"blocks": summary(2, 100, [1.0, 0.5]), "fsdp2": summary(2, 102, [1.0, 0.5001])}
    for name, s in runs.items():
        (tmp_path / name / "seed_scale" / "padded").mkdir(parents=True)
        (tmp_path / name / "seed_scale" / "padded" / "summary.json").write_text(json.dumps(s))
    found = sharding.read_summaries(tmp_path)
    text = sharding.table(found)
    assert "| blocks | 2 | 100.0 | 20480 | 30.0 | 100.0% | 0.0e+00 |" in text
    assert "| fsdp2 | 2 | 102.0 |" in text and "2.0e-04 |" in text  # 0.5001 against 0.5
    assert "FSDP2 becomes the default" in sharding.verdict(found)  # blocks 2 % faster: not enough
    found["fsdp2"]["step_ms"] = 104
    assert "keep ShardedBlocks" in sharding.verdict(found)


def test_losses_compare_step_by_step_and_by_log_window_where_a_summary_has_no_steps():
    base, other = summary(2, 100, [1.0, 0.5]), summary(2, 100, [1.0001, 0.4999])
    assert "| other | 2 | 100.0 | 20480 | 30.0 | - | 2.0e-04 |" in sharding.table({"off": base, "other": other})
    del other["losses"]  # an earlier run's summary: the windows' means, here equal
    assert "| other | 2 | 100.0 | 20480 | 30.0 | - | 0.0e+00 |" in sharding.table({"off": base, "other": other})
