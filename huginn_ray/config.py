"""Typed configs: dataclasses loaded from YAML, with dotted `key=value` overrides.

Every config in huginn_ray (training, data preparation) is a tree of small dataclasses (a field is a section,
a list or a scalar: no free-form mappings, so every key has a type and a docstring). This module turns
a YAML file plus command-line overrides into such a tree and refuses anything it does not recognise:

    cfg = load_config(TrainConfig, "configs/train/tiny_cpu.yaml", ["optim.lr=1e-3", "max_steps=20"])

Errors name the offending key with its full dotted path (`optim.lr`), so a typo never silently falls back
to a default.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key that cannot be accepted; the message names the dotted key."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, but `4e-5` is a float (YAML 1.1 wants `4.0e-5`; the Huginn YAMLs use `4e-5`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = parse_yaml(path.read_text())
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `a.b.c=value` strings to a nested dict; values are parsed as YAML (`[1, 2]`, `true`, `4e-5`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = parse_yaml(raw) if raw != "" else ""
    return data


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, checking every key and every value's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix + unknown[0]!r}; known keys here: {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(hints[name], value, prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {err}") from None


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                removed: dict[str, str] | None = None) -> T:
    """`removed`: dotted keys (or `key=value` choices) that no longer exist, each with what replaces it; a config
    naming one is refused with that message (instead of a bare "unknown key" or "not one of")."""
    data = apply_overrides(read_yaml(path) if path is not None else {}, overrides)
    for entry, replacement in (removed or {}).items():
        key, _, value = entry.partition("=")
        node = data
        for part in key.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT and (not value or str(node) == value):
            raise ConfigError(f"{entry} was removed: {replacement}")
    return from_dict(cls, data)


_ABSENT = object()


def to_dict(obj: Any) -> Any:
    """A plain, YAML/JSON-serialisable view of a config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; used for MLflow params."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _meant_sections(sections: list[type], keys: set[str]) -> list[type]:
    """Of several config sections a mapping matches none of, those it meant: the ones whose required keys it has,
    else the ones that have every key it has (so its error is that section's, naming the key)."""
    def required(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}

    meant = [cls for cls in sections if required(cls) <= keys]
    if len(meant) != 1:
        meant = [cls for cls in sections if keys <= {f.name for f in dataclasses.fields(cls)}]
    return meant


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = {}
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as err:
                errors[arg] = str(err)
        sections = [arg for arg in errors if dataclasses.is_dataclass(arg)]
        if isinstance(value, dict) and len(sections) > 1:  # the section it meant: the one whose required keys it has
            sections = _meant_sections(sections, set(value))
        if isinstance(value, dict) and len(sections) == 1:  # a mapping meant the section: its error names the key
            raise ConfigError(errors[sections[0]])
        raise ConfigError(next(iter(errors.values())) if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}: {value!r}")
            return tuple(_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(args, value)))
        item_type = args[0] if args else Any
        items = [_coerce(item_type, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp}")  # a programming error in a config class


# ---- value ranges, checked when a config loads ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Range:
    """An allowed interval for a numeric config value; None means unbounded. NaN is never inside."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if value != value:  # NaN
            return False
        if self.lo is not None and not (value > self.lo if self.lo_open else value >= self.lo):
            return False
        if self.hi is not None and not (value < self.hi if self.hi_open else value <= self.hi):
            return False
        return True

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi_open or self.hi is None else ']'}"


AT_LEAST_1 = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, lo_open=True)


def check_ranges(cfg: Any, ranges: dict[str, Range]) -> None:
    """Every dotted key in `ranges` that is set (not None) lies in its range; lists are checked item by item.
    The error names the dotted key (with the list index) and the allowed range."""
    for key, allowed in ranges.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part) if value is not None else None  # an optional section left out
        if value is None:
            continue
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for index, item in items:
            if item not in allowed:
                name = key if index is None else f"{key}[{index}]"
                raise ConfigError(f"{name}: must be in {allowed}, got {item!r}")
