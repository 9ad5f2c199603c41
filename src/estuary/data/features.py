"""Derived sparse features (``data.schema.features``), computed while decoding.

``compile_features`` turns the declared ``FeatureSpec`` list into callables that
map one chunk's raw columns (R rows of Arrow arrays) to ids; ``RowDecoder`` runs
them, so every reader of the job file derives the same ids. Each kind is one
entry of the ``FEATURE_KINDS`` registry (add one with ``register_feature_kind``);
all of them are vectorised (Arrow compute, numpy, numba hashing), with no
per-row Python.

Ids follow ``estuary.data.hashing``: XXH64 of a value's text seeded with
``feature_seed(<feature name>)`` (or its shared-table name), so they are stable
across processes and platforms. Semantics, per kind:

- ``cross``: the columns' values as text, joined in declaration order with the
  unit separator ``\\x1f`` (a missing value joins as empty text), then hashed:
  ``id = XXH64(v1 + b"\\x1f" + v2 + ..., seed)``. Order matters: ``(a, b)`` and
  ``(b, a)`` are different crosses.
- ``bucketize``: the value parsed as a number; bucket ``i`` = the number of
  boundaries ``<= x`` (``searchsorted(boundaries, x, side="right")``), so bucket i
  holds ``boundaries[i-1] <= x < boundaries[i]`` (lower bound inclusive), bucket 0
  is ``x < boundaries[0]``. ``id = XXH64(str(i), seed)``. A missing value gets
  the feature's missing id (its own bucket); text that is not a finite number
  makes the row bad.
- ``modulo``: ``bucket = uint64(XXH64(value text, seed)) % modulo``;
  ``id = XXH64(str(bucket), seed)``. A missing value gets the missing id.
- ``sequence``: the value split on ``delimiter``; empty items are dropped, the
  first ``max_length`` items kept, each hashed as a categorical value. A missing
  or empty field is an empty bag (it pools to a zero vector).
- ``transform``: the registered transform (``register_transform``) applied to
  the column's text, then hashed; a null output for a non-empty input makes the
  row bad, as in ``data.schema.transforms``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from estuary.config.features import FeatureSpec
from estuary.data.dense import MISSING, OK, parse_numbers
from estuary.data.formats.values import to_text
from estuary.data.hashing import feature_seed, hash_array, hash_bytes
from estuary.data.transforms import TRANSFORMS, ColumnTransform
from estuary.data.types import Int64Array
from estuary.plugins import FEATURE_KINDS

__all__ = [
    "CROSS_SEPARATOR",
    "FEATURE_KINDS",
    "CompiledFeature",
    "FeatureKind",
    "FeatureValues",
    "compile_features",
    "register_feature_kind",
]

CROSS_SEPARATOR = b"\x1f"
"""Joins a cross's values before hashing (ASCII unit separator)."""

Columns = Mapping[str, pa.Array]


@dataclass(frozen=True)
class FeatureValues:
    """One derived feature's ids for the R rows of a chunk.

    Args:
        ids: int64 (R,) one id per row, or (N,) the values of a jagged feature.
        offsets: int64 (R + 1,) row boundaries into ``ids`` (jagged kinds only).
        invalid: bool (R,) rows whose input is invalid (they are dropped as bad).
        raw: the input column shown in bad-row reasons.
        reason: what an invalid value is not, e.g. ``is not a finite number``.
    """

    ids: Int64Array
    offsets: Int64Array | None = None
    invalid: np.ndarray | None = None
    raw: pa.Array | None = None
    reason: str = ""


Compute = Callable[[Columns], FeatureValues]
Builder = Callable[[FeatureSpec, str, int], Compute]


@dataclass(frozen=True)
class FeatureKind:
    """A registered kind: ``build(spec, path, seed)`` returns the chunk function.

    Args:
        name: the ``kind`` value in the job file.
        build: checks what only the pipeline can check (e.g. a transform's name;
            errors name ``path``) and returns ``columns -> FeatureValues``.
        jagged: several ids per row (``FeatureValues.offsets`` set).
    """

    name: str
    build: Builder
    jagged: bool = False


# ``FEATURE_KINDS`` (name -> FeatureKind) is ``estuary.plugins.FEATURE_KINDS``; add to
# it with ``register_feature_kind``.


def register_feature_kind(name: str, *, jagged: bool = False) -> Callable[[Builder], Builder]:
    """Decorator registering ``build`` as feature kind ``name``."""

    def add(build: Builder) -> Builder:
        FEATURE_KINDS.register(name, FeatureKind(name=name, build=build, jagged=jagged))
        return build

    return add


@dataclass(frozen=True)
class CompiledFeature:
    """A declared feature ready to run on chunks."""

    name: str
    spec: FeatureSpec
    jagged: bool
    compute: Compute


