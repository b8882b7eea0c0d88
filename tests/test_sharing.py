"""The ways of sharing (detector/config/sharing.py), named once: the configuration, the training step's
classes, the scaling table and the link read them from the registry."""

import importlib
from dataclasses import fields, replace

from detector.bench import link, sharding
from detector.config.schema import ReportConfig, TrainConfig
from detector.config.sharing import WAYS, of_kind
from detector.train.distributed import sharding as sharing_classes
from detector.train.observe.summary import TrainingSummary


def test_each_way_names_one_class_and_each_class_one_way():
    classes = [sharing_classes.implementation(way) for way in WAYS.values()]
    assert all(issubclass(c, sharing_classes.Replicated) and c is not sharing_classes.Replicated for c in classes)
    modules = {way.implementation.rsplit(".", 1)[0] for way in WAYS.values()}
    found = {  # every class of the package's modules that shares a model
        c
        for m in modules
        for c in vars(importlib.import_module(f"detector.train.distributed.sharding.{m}")).values()
        if isinstance(c, type) and issubclass(c, sharing_classes.Replicated) and c is not sharing_classes.Replicated
    }
    assert len(set(classes)) == len(classes) and set(classes) == found
    assert {way.kind for way in WAYS.values()} <= {"reference", "ours", "torch"}
    assert len(of_kind("reference")) == 1


def test_the_configs_choices_are_the_registrys():
    choices = {f.name: f.metadata.get("choices") for c in (TrainConfig, ReportConfig) for f in fields(c)}
    assert choices["shard_optimizer"] == choices["sharding_modes"] == tuple(WAYS)
    assert ReportConfig().sharding_modes == list(WAYS)


def test_the_table_and_the_link_take_a_new_way_from_the_registry(monkeypatch):
    monkeypatch.setitem(WAYS, "ring", replace(WAYS["blocks"], name="ring", sends=("all-reduce",)))
    assert [r.name for r in sharding.plan(2, list(WAYS))] == ["1x", *(f"2x-{m}" for m in WAYS)]
    assert link.senders("all-reduce") == "off, ring"
    rates = {"ring": 120.0, "zero": 100.0}
    runs = {sharding.Run(2, m): TrainingSummary([], images_per_s=rate) for m, rate in rates.items()}
    assert "our `ring` is +20.0% against torch's best, `zero`: keep it." in "\n".join(sharding.verdicts(runs))
