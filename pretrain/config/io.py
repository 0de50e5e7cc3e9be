"""Typed config machinery: YAML presets and dotted overrides into keyword-only dataclasses.

One config system for the whole project. Dataclasses stay plain: this module walks
their type hints to validate input, so a wrong key or type fails with the key, the file it came
from and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A user mistake in a config file or an override; the message says what to change."""


class Sources:
    """Where each key came from: a default (the YAML file) and the dotted paths set on the command line."""

    def __init__(self, default: str | None, overridden: set[str] | None = None):
        self.default, self.overridden = default, set(overridden or ())

    def for_path(self, path: str) -> str | None:
        bare = path.split("[", 1)[0]
        if any(bare == o or bare.startswith(o + ".") for o in self.overridden):
            return "command line"
        return self.default

    def for_error(self, path: str, message: str) -> str | None:
        """Where the value that `message` (a dataclass's own check of section `path`) is about came
        from: the command line when the message names a key set there under `path`, else the
        default. The section's own path says only where the section came from, and a section from
        the preset file can hold a value from the command line."""
        bare = path.split("[", 1)[0]
        inside = [o for o in self.overridden if not bare or o == bare or o.startswith(bare + ".")
                  or bare.startswith(o + ".")]
        for o in sorted(inside, key=len, reverse=True):
            if o in message or re.search(rf"\b{re.escape(o.rsplit('.', 1)[-1])}\b", message):
                return "command line"
        return self.for_path(path)

    def __str__(self) -> str:
        return str(self.default)


def _where(path: str, source) -> str:
    if isinstance(source, Sources):
        source = source.for_path(path)
    return f"'{path}'" + (f" (from {source})" if source else "")


def _closest(key: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{match[0]}'?"
    return f"; valid keys: {', '.join(sorted(candidates))}" if candidates else ""


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str, source: str | None) -> Any:
    """Check `value` against type hint `tp`, converting YAML scalars/lists where lossless."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(path, source)} must be a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, path=path, source=source)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path, source)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{_where(path, source)} expects {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{_where(path, source)} must be one of {', '.join(map(repr, choices))}, got {value!r}"
                + _closest(str(value), [str(c) for c in choices])
            )
        return value
    if origin in (list, tuple):
        item_tp = (get_args(tp) or (Any,))[0]
        if isinstance(value, str) and hasattr(item_tp, "list_from_text"):
            # a shorthand the item type reads (data.sources=shards/train, a comma list, globs)
            try:
                value = item_tp.list_from_text(value)
            except ValueError as err:
                raise ConfigError(f"{_where(path, source)}: {err}") from err
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(path, source)} expects a list ({_type_name(tp)}), got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{_where(path, source)} expects {len(args)} items, got {len(value)}")
            return tuple(_convert(v, a, f"{path}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{path}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(path, source)} expects a mapping, got {value!r}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {
            _convert(k, key_tp, f"{path}.{k}", source): _convert(v, val_tp, f"{path}.{k}", source)
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{_where(path, source)} expects a bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{_where(path, source)} expects an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads `1e-3` (no dot) as a string; accept it where a float is expected.
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
        raise ConfigError(f"{_where(path, source)} expects a float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{_where(path, source)} expects a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{_where(path, source)} expects {_type_name(tp)}, got {value!r}")


def from_dict(cls: type, data: dict, *, path: str = "", source: str | None = None):
    """Build dataclass `cls` from a plain mapping, validating every key and type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            hint = _closest(str(key), list(fields))
            if "did you mean" in hint and path:
                hint = hint.replace("'", f"'{path}.", 1)
            raise ConfigError(f"unknown key {_where(full, source)}" + hint)
        kwargs[key] = _convert(value, hints[key], full, source)
    missing = [
        name for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = f" in {path}" if path else ""
        raise ConfigError(f"missing required key(s) {', '.join(missing)}{where}" + (f" (from {source})" if source and str(source) != 'None' else ""))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        src = source.for_error(path, str(err)) if isinstance(source, Sources) else source
        raise ConfigError(f"invalid {cls.__name__}{' at ' + path if path else ''}" + (f" (from {src})" if src else "") + f": {err}") from err


def to_dict(obj: Any) -> Any:
    """Dataclass (nested) to plain YAML-able data; tuples become lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


class _Dumper(yaml.SafeDumper):
    """Block style for sections, flow style for lists of scalars (`betas: [0.9, 0.95]`)."""


def _represent_list(dumper, data):
    flow = all(not isinstance(v, (list, dict)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def to_yaml(obj: Any) -> str:
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`model.num_layers=4` -> (['model', 'num_layers'], 4); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.path=value (for example model.num_layers=4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}': value is not valid YAML ({err})") from err
    return key.split("."), value


def _paths_with_leaf(cls: type, leaf: str, prefix: str = "") -> list[str]:
    """Every dotted key of dataclass tree `cls` whose last part is `leaf` (train.warmup_steps is
    optim.warmup_steps: a key given in the wrong section)."""
    found = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.name == leaf:
            found.append(path)
        if dataclasses.is_dataclass(hints.get(f.name)):
            found += _paths_with_leaf(hints[f.name], leaf, path)
    return found


def apply_overrides(cls: type, data: dict, overrides: list[str], overridden: set[str] | None = None) -> dict:
    """Set dotted overrides into the raw mapping, checking each path against `cls` first.
    The dotted paths set are added to `overridden` (for error messages)."""
    data = dict(data)
    overridden = set() if overridden is None else overridden
    for text in overrides:
        parts, value = parse_override(text)
        node, node_cls, prefix = data, cls, []
        for i, part in enumerate(parts):
            prefix.append(part)
            names = [f.name for f in dataclasses.fields(node_cls) if f.init] if dataclasses.is_dataclass(node_cls) else None
            if names is not None and part not in names:
                elsewhere = _paths_with_leaf(cls, parts[-1]) if i == len(parts) - 1 else []
                if elsewhere:  # the right key in another section
                    closest = f"; did you mean '{elsewhere[0]}'?"
                elif "did you mean" in _closest(part, names):
                    closest = _closest(part, names).replace("'", "'" + ".".join(prefix[:-1]) + ("." if len(prefix) > 1 else ""), 1)
                else:
                    closest = _closest(part, names)
                raise ConfigError(f"unknown key {_where('.'.join(prefix), 'command line')}" + closest)
            if i == len(parts) - 1:
                node[part] = value
                overridden.add(".".join(parts))
                break
            hint = typing.get_type_hints(node_cls)[part] if names is not None else None
            child = node.get(part)
            if child is None or not isinstance(child, dict):
                if not (hint is not None and dataclasses.is_dataclass(hint)) and not isinstance(child, dict):
                    joined = ".".join(prefix)
                    raise ConfigError(f"override '{text}': '{joined}' is not a section")
                child = {} if child is None else child
            node[part] = child = dict(child)
            node, node_cls = child, hint
    return data


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"config file not found: {path}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    return data
