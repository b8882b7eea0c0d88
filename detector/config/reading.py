"""Reading the configuration's values and checking them: the rule a field declares beside its default (``ranged``:
its range or choices; ``path``: it names a file), YAML files and ``key=value`` overrides read as text, and every value
checked against its field's rule. The settings themselves, and the order their layers merge in, are
detector/config/schema.py's.

A path-valued field takes an override's text after the ``=`` as written: a ``#``, spaces and quotes inside a file's
name are the name's, not YAML's. A field that takes words takes them as written, in a file, an override and a list
alike (``WordsLoader``): ``train.shard_optimizer=off`` is the word off.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import MISSING, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from detector.errors import ConfigError

STRATEGY = "a registered strategy"  # choices entry: any name in detector.losses.STRATEGIES


def path(default: str) -> Any:
    """A dataclass field that names a file or folder: an override's value is taken as written, not as YAML."""
    return field(default=default, metadata={"path": True})


def ranged(default: Any, low: float | None = None, high: float | None = None, choices: tuple = ()) -> Any:
    """A dataclass field with its allowed values, checked at load (check_values); for a list, each item's."""
    metadata = {"low": low, "high": high, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class WordsLoader(yaml.SafeLoader):
    """YAML as the configuration reads it, files and overrides alike: true and false are its only booleans (YAML
    1.2), so that off, on, yes and no stay the words written where a field takes words (``train.shard_optimizer=off``,
    ``report.sharding_modes=[off,blocks]``; YAML 1.1 made them booleans, and a text field then held "False"); a
    boolean field still takes them (OmegaConf reads on as true there). As OmegaConf's own loader: 1e-3 is a number, a
    date is text, and a key given twice is refused."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if key.tag == "tag:yaml.org,2002:str" and key.value in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key.value}", key.start_mark
                )
            seen.add(key.value)
        return super().construct_mapping(node, deep=deep)


BOOL, FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
WordsLoader.yaml_implicit_resolvers = {
    first: [(tag, rule) for tag, rule in rules if tag not in (BOOL, "tag:yaml.org,2002:timestamp")]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
WordsLoader.add_implicit_resolver(BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
WordsLoader.add_implicit_resolver(  # YAML 1.2's numbers: an exponent needs no dot
    FLOAT, re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def read_yaml(text: str):
    return yaml.load(text, Loader=WordsLoader)


DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def parse_overrides(overrides: list[str], paths: Collection[str] = ()) -> DictConfig:
    """Dotlist overrides ``key.sub=value``, each checked so a typo gets one clear line. A value is YAML
    (``WordsLoader``), except for a key of ``paths``: its text is the path as written (``#`` and spaces included),
    less quotes around it."""
    cli, named = OmegaConf.create(), {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} has no '=': write key=value, e.g. data.batch_size=256")
        if not DOTTED_KEY.fullmatch(key):
            raise ConfigError(f"override {item!r}: {key!r} is not a key such as data.batch_size")
        if key in paths:
            named[key] = unquoted(value)
            if not named[key]:
                raise ConfigError(f"override {item!r}: {key} names a file or folder, and the name is empty")
            continue
        try:
            loaded = read_yaml(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: {value!r} is not a YAML value ({yaml_problem(err)})") from None
        OmegaConf.update(cli, key, loaded, merge=True)
    for key, value in named.items():  # in the order given: a later override of the same key wins
        OmegaConf.update(cli, key, value.replace("${", "\\${"), merge=True)  # ${ is a name's, not OmegaConf's
    return cli


def unquoted(value: str) -> str:
    """``value`` less the quotes around it where it is one quoted YAML string (``'my file.json'``), else as is."""
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        try:
            loaded = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return loaded if isinstance(loaded, str) else value
    return value


def path_keys(schema: type, prefix: str = "") -> set[str]:
    """The dotted keys of ``schema``'s path-valued fields (``path``)."""
    keys = set()
    for f in fields(schema):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(default):
            keys |= path_keys(type(default), f"{prefix}{f.name}.")
        elif f.metadata.get("path"):
            keys.add(prefix + f.name)
    return keys


def load_yaml(path: Path) -> DictConfig:
    try:
        layer = read_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(err)}") from None
    if layer is not None and not isinstance(layer, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys (e.g. train: {{steps: 10}}), got a list")
    return OmegaConf.create(layer or {})


def yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(err, 'problem', None) or str(err).splitlines()[0]}{where}"


def check_values(cfg: DictConfig, schema: type, strategies: Collection[str] | None = None, prefix: str = "") -> None:
    """Every field of ``schema`` against its ``ranged`` rule; raises ConfigError naming the first bad one."""
    for f in fields(schema):
        name, value = prefix + f.name, cfg[f.name]
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(default):
            check_values(value, type(default), strategies, name + ".")
            continue
        if "low" not in f.metadata:
            continue
        for item in value if isinstance(value, ListConfig) else [value]:
            allowed = out_of_range(item, **f.metadata, strategies=strategies)
            if allowed:
                shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
                raise ConfigError(f"{name}={shown!r} is out of range: allowed {allowed}")


def out_of_range(value, low, high, choices, strategies) -> str | None:
    """What is allowed, if ``value`` is not; None if it is."""
    if choices:
        names = [c for c in choices if c != STRATEGY]
        if STRATEGY in choices and strategies is not None:
            if value in strategies:  # the registry's collection, which resolves a strategy from outside (module:fn)
                return None
            names += list(strategies)
        elif STRATEGY in choices:
            return None  # no registry to check against
        return None if value in names else f"one of {', '.join(names)}"
    if (low is None or value >= low) and (high is None or value <= high):
        return None
    if high is None:
        return f">= {low}"
    return f"in [{low}, {high}]"
