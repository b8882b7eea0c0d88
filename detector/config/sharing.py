"""The ways the processes of a run share the model (``train.shard_optimizer``), each named once, here, in the order
the scaling table shows them: the configuration takes its choices from ``WAYS``, the training step builds the class
each names (detector/train/distributed/sharding/), the scaling table runs and judges them (detector/bench/sharding.py)
and the link's timing says which collectives each sends (detector/bench/link.py). docs/training.md ("Several GPUs") says
what each sends and when.

A way's ``kind``: ``reference``, plain DDP, against which the others' losses are held; ``ours``, which stays only where
it is faster than the best of ``torch``'s own engines.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Way:
    name: str  # train.shard_optimizer's value
    # its class in detector/train/distributed/sharding/: "module.Class", imported as a run takes the way
    implementation: str
    kind: str  # reference, ours or torch
    sends: tuple[str, ...]  # the collectives of the link's timing (detector/bench/link.py) that its step sends
    description: str


WAYS: dict[str, Way] = {
    way.name: way
    for way in (
        Way(
            "off",
            "replicated.AllReduced",
            "reference",
            ("all-reduce",),
            "DDP for the trunk, EarlyAllReduce for the head's blocks: every process updates the whole model",
        ),
        Way(
            "blocks",
            "blocks.ShardedBlocks",
            "ours",
            ("reduce", "all-gather"),
            "ZeRO stage 1 for the head's blocks (reduce onto the owner, all-gather under the next forward), DDP for "
            "the trunk",
        ),
        Way(
            "fsdp2",
            "fully_sharded.FullyShardedModel",
            "torch",
            (),
            "torch's FSDP2: parameters, gradients and optimizer state sharded",
        ),
        Way(
            "zero",
            "zero.ZeroOverDDP",
            "torch",
            (),
            "torch's ZeRO stage 1: ZeroRedundancyOptimizer over DDP of the whole model",
        ),
    )
}


def of_kind(kind: str) -> list[str]:
    """The names of the ways of ``kind``, in the registry's order."""
    return [name for name, way in WAYS.items() if way.kind == kind]
