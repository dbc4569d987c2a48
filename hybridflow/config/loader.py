"""YAML <-> typed config, `key=value` overrides, and cross-field validation.

Every error names the dotted key path (`actor.optim.lr`) and, for a typo, the
nearest valid key, so a user can fix a 40-line YAML file from one message.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hybridflow.errors import ConfigError
from hybridflow.config.schema import Config, LogProbConfig
from hybridflow.config.validate import validate
from hybridflow.common import nearest_name, shown_value

__all__ = ["ConfigError", "apply_overrides", "dump_config", "from_dict", "load_config", "load_config_data", "to_dict"]

# A config holds a few hundred values; a file whose aliases expand to more is an alias bomb ("billion laughs").
MAX_VALUES = 100_000


# Keys that moved to the role that reads them: the old path is an unknown key whose message names the new one.
MOVED = {f"rollout.{f.name}": f"actor.{f.name}" for f in dataclasses.fields(LogProbConfig)}


def _nearest(name: str, choices: typing.Iterable[str]) -> str:
    match = nearest_name(name, choices)
    return f" (did you mean '{match}'?)" if match else ""


def _unknown_key(path: str, key: str, choices: typing.Iterable[str]) -> ConfigError:
    if path in MOVED:
        return ConfigError(path, f"unknown key (did you mean '{MOVED[path]}'? it moved to the role that reads it)")
    return ConfigError(path, f"unknown key{_nearest(key, choices)}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`; only int/str -> float is converted."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping for section {_type_name(tp)}, got {shown_value(value)}")
        return from_dict(tp, value, path)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, "must not be null")
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = _nearest(value, [str(c) for c in choices]) if isinstance(value, str) else ""
            raise ConfigError(path, f"{shown_value(value)} is not one of {list(choices)}{hint}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {shown_value(value)}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - a schema annotation this loader does not know
        raise TypeError(f"{path}: unsupported annotation {tp!r}")
    raise ConfigError(path, f"expected {_type_name(tp)}, got {type(value).__name__} {shown_value(value)}")


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass `cls` from a plain mapping, rejecting unknown keys."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            raise _unknown_key(_join(path, str(key)), str(key), names)
        kwargs[key] = _convert(value, hints[key], _join(path, key))
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """Plain-data form of a config, suitable for YAML/JSON."""
    return dataclasses.asdict(cfg)


def _parse_override(item: str) -> tuple[list[str], str]:
    if "=" not in item:
        raise ConfigError("", f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError("", f"override {item!r} has an empty key")
    return key.strip().split("."), raw


def apply_overrides(data: dict, overrides: typing.Sequence[str], cls: type = Config) -> dict:
    """Apply `a.b.c=value` overrides to a plain mapping, guided by the schema.

    Values are parsed as YAML (`3`, `1e-5`, `true`, `[0, 1]`, `null`) except
    for string fields, which keep the raw text (so `experiment=001` stays
    "001"). Unknown keys fail here, with the nearest valid key.
    """
    for item in overrides:
        keys, raw = _parse_override(item)
        node, tp, path = data, cls, ""
        for i, key in enumerate(keys):
            path = _join(path, key)
            hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
            if key not in hints:
                raise _unknown_key(path, key, hints)
            tp = hints[key]
            if i == len(keys) - 1:
                try:
                    node[key] = raw if _is_str(tp) else yaml.safe_load(raw)
                except yaml.YAMLError as exc:
                    why = str(getattr(exc, "problem", None) or exc).splitlines()[0]
                    raise ConfigError(path, f"cannot read the value {raw!r} ({why})") from None
            else:
                tp = _section_type(tp)
                if tp is None:
                    raise ConfigError(path, f"is a value, not a section; cannot set {item!r}")
                if node.get(key) is None:  # an optional section left unset: start it
                    node[key] = {}
                node = node[key]
                if not isinstance(node, dict):
                    raise ConfigError(path, "is not a mapping in the YAML file")
    return data


def _section_type(tp: Any) -> Any:
    """The dataclass of a section annotation (`Foo` or `Optional[Foo]`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _is_str(tp: Any) -> bool:
    """A field whose override keeps its raw text: a string, or a choice of strings (so that
    `trainer.resume=yes` is refused as 'yes', not as YAML's True)."""
    if tp is str:
        return True
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in args)
    return typing.get_origin(tp) in (Union, types.UnionType) and str in args


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, refusing a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {shown_value(key_node.value)} is given twice (first on line "
                        f"{lines[key_node.value]})", key_node.start_mark)
                lines[key_node.value] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _expanded_size(data: Any, path: Path) -> int:
    """How many values `data` holds with every alias expanded; each shared node is counted once, so an
    alias bomb is measured without being expanded."""
    sizes: dict[int, int] = {}

    def size(obj: Any) -> int:
        if not isinstance(obj, (dict, list)):
            return 1
        if id(obj) in sizes:
            if sizes[id(obj)] < 0:
                raise ConfigError("", f"{path} is not a config: an alias refers to the anchor it sits in "
                                      "(a value that contains itself)")
            return sizes[id(obj)]
        sizes[id(obj)] = -1
        items = [v for kv in obj.items() for v in kv] if isinstance(obj, dict) else obj
        sizes[id(obj)] = 1 + sum(size(v) for v in items)
        return sizes[id(obj)]

    return size(data)


def _read_yaml(path: Path) -> dict:
    """The mapping in the YAML file at `path`; every way a file can fail to be one is a one-line ConfigError."""
    if path.is_dir():
        raise ConfigError("", f"{path} is a directory, not a YAML config file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError("", f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x}); a config is a "
                              "YAML text file") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
        size = _expanded_size(data, path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        raise ConfigError("", f"{where}: not valid YAML: {exc.problem or exc.context}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError("", f"{path} is nested too deeply to be a config") from None
    if size > MAX_VALUES:
        raise ConfigError("", f"{path} is too large: its aliases expand to {size:,} values (a config holds a few "
                              f"hundred; the limit is {MAX_VALUES:,}): an alias bomb?")
    if data is not None and not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping at the top level, not a {type(data).__name__}")
    return data or {}


def load_config_data(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> dict:
    """The raw mapping of a YAML config file (empty when `path` is None) with `overrides` applied, before
    typing and validation (what `load_config` types; the planner rewrites its layouts first)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file not found: {path}")
        data = _read_yaml(path)
    return apply_overrides(data, overrides)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                validate_config: bool = True) -> Config:
    """Load a YAML file (or only defaults when `path` is None), apply overrides, validate."""
    cfg = from_dict(Config, load_config_data(path, overrides))
    if validate_config:
        validate(cfg)
    return cfg


def dump_config(cfg: Config, path: str | Path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
