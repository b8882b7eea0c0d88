"""A checkpoint's fingerprint against the run that resumes it (detector/train/checkpoints/state.py): a setting added
after the checkpoint was written is no difference at its default, and a difference where the run changes it."""

from detector.config.schema import load_config
from detector.train.checkpoints.state import differences, fingerprint


def test_a_setting_the_checkpoint_predates_is_no_difference_at_its_default():
    now = fingerprint(load_config(["preset=cpu"], announce=None), 1)
    older = {key: dict(value) if isinstance(value, dict) else value for key, value in now.items()}
    del older["data"]["over_max_boxes"], older["data"]["boxes"]  # written before these settings existed
    assert differences(older, now) == []
    changed = fingerprint(load_config(["preset=cpu", "data.over_max_boxes=fit"], announce=None), 1)
    assert differences(older, changed) == ["data.over_max_boxes: 'truncate' in the checkpoint, 'fit' now"]
    assert differences(now, fingerprint(load_config(["preset=cpu", "train.lr=0.5"], announce=None), 1)) == [
        "train.lr: 0.0003 in the checkpoint, 0.5 now"
    ]
