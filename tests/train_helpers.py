"""The tiny training configuration the training tests share (tests/train/, tests/test_faults.py)."""

from detector.config import load_config

# A detector of a few thousand parameters on 32 px images: a step takes milliseconds.
TINY = [
    "preset=cpu",
    "data.image_size=32",
    "data.max_boxes=16",
    "data.batch_size=4",
    "data.tail_fraction=0.0",
    "model.channels=[4,8]",
    "model.hidden=32",
    "train.lr=0.01",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.eval_batches=1",
]


def tiny_cfg(out_dir, *overrides):
    return load_config([*TINY, f"train.out_dir={out_dir}", *overrides], announce=None)


def losses(summaries) -> list[float]:
    return [loss for s in summaries for _, loss in s["history"]]
