"""The training step's speed options on a GPU: each gives the losses of the plain eager step."""

import pytest
import torch
from train_helpers import TINY

from detector.bench.step import device_batch
from detector.config.schema import load_config
from detector.train.run.step import TrainStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the speed options are CUDA's: no GPU here")
PLAIN = ["train.fused_blocks=0", "train.fused_pool=false", "train.cuda_graphs=false", "train.channels_last=false"]


def step_losses(*overrides, steps=6) -> list[float]:
    cfg = load_config([*TINY, "model.channels=[4,16,16]", "data.image_size=64", *overrides], announce=None)
    device = torch.device("cuda")
    step = TrainStep(cfg, device)
    batch = device_batch(cfg, "padded", device)
    return [step(batch).item() for _ in range(steps)]


@pytest.mark.parametrize(
    "options",
    [
        ["train.fused_blocks=2"],
        ["train.fused_blocks=2", "train.channels_last=true"],
        ["train.fused_pool=true"],
        ["train.fused_blocks=2", "train.fused_pool=true", "train.channels_last=true"],
        ["train.cuda_graphs=true"],
    ],
)
def test_speed_options_keep_the_losses(options, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # cuDNN in full fp32, as the fused kernels
    plain = step_losses(*PLAIN)
    fast = step_losses(*PLAIN, *options)
    # the fused kernels and cuDNN sum in other orders (fp32): a few steps keep the losses within 1e-4
    assert fast == pytest.approx(plain, rel=1e-4, abs=1e-5)
