"""The generic builder: plain data (YAML, dicts) -> typed frozen dataclasses.

``build_dataclass`` reads a dataclass's type hints, so a field added to a spec is
type-checked with no extra code; every error is a ``ConfigError`` whose path names
the field. ``plain`` is the reverse (dataclass -> YAML-ready data). This module
knows no job section: ``config.spec`` (table settings), ``config.streams`` and
``config.loader`` (whole jobs) build on it, so none of them imports another to
build a section. The rules are listed in ``config.loader``'s docstring.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import reprlib
import types
from collections.abc import Iterable, Mapping, Sequence
from datetime import date
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from estuary.config.errors import ConfigError

__all__ = [
    "REST",
    "build_dataclass",
    "deep_merge",
    "describe_value",
    "join_path",
    "plain",
    "suggest",
]

T = TypeVar("T")

_NoneType = type(None)
_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = 6
_repr.maxdict = 4


# ---------------------------------------------------------------------------
# Generic builder: dict -> dataclass, by type hints.
# ---------------------------------------------------------------------------


def join_path(path: str, key: str) -> str:
    """``path.key`` (``key`` at the top level)."""
    return f"{path}.{key}" if path else key


def suggest(word: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a near miss, else ``""``."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def foreign_key(
    path: str, key: str, own: Sequence[str], noun: str, owner: str, near: Iterable[str] = ()
) -> ConfigError:
    """The error for ``key`` in a section whose implementation declares ``own``:
    a near miss of ``near`` reads as a typo (``unknown key (did you mean
    'x'?)``), anything else as another implementation's (``not a field of stream
    kind 'nats' (its fields: subject, stream)``)."""
    hint = suggest(key, near)
    if hint:
        return ConfigError(f"{path}.{key}", f"unknown key{hint}")
    return ConfigError(f"{path}.{key}", f"not a {noun} of {owner} (its {noun}s: {', '.join(own)})")


def describe_value(value: Any) -> str:
    """How a wrong value reads in an error: ``str 'abc'``, ``bool True``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, list | tuple):
        return f"list {_repr.repr(list(value))}"
    return f"{type(value).__name__} {_repr.repr(value)}"


