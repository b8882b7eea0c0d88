"""The strategy registry: one name, one callable, one target layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from detector.losses.checks import check_targets
from detector.targets import LAYOUTS, Targets


@dataclass(frozen=True)
class Strategy:
    name: str
    layout: str  # which targets it consumes: "list", "padded" or "packed" (detector.targets)
    fn: Callable[[Tensor, Targets], Tensor]
    description: str  # one line, shown by `python -m detector strategies`
    # Why it cannot run on a device (e.g. "the extension is not built: run make setup"), or None if it can.
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    # Why its times on a device are not those of the code it is built for (an emulator), or None.
    emulated: Callable[[torch.device], str | None] = lambda device: None
    compiled: bool = False  # whether it runs through torch.compile (the "which strategy" table's compiled row)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"strategy {self.name!r}: layout must be one of {LAYOUTS}, got {self.layout!r}")

    def __call__(self, pred: Tensor, targets: Targets) -> Tensor:
        """The public entry: checks pred and targets once, then runs the strategy (which trusts them)."""
        check_targets(pred, targets)
        if targets.layout != self.layout:
            raise TypeError(
                f"strategy {self.name!r} takes {self.layout!r} targets, got {targets.layout!r} "
                f"(build them with detector.targets.make_targets(boxes_list, {self.layout!r}, max_boxes))"
            )
        reason = self.unavailable(pred.device)
        if reason:
            raise RuntimeError(f"strategy {self.name!r} cannot run on {pred.device}: {reason}")
        return self.fn(pred, targets)


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    if strategy.name in STRATEGIES:
        raise ValueError(f"strategy {strategy.name!r} is registered twice")
    STRATEGIES[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; valid strategies: {', '.join(STRATEGIES)}") from None