def compile_features(
    specs: Sequence[FeatureSpec], hash_names: Mapping[str, str] | None = None
) -> list[CompiledFeature]:
    """The chunk functions of ``data.schema.features``, in declaration order.

    Args:
        specs: the declared features.
        hash_names: feature -> name whose seed hashes it (shared tables).

    Raises:
        ConfigError: an unknown kind or transform, naming ``data.schema.features[i]``.
    """
    hash_names = hash_names or {}
    out = []
    for i, spec in enumerate(specs):
        path = f"data.schema.features[{i}]"
        kind: FeatureKind = FEATURE_KINDS.get(spec.kind, f"{path}.kind")
        seed = feature_seed(hash_names.get(spec.name, spec.name))
        out.append(CompiledFeature(spec.name, spec, kind.jagged, kind.build(spec, path, seed)))
    return out


def _bucket_ids(buckets: np.ndarray, seed: int) -> Int64Array:
    """Ids of int64 bucket numbers: the hash of their decimal text."""
    return hash_array(pa.array(buckets.astype(np.int64, copy=False), pa.int64()), seed)


def _present(raw: pa.Array) -> np.ndarray:
    """bool (R,): the binary value is neither null nor empty."""
    return np.asarray(pc.binary_length(raw).fill_null(0).to_numpy(zero_copy_only=False) > 0)


@register_feature_kind("cross")
def _cross(spec: FeatureSpec, path: str, seed: int) -> Compute:
    separator = pa.scalar(CROSS_SEPARATOR, pa.binary())

    def compute(cols: Columns) -> FeatureValues:
        texts = [to_text(cols[c]) for c in spec.columns]
        joined = pc.binary_join_element_wise(
            *texts, separator, null_handling="replace", null_replacement=""
        )
        return FeatureValues(ids=hash_array(joined, seed))

    return compute


@register_feature_kind("bucketize")
def _bucketize(spec: FeatureSpec, path: str, seed: int) -> Compute:
    boundaries = np.asarray(spec.boundaries, dtype=np.float64)
    missing = np.int64(hash_bytes(b"", seed))
    (column,) = spec.columns

    def compute(cols: Columns) -> FeatureValues:
        raw = cols[column]
        values, codes = parse_numbers(raw)
        buckets = np.searchsorted(boundaries, values, side="right")
        ids = _bucket_ids(buckets, seed)
        ids[codes == MISSING] = missing
        invalid = (codes != OK) & (codes != MISSING)
        return FeatureValues(
            ids=ids,
            invalid=invalid,
            raw=raw,
            reason=f"is not a finite number (bucketize {spec.name})",
        )

    return compute


@register_feature_kind("modulo")
def _modulo(spec: FeatureSpec, path: str, seed: int) -> Compute:
    assert spec.modulo is not None  # FeatureSpec.validate
    n = np.uint64(spec.modulo)
    missing = np.int64(hash_bytes(b"", seed))
    (column,) = spec.columns

    def compute(cols: Columns) -> FeatureValues:
        hashed = hash_array(cols[column], seed)  # missing values -> the missing id
        ids = _bucket_ids(hashed.view(np.uint64) % n, seed)
        ids[hashed == missing] = missing
        return FeatureValues(ids=ids)

    return compute


@register_feature_kind("sequence", jagged=True)
def _sequence(spec: FeatureSpec, path: str, seed: int) -> Compute:
    delimiter = spec.delimiter if spec.delimiter is not None else "|"
    max_length = spec.max_length
    (column,) = spec.columns

    def compute(cols: Columns) -> FeatureValues:
        raw = to_text(cols[column])
        n = len(raw)
        lists = pc.split_pattern(raw, pattern=delimiter)
        items = lists.flatten()  # null lists (missing fields) contribute nothing
        parents = np.asarray(pc.list_parent_indices(lists).to_numpy(zero_copy_only=False))
        keep = _present(items)
        parents = parents[keep]
        if max_length is not None:
            counts = np.bincount(parents, minlength=n)
            starts = np.zeros(n, dtype=np.int64)
            np.cumsum(counts[:-1], out=starts[1:])
            position = np.arange(parents.shape[0], dtype=np.int64) - starts[parents]
            short = position < max_length
            keep[np.flatnonzero(keep)[~short]] = False
            parents = parents[short]
        counts = np.bincount(parents, minlength=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = hash_array(items.filter(pa.array(keep)), seed)
        return FeatureValues(ids=ids, offsets=offsets)

    return compute


@register_feature_kind("transform")
def _transform(spec: FeatureSpec, path: str, seed: int) -> Compute:
    assert spec.transform is not None  # FeatureSpec.validate
    transform: ColumnTransform = TRANSFORMS.get(spec.transform, f"{path}.transform")
    (column,) = spec.columns

    def compute(cols: Columns) -> FeatureValues:
        raw = to_text(cols[column])
        values = transform(raw)
        invalid = values.is_null().to_numpy(zero_copy_only=False) & _present(raw)
        return FeatureValues(
            ids=hash_array(values, seed),
            invalid=invalid,
            raw=raw,
            reason=f"is not {transform.expects} ({transform.name})",
        )

    return compute