def _describe_type(tp: Any) -> str:
    """How an expected type reads in an error: ``int``, ``list of str``, ``int or null``."""
    origin = get_origin(tp)
    if tp is Any:
        return "any value"
    if tp is _NoneType:
        return "null"
    if tp is Path:
        return "str (a path)"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_describe_type(get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


class _TypeMismatch(ConfigError):
    """The value at ``path`` itself has the wrong type (not something inside it)."""


def _mismatch(tp: Any, value: Any, path: str) -> _TypeMismatch:
    return _TypeMismatch(path, f"expected {_describe_type(tp)}, got {describe_value(value)}")


@cache
def _hints(cls: type) -> dict[str, Any]:
    # spec.py uses ``from __future__ import annotations``; this evaluates the strings.
    return get_type_hints(cls)


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type ``tp`` and return it in its typed form."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path)
    if origin is Literal:
        allowed = get_args(tp)
        # Compare types too, so that True does not pass for Literal[1].
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        hint = suggest(value, [str(a) for a in allowed]) if isinstance(value, str) else ""
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(path, f"must be one of {choices}; got {describe_value(value)}{hint}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if value is None:  # an empty section: all defaults
            value = {}
        elif isinstance(value, tp):  # an already-built section (Python API): re-check it
            value = plain(value)
        if not isinstance(value, Mapping):
            raise _mismatch(tp, value, path)
        return build_dataclass(tp, value, path)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _mismatch(tp, value, path)
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _mismatch(tp, value, path)
        key_tp, value_tp = get_args(tp)
        out = {}
        for key, item in value.items():
            if key_tp is str and not isinstance(key, str):
                raise ConfigError(path, f"keys must be strings, got {describe_value(key)}")
            out[key] = _convert(value_tp, item, join_path(path, str(key)))
        return out
    return _convert_scalar(tp, value, path)


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    args = get_args(tp)
    arms = [a for a in args if a is not _NoneType]
    if value is None:
        if _NoneType in args:
            return None
        raise _mismatch(tp, value, path)
    if len(arms) == 1:  # the common ``X | None``
        try:
            return _convert(arms[0], value, path)
        except _TypeMismatch as err:
            if err.path != path:  # something inside the value is wrong: say what
                raise
            raise _mismatch(tp, value, path) from None  # name the whole union
    for arm in arms:
        try:
            return _convert(arm, value, path)
        except ConfigError:
            continue
    raise _mismatch(tp, value, path)


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(path, f"must be a finite number, got {value}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, date):  # YAML reads unquoted 2026-01-01 (and times) as dates
            return value.isoformat()
    elif tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
    else:
        raise TypeError(f"{path}: the loader does not support type {tp!r}")
    raise _mismatch(tp, value, path)


REST = "rest"
"""Field metadata key marking a section's *rest* field, e.g.
``field(default_factory=dict, metadata={REST: (), "yaml": False})`` (not a key
itself). The section's keys that are not its own fields are collected there (a
dict) instead of being refused, for the named implementation to declare and
check in the section's ``validate`` (a plugin optimizer's parameters, a stream
backend's fields); ``plain`` writes them back flat, so the YAML stays one flat
mapping. The metadata value lists keys ``plain`` always writes, as null when
unset (keys that were fields of the section before they moved to the rest
field, so data written then and now reads the same)."""


@cache
def _rest_field(cls: type) -> str | None:
    """The name of ``cls``'s rest field, if it has one."""
    for f in dataclasses.fields(cast(Any, cls)):
        if REST in f.metadata:
            return f.name
    return None


def build_dataclass(cls: type[T], data: Mapping[str, Any], path: str, **loader_fields: Any) -> T:
    """Build and validate dataclass ``cls`` from a mapping.

    Args:
        cls: a (frozen) dataclass whose fields are typed with the types above.
        data: the section's keys and values, e.g. from YAML.
        path: dotted path of the section, used in errors (``""`` for the top level).
        **loader_fields: values for fields marked ``metadata={"yaml": False}``.

    A dataclass with a ``normalise(data, path)`` classmethod gets its raw keys
    rewritten by it first (one key resolved into others, e.g. ``runtime.roles``).

    Raises:
        ConfigError: naming the field path of the first wrong key or value.
    """
    normalise = getattr(cls, "normalise", None)
    if callable(normalise):  # the section resolves aliases among its own keys first
        data = normalise(data, path)
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls)) if f.init}
    rest = _rest_field(cast(type, cls))
    keys = [name for name, f in fields.items() if f.metadata.get("yaml", True) and name != rest]
    others: dict[str, Any] = {}
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {describe_value(key)}")
        if key in keys:
            continue
        if key in fields and key != rest:
            raise ConfigError(join_path(path, key), "is set by the loader, not in the job file")
        if rest is None:
            raise ConfigError(join_path(path, key), f"unknown key{suggest(key, keys)}")
        others[key] = data[key]  # the implementation's own keys; its validate checks them

    hints = _hints(cast(type, cls))
    kwargs: dict[str, Any] = dict(loader_fields)
    if rest is not None:
        kwargs[rest] = others
    for name in keys:
        f = fields[name]
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], join_path(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(join_path(path, name), "required")
    obj = cls(**kwargs)

    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate(path)
        except ConfigError as err:
            # A root-level section validated with path "" writes ".field"; tidy it.
            if err.path.startswith("."):
                raise ConfigError(err.path[1:], err.reason) from None
            raise
    return obj


# ---------------------------------------------------------------------------
# Merging partial sections, and back to plain data.
# ---------------------------------------------------------------------------


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``; nested mappings merge key by key, null keeps base."""
    out = dict(base)
    for key, value in override.items():
        current = out.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            out[key] = deep_merge(current, value)
        elif isinstance(current, Mapping) and value is None:
            continue  # an empty section changes nothing
        else:
            out[key] = copy.deepcopy(value)
    return out


def plain(value: Any) -> Any:
    """``value`` as plain YAML-ready data: dataclasses (their YAML fields) become
    dicts, paths strings; containers are copied."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            if REST in f.metadata:  # flat, in the field's place
                others = getattr(value, f.name)
                out.update({name: others.get(name) for name in f.metadata[REST]})
                out.update(plain(others))
            elif f.metadata.get("yaml", True):
                out[f.name] = plain(getattr(value, f.name))
        return out
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return copy.deepcopy(value)
