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
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import yaml

from estuary.config.build import (
    build_dataclass,
    describe_value,
    join_path,
    plain,
    suggest,
)
from estuary.config.dataset import BatchSourceSpec
from estuary.config.errors import ConfigError
from estuary.config.mixed_buffer import check_mixed_buffer
from estuary.config.spec import JobSpec, SourceSpec, merge_table

__all__ = [
    "apply_overrides",
    "build_dataclass",
    "job_from_dict",
    "load_job",
    "merge_table_spec",
    "to_dict",
]


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
                f"not a column in data.schema.dense or data.schema.sparse{suggest(column, seen)}",
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
                        f"{column!r} is not a column of the sources{suggest(column, known)}",
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
                        f"{getattr(join, side)!r}{suggest(column, columns)}",
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
                    f"{where}.columns", f"{column!r} is not a column{suggest(column, known)}"
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
                    + suggest(feature, sparse),
                )
            if feature in group_of:
                raise ConfigError(
                    f"{where}[{i}]", f"{feature!r} is already in shared table {group_of[feature]!r}"
                )
            group_of[feature] = group

    names = [*sparse, *embedding.shared]
    for name in embedding.tables:
        where = f"model.embedding.tables.{name}"
        if name not in names:
            also = " or shared table (model.embedding.shared)" if embedding.shared else ""
            raise ConfigError(
                where, f"not a sparse feature (data.schema.sparse){also}{suggest(name, names)}"
            )
        if name in group_of and name not in embedding.shared:
            group = group_of[name]
            raise ConfigError(
                where,
                f"reads shared table {group!r}; configure model.embedding.tables.{group} instead",
            )
    # Every table's settings are resolved once, here at load; a wrong override names its path.
    _ = job.tables


def job_from_dict(data: Mapping[str, Any], base_dir: str | Path = Path(".")) -> JobSpec:
    """Build and validate a ``JobSpec`` from a plain dict (the Python API).

    Args:
        data: the job's sections, shaped like the YAML file.
        base_dir: folder that relative paths in the job resolve against.

    Raises:
        ConfigError: naming the field path of the first problem.
    """
    if not isinstance(data, Mapping):
        raise ConfigError("", f"a job must be a mapping of sections, got {describe_value(data)}")
    # Copy so later changes to the caller's dict cannot leak into the spec.
    job = build_dataclass(JobSpec, copy.deepcopy(dict(data)), "", base_dir=Path(base_dir))
    _check_schema(job)
    _check_embedding(job)
    check_mixed_buffer(job)
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
            "", f"{file}: the top level must be a mapping of sections, got {describe_value(data)}"
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
                    walked, f"is {describe_value(node)}, {reason} (override {override!r})"
                )
            here = join_path(walked, step)
        else:
            if not isinstance(node, list):
                reason = f"not a list; cannot index [{step}]"
                raise ConfigError(
                    walked, f"is {describe_value(node)}, {reason} (override {override!r})"
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
# Serialisation.
# ---------------------------------------------------------------------------

merge_table_spec = merge_table
"""One table's settings, a partial table dict merged over the default (the name
this function had before ``config.spec.merge_table``)."""


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
    out = cast(dict[str, Any], plain(spec))
    if resolve_paths and isinstance(spec, JobSpec):
        # The job's path-valued fields; keep in step with spec.py's docstrings.
        for source in out["data"]["sources"]:
            source["path"] = str(spec.resolve(source["path"]).absolute())
        for stream in (out["data"]["dataset"] or {}).get("streams", {}).values():
            for source in stream["sources"]:  # patterns: placeholders survive resolve()
                source["path"] = str(spec.resolve(source["path"]).absolute())
        out["output"]["dir"] = str(spec.resolve(out["output"]["dir"]).absolute())
    return out
