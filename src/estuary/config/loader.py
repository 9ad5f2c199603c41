"""Turns job files and dicts into the typed spec in ``estuary.config.spec``.

The builder reads each dataclass's type hints, so a field added to the spec is
type-checked here with no extra code. Every error is a ``ConfigError`` whose path
names the field::

    model.embedding.default.dimm: unknown key (did you mean 'dim'?)
    train.batch_size: expected int, got str 'abc'
    data.sources[0].format: must be one of 'criteo_tsv', 'csv', ...; got str 'tvs'

Rules the builder enforces (documented for users in ``docs/job-spec.md``):

* unknown keys are errors; fields with ``metadata={"yaml": False}`` are not keys;
* ``True``/``False`` are not ints, strings are never numbers, an int is a valid
  float (stored as float); floats must be finite;
* an empty section (``train:`` with nothing under it) means "all defaults";
* after a dataclass is built its ``validate(path)`` runs. Parents in ``spec.py``
  re-validate some children; that is harmless because ``validate`` only checks.

YAML is read with a ``yaml.SafeLoader`` subclass (so it never constructs Python
objects or runs code) that also rejects duplicate keys and reads ``1e-3`` as a
float, as YAML 1.2 does.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import reprlib
import types
from collections.abc import Iterable, Mapping, Sequence
from datetime import date
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

import yaml

from estuary.config.dataset import BatchSourceSpec
from estuary.config.errors import ConfigError
from estuary.config.spec import JobSpec, SourceSpec, TableSpec

__all__ = [
    "apply_overrides",
    "build_dataclass",
    "job_from_dict",
    "load_job",
    "merge_table_spec",
    "to_dict",
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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _suggest(word: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a near miss, else ``""``."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe_value(value: Any) -> str:
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
    return _TypeMismatch(path, f"expected {_describe_type(tp)}, got {_describe_value(value)}")


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
        hint = _suggest(value, [str(a) for a in allowed]) if isinstance(value, str) else ""
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(path, f"must be one of {choices}; got {_describe_value(value)}{hint}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if value is None:  # an empty section: all defaults
            value = {}
        elif isinstance(value, tp):  # an already-built section (Python API): re-check it
            value = to_dict(value)
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
                raise ConfigError(path, f"keys must be strings, got {_describe_value(key)}")
            out[key] = _convert(value_tp, item, _join(path, str(key)))
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


def build_dataclass(cls: type[T], data: Mapping[str, Any], path: str, **loader_fields: Any) -> T:
    """Build and validate dataclass ``cls`` from a mapping.

    Args:
        cls: a (frozen) dataclass whose fields are typed with the types above.
        data: the section's keys and values, e.g. from YAML.
        path: dotted path of the section, used in errors (``""`` for the top level).
        **loader_fields: values for fields marked ``metadata={"yaml": False}``.

    Raises:
        ConfigError: naming the field path of the first wrong key or value.
    """
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls)) if f.init}
    keys = [name for name, f in fields.items() if f.metadata.get("yaml", True)]
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {_describe_value(key)}")
        if key in keys:
            continue
        if key in fields:
            raise ConfigError(_join(path, key), "is set by the loader, not in the job file")
        raise ConfigError(_join(path, key), f"unknown key{_suggest(key, keys)}")

    hints = _hints(cast(type, cls))
    kwargs: dict[str, Any] = dict(loader_fields)
    for name in keys:
        f = fields[name]
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "required")
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
# Whole jobs: cross-section checks, dict and file entry points.
# ---------------------------------------------------------------------------


def _check_schema(job: JobSpec) -> None:
    schema = job.data.schema
    seen: dict[str, str] = {}
    for role in ("dense", "sparse"):
        for i, column in enumerate(getattr(schema, role)):
            where = f"data.schema.{role}[{i}]"
            if column == schema.label:
                raise ConfigError(where, f"{column!r} is the label column")
            if column in seen:
                raise ConfigError(where, f"{column!r} is already listed in {seen[column]}")
            seen[column] = f"data.schema.{role}"
    for column in schema.transforms:
        if column not in seen:
            raise ConfigError(
                f"data.schema.transforms.{column}",
                f"not a column in data.schema.dense or data.schema.sparse{_suggest(column, seen)}",
            )
    known = _known_columns(job)
    _check_features(job, seen, known)
    _check_columns_exist(job, known)


# criteo_tsv's column names when a source gives none (data/formats/criteo_tsv.py).
_CRITEO_COLUMNS = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]


def _source_columns(source: SourceSpec | BatchSourceSpec) -> list[str] | None:
    """The columns one source's rows have, or ``None`` when only its data can tell
    (a header line, Parquet or JSON keys)."""
    stream = getattr(source, "stream", None)
    if stream is not None:
        columns, fmt = stream.columns, stream.format
    else:
        columns, fmt = source.columns, source.format
    if columns is not None:
        return list(columns)
    return list(_CRITEO_COLUMNS) if fmt == "criteo_tsv" else None


def _trained_sources(job: JobSpec) -> list[SourceSpec | BatchSourceSpec]:
    """Every source whose rows are trained (a join's right side is only looked up)."""
    data = job.data
    if data.dataset is None:
        return list(data.sources)
    out: list[SourceSpec | BatchSourceSpec] = []
    for stream in data.dataset.streams.values():
        right = stream.join.right if stream.join is not None else None
        out.extend(source for source in stream.sources if source.name != right)
    return out


def _known_columns(job: JobSpec) -> list[str] | None:
    """Every column the trained sources can provide, or ``None`` when some source's
    columns are only known from its data."""
    known: dict[str, None] = {}
    sources = _trained_sources(job)
    for source in sources:
        columns = _source_columns(source)
        if columns is None:
            return None
        known.update(dict.fromkeys(columns))
    return list(known) if sources else None


def _check_columns_exist(job: JobSpec, known: list[str] | None) -> None:
    """Schema columns and join columns name real columns, where the job file alone
    tells which columns the sources have (declared ``columns``, or criteo_tsv's)."""
    schema = job.data.schema
    if known is not None:
        for role in ("dense", "sparse"):
            for i, column in enumerate(getattr(schema, role)):
                if column not in known:
                    raise ConfigError(
                        f"data.schema.{role}[{i}]",
                        f"{column!r} is not a column of the sources{_suggest(column, known)}",
                    )
    dataset = job.data.dataset
    if dataset is None:
        return
    for stream_name, stream in dataset.streams.items():
        join = stream.join
        if join is None:
            continue
        by_name = {source.name: source for source in stream.sources}
        for side in ("left", "right"):
            columns = _source_columns(by_name[getattr(join, side)])
            if columns is None:
                continue
            for field_name in ("key", "time_column"):
                column = getattr(join, field_name)
                if column not in columns:
                    raise ConfigError(
                        f"data.dataset.streams.{stream_name}.join.{field_name}",
                        f"{column!r} is not a column of the {side} source "
                        f"{getattr(join, side)!r}{_suggest(column, columns)}",
                    )


def _check_features(job: JobSpec, seen: Mapping[str, str], known: list[str] | None) -> None:
    """Derived features: unique names, real input columns, no label leakage."""
    schema = job.data.schema
    names: dict[str, str] = {}
    for i, feature in enumerate(schema.features):
        where = f"data.schema.features[{i}]"
        if feature.name in seen:
            raise ConfigError(
                f"{where}.name", f"{feature.name!r} is already a column in {seen[feature.name]}"
            )
        if feature.name == schema.label:
            raise ConfigError(f"{where}.name", f"{feature.name!r} is the label column")
        if feature.name in names:
            raise ConfigError(
                f"{where}.name", f"{feature.name!r} is already declared at {names[feature.name]}"
            )
        names[feature.name] = where
        for j, column in enumerate(feature.columns):
            if column == schema.label:
                raise ConfigError(f"{where}.columns[{j}]", f"{column!r} is the label column")
            if known is not None and column not in known:
                raise ConfigError(
                    f"{where}.columns", f"{column!r} is not a column{_suggest(column, known)}"
                )


def _check_embedding(job: JobSpec) -> None:
    """Shared groups and per-table overrides name real features; overrides are valid."""
    schema = job.data.schema
    sparse = [*schema.sparse, *(feature.name for feature in schema.features)]
    embedding = job.model.embedding
    group_of: dict[str, str] = {}
    for group, members in embedding.shared.items():
        where = f"model.embedding.shared.{group}"
        if not members:
            raise ConfigError(where, "must list at least one sparse feature")
        if group in sparse and group not in members:
            raise ConfigError(where, f"names another sparse feature; {group!r} is not in the group")
        for i, feature in enumerate(members):
            if feature not in sparse:
                raise ConfigError(
                    f"{where}[{i}]",
                    f"{feature!r} is not a sparse feature (data.schema.sparse)"
                    + _suggest(feature, sparse),
                )
            if feature in group_of:
                raise ConfigError(
                    f"{where}[{i}]", f"{feature!r} is already in shared table {group_of[feature]!r}"
                )
            group_of[feature] = group

    names = [*sparse, *embedding.shared]
    for name, override in embedding.tables.items():
        where = f"model.embedding.tables.{name}"
        if name not in names:
            also = " or shared table (model.embedding.shared)" if embedding.shared else ""
            raise ConfigError(
                where, f"not a sparse feature (data.schema.sparse){also}{_suggest(name, names)}"
            )
        if name in group_of and name not in embedding.shared:
            group = group_of[name]
            raise ConfigError(
                where,
                f"reads shared table {group!r}; configure model.embedding.tables.{group} instead",
            )
        merge_table_spec(embedding.default, override, where)


def job_from_dict(data: Mapping[str, Any], base_dir: str | Path = Path(".")) -> JobSpec:
    """Build and validate a ``JobSpec`` from a plain dict (the Python API).

    Args:
        data: the job's sections, shaped like the YAML file.
        base_dir: folder that relative paths in the job resolve against.

    Raises:
        ConfigError: naming the field path of the first problem.
    """
    if not isinstance(data, Mapping):
        raise ConfigError("", f"a job must be a mapping of sections, got {_describe_value(data)}")
    # Copy so later changes to the caller's dict cannot leak into the spec.
    job = build_dataclass(JobSpec, copy.deepcopy(dict(data)), "", base_dir=Path(base_dir))
    _check_schema(job)
    _check_embedding(job)
    return job


class _JobYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads ``1e-3`` as a float."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found duplicate key {key_node.value!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) needs a dot in a float, so ``lr: 1e-3`` would be a string.
_JobYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_yaml(text: str, source: str, *, at_line: bool = True) -> Any:
    """Parse YAML text; a syntax error names ``source`` (and ``:line:column``)."""
    try:
        # A SafeLoader subclass: the same guarantees as yaml.safe_load (plain data only).
        return yaml.load(text, Loader=_JobYamlLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = source
        if at_line and mark is not None:
            where = f"{source}:{mark.line + 1}:{mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError("", f"{where}: invalid YAML: {problem}") from None


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """Read a YAML job file, apply ``dotted.key=value`` overrides, build and validate.

    Relative paths in the job resolve against the job file's folder (``base_dir``).

    Args:
        path: the job file.
        overrides: ``--set``-style overrides, applied in order before building,
            e.g. ``train.epochs=3``, ``model.params.top_mlp=[256,128]``,
            ``data.sources[0].path=x.tsv``. Values are read as YAML.

    Raises:
        ConfigError: naming the field path (and the override, if one caused it),
            or the file and line of a YAML syntax error.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"{file}: cannot read job file ({exc})") from None
    data = _parse_yaml(text, str(file))
    if data is None:
        raise ConfigError("", f"{file}: the job file is empty (it needs at least 'data.sources')")
    if not isinstance(data, dict):
        raise ConfigError(
            "", f"{file}: the top level must be a mapping of sections, got {_describe_value(data)}"
        )
    data = apply_overrides(data, overrides)
    try:
        return job_from_dict(data, base_dir=file.absolute().parent)
    except ConfigError as err:
        culprit = _override_for(err.path, overrides)
        if culprit is None:
            raise
        raise ConfigError(err.path, f"{err.reason} (from override {culprit!r})") from err


# ---------------------------------------------------------------------------
# Overrides: ``dotted.key[0].name=value``.
# ---------------------------------------------------------------------------

_PART = re.compile(r"^([^.\[\]=\s]+)((?:\[\d+\])*)$")


def _override_steps(key: str, override: str) -> list[str | int]:
    """``data.sources[0].path`` -> ``["data", "sources", 0, "path"]``."""
    steps: list[str | int] = []
    for part in key.split("."):
        match = _PART.match(part)
        if match is None:
            raise ConfigError(
                "",
                f"override {override!r}: bad key {key!r} "
                "(expected dotted.key=value, list items as key[0])",
            )
        steps.append(match.group(1))
        steps.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return steps


def _is_within(inner: str, outer: str) -> bool:
    """Whether field path ``inner`` is ``outer`` or lies inside it."""
    return inner == outer or inner.startswith((f"{outer}.", f"{outer}["))


def _override_for(path: str, overrides: Sequence[str]) -> str | None:
    """The last override that set ``path``, something inside it, or a section around it."""
    for override in reversed(overrides):
        key = override.partition("=")[0].strip()
        if path and (_is_within(path, key) or _is_within(key, path)):
            return override
    return None


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``dotted.key=value`` override applied in order.

    Missing mappings on the way are created; ``key[i]`` indexes a list, and
    ``i == len(list)`` appends. The value is parsed as YAML (``3``, ``[256, 1]``,
    ``{lr: 0.1}``, ``x.tsv``); an empty value is null.

    Raises:
        ConfigError: naming the override when it cannot be applied.
    """
    out = copy.deepcopy(dict(data))
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep:
            raise ConfigError("", f"override {override!r}: expected dotted.key=value")
        steps = _override_steps(key.strip(), override)
        value = _parse_yaml(raw.strip(), f"override {override!r}", at_line=False)
        _set_in(out, steps, value, override)
    return out


def _set_in(root: dict[str, Any], steps: list[str | int], value: Any, override: str) -> None:
    """Set ``root[steps[0]][steps[1]]... = value``, creating missing containers."""
    node: Any = root
    walked = ""
    for i, step in enumerate(steps):
        if isinstance(step, str):
            if not isinstance(node, dict):
                hint = " (index lists as key[0])" if isinstance(node, list) else ""
                reason = f"not a mapping; cannot set {step!r}{hint}"
                raise ConfigError(
                    walked, f"is {_describe_value(node)}, {reason} (override {override!r})"
                )
            here = _join(walked, step)
        else:
            if not isinstance(node, list):
                reason = f"not a list; cannot index [{step}]"
                raise ConfigError(
                    walked, f"is {_describe_value(node)}, {reason} (override {override!r})"
                )
            here = f"{walked}[{step}]"
            if step > len(node):
                raise ConfigError(
                    here,
                    f"index out of range: the list has {len(node)} item(s); "
                    f"[{len(node)}] appends (override {override!r})",
                )
            if step == len(node):
                node.append(None)
        if i == len(steps) - 1:
            node[step] = value
            return
        if (node[step] if isinstance(step, int) else node.get(step)) is None:
            node[step] = {} if isinstance(steps[i + 1], str) else []
        node, walked = node[step], here


# ---------------------------------------------------------------------------
# Table merge and serialisation.
# ---------------------------------------------------------------------------


def _deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``; nested mappings merge key by key, null keeps base."""
    out = dict(base)
    for key, value in override.items():
        current = out.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            out[key] = _deep_merge(current, value)
        elif isinstance(current, Mapping) and value is None:
            continue  # an empty section changes nothing
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_table_spec(default: TableSpec, override: Mapping[str, Any], path: str) -> TableSpec:
    """One feature's table settings: a partial table dict merged over ``default``.

    Nested sections merge field by field, so ``{"optimizer": {"lr": 0.1}}`` keeps
    the default optimizer's name and other settings.

    Args:
        default: ``model.embedding.default``.
        override: the feature's entry in ``model.embedding.tables`` (may be empty).
        path: dotted path of the entry, e.g. ``model.embedding.tables.C1``.

    Raises:
        ConfigError: naming the field path inside ``path``.
    """
    if not isinstance(override, Mapping):
        raise ConfigError(path, f"expected mapping, got {_describe_value(override)}")
    return build_dataclass(TableSpec, _deep_merge(to_dict(default), override), path)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.metadata.get("yaml", True)
        }
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return copy.deepcopy(value)


def to_dict(spec: Any, *, resolve_paths: bool = False) -> dict[str, Any]:
    """A spec (or any section) as plain YAML-ready data; ``job_from_dict`` reverses it.

    Paths become strings and loader-only fields (``base_dir``) are left out.

    Args:
        spec: a ``JobSpec`` or any section dataclass.
        resolve_paths: for a ``JobSpec``, write source paths (``data.sources`` and
            ``data.dataset`` sources) and ``output.dir`` as
            absolute paths (resolved against ``base_dir``), so the dict still means
            the same files when saved in another folder (e.g. a run's output).
    """
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        raise TypeError(f"to_dict expects a spec dataclass instance, got {type(spec).__name__}")
    out = cast(dict[str, Any], _plain(spec))
    if resolve_paths and isinstance(spec, JobSpec):
        # The job's path-valued fields; keep in step with spec.py's docstrings.
        for source in out["data"]["sources"]:
            source["path"] = str(spec.resolve(source["path"]).absolute())
        for stream in (out["data"]["dataset"] or {}).get("streams", {}).values():
            for source in stream["sources"]:  # patterns: placeholders survive resolve()
                source["path"] = str(spec.resolve(source["path"]).absolute())
        out["output"]["dir"] = str(spec.resolve(out["output"]["dir"]).absolute())
    return out
