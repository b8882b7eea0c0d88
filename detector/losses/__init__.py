"""GIoU loss strategies over dynamically shaped targets.

``STRATEGIES`` maps a name to a ``Strategy``: a callable ``(pred, targets) -> 0-dim loss`` that
consumes targets of ``strategy.layout``. Adding a strategy is: write one file that calls
``register(Strategy(...))``, and import it below. It then appears in ``make profile``, ``make bench``,
``make compare`` and the strategy tests without further edits. A strategy outside the package is named
``my_module:my_loss`` (or installed as an entry point of ``detector.strategies``) and found when first asked
for: ``get_strategy``, ``KnownStrategies`` (detector/losses/registry.py); ``per_box_loss`` makes one from a
loss per box.
"""

from detector.losses.contract import giou_loss_reference
from detector.losses.per_box import per_box_loss
from detector.losses.registry import STRATEGIES, KnownStrategies, Strategy, get_strategy, register

# Importing a strategy module registers it; the order here is the order of tables and plots.
from detector.losses import loop, concat, padded, compiled, triton_fused, cuda_fused, cuda_conditional, packed  # noqa: E402,F401  isort: skip
from detector.losses import packed_torch  # noqa: E402,F401  isort: skip
from detector.losses import torchvision_concat, torchvision_padded, nested, nested_compiled  # noqa: E402,F401  isort: skip

__all__ = [
    "STRATEGIES",
    "KnownStrategies",
    "Strategy",
    "get_strategy",
    "giou_loss_reference",
    "per_box_loss",
    "register",
]
