"""Loading: YAML files (safe loader) and dotted ``section.key=value`` overrides into a
type-checked, validated ``JobConfig``, and back to YAML. Types are checked against each
field's annotation (``_coerce``); an unknown key is refused naming the keys its section
has."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from moetrain.config.errors import ConfigError
from moetrain.config.job import JobConfig


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept what float() accepts.
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, list):
            return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    else:  # pragma: no cover - only the types above are used in this file
        raise TypeError(f"unsupported config type {tp}")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A section's resolved field types (``get_type_hints`` evaluates every annotation string
    again on each call: most of a config load's time without the cache)."""
    return typing.get_type_hints(cls)


def _build_section(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; {prefix.rstrip('.') or 'top level'} "
                              f"has {', '.join(names)}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key}: expected a mapping of keys, got {value!r}")
            kwargs[key] = _build_section(hints[key], value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key])
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where the YAML broke and why (PyYAML's own message spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}: {problem}"


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["moe.top_k=2", "train.output_dir=x"]`` into a nested dict (YAML-typed values)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item!r}: an override is written section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse value {raw!r}{_yaml_problem(exc)}") from None
        _set_dotted(tree, key.lstrip("-"), value)
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML file (safe loader), apply dotted overrides, type-check and validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {str(path)!r}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: {path} is not valid YAML{_yaml_problem(exc)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections")
        tree = loaded
    tree = _merge(tree, parse_overrides(overrides or []))
    return _build_section(JobConfig, tree, "").validate()


def config_to_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
