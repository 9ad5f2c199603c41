"""Declared feature processing: derived sparse features (``data.schema.features``).

Each entry derives one sparse feature from raw columns; the data pipeline (the
data layer's ``features`` module) computes it while decoding, so every consumer
of the job file (training now, serving later) applies the same declared pipeline.
Derived features follow ``data.schema.sparse`` in declaration order and get
embedding tables like any sparse feature.

Kinds and the fields each one reads (other kind-specific fields must be unset):

=============== ======================= =============================================
kind            columns                 fields
=============== ======================= =============================================
``cross``       two or more             none
``bucketize``   exactly one (numeric)   ``boundaries`` (required, strictly increasing)
``modulo``      exactly one             ``modulo`` (required, >= 1)
``sequence``    exactly one (delimited) ``delimiter`` (default ``|``), ``max_length``
``transform``   exactly one             ``transform`` (required, a registered name)
=============== ======================= =============================================

The semantics are documented in docs/data.md ("Feature processing").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal

from estuary.config.errors import ConfigError
from estuary.plugins import FEATURE_KINDS

__all__ = ["FEATURE_KIND_FIELDS", "FeatureKindName", "FeatureSpec"]

# The built-in kinds; ``kind`` takes any registered one (``estuary.plugins``).
FeatureKindName = Literal["cross", "bucketize", "modulo", "sequence", "transform"]


@dataclass(frozen=True)
class _KindRule:
    """What one kind reads: how many columns, and its required / optional fields."""

    min_columns: int
    max_columns: int | None
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()


# A registered kind of another name: one or more columns, any kind field (its
# ``build`` checks the ones it reads).
_PLUGIN_RULE = _KindRule(
    1, None, optional=("boundaries", "modulo", "delimiter", "max_length", "transform")
)
_RULES: dict[str, _KindRule] = {
    "cross": _KindRule(2, None),
    "bucketize": _KindRule(1, 1, required=("boundaries",)),
    "modulo": _KindRule(1, 1, required=("modulo",)),
    "sequence": _KindRule(1, 1, optional=("delimiter", "max_length")),
    "transform": _KindRule(1, 1, required=("transform",)),
}

FEATURE_KIND_FIELDS: tuple[str, ...] = (
    "boundaries",
    "modulo",
    "delimiter",
    "max_length",
    "transform",
)
"""Kind-specific fields of ``FeatureSpec``; each kind may set only its own."""


@dataclass(frozen=True)
class FeatureSpec:
    """One derived sparse feature.

    Args:
        name: the feature's name (its embedding table and hash seed); must not
            clash with a column in ``data.schema.dense`` / ``sparse`` or another
            derived feature.
        kind: ``cross``, ``bucketize``, ``modulo``, ``sequence``, ``transform``, or
            another registered kind (``register_feature_kind``).
        columns: the raw input columns (``cross``: two or more, others: one).
        boundaries: ``bucketize``: strictly increasing bucket boundaries; bucket i
            holds ``boundaries[i-1] <= x < boundaries[i]`` (lower bound inclusive).
        modulo: ``modulo``: number of buckets n; the value's hash is taken mod n.
        delimiter: ``sequence``: the separator between items (default ``|``).
        max_length: ``sequence``: keep at most this many items (the first ones).
        transform: ``transform``: a registered transform name
            (``register_transform`` in the data layer).
    """

    name: str
    kind: str
    columns: list[str] = field(default_factory=list)
    boundaries: list[float] | None = None
    modulo: int | None = None
    delimiter: str | None = None
    max_length: int | None = None
    transform: str | None = None

    def validate(self, path: str) -> None:
        if not self.name:
            raise ConfigError(f"{path}.name", "must not be empty")
        FEATURE_KINDS.check(self.kind, f"{path}.kind")
        rule = _RULES.get(self.kind, _PLUGIN_RULE)
        n = len(self.columns)
        if n < rule.min_columns or (rule.max_columns is not None and n > rule.max_columns):
            want = (
                f"exactly {rule.min_columns}"
                if rule.max_columns == rule.min_columns
                else f"at least {rule.min_columns}"
            )
            raise ConfigError(f"{path}.columns", f"kind {self.kind!r} needs {want} column(s)")
        for i, column in enumerate(self.columns):
            if not column:
                raise ConfigError(f"{path}.columns[{i}]", "must not be empty")
            if column in self.columns[:i]:
                raise ConfigError(f"{path}.columns[{i}]", f"{column!r} is listed twice")
        for name in FEATURE_KIND_FIELDS:
            value = getattr(self, name)
            if name in rule.required and value is None:
                raise ConfigError(f"{path}.{name}", f"required for kind {self.kind!r}")
            if value is not None and name not in rule.required + rule.optional:
                raise ConfigError(f"{path}.{name}", f"not used by kind {self.kind!r}")
        if self.boundaries is not None:
            if not self.boundaries:
                raise ConfigError(f"{path}.boundaries", "must list at least one boundary")
            bounds = self.boundaries
            if any(b <= a for a, b in pairwise(bounds)):
                raise ConfigError(f"{path}.boundaries", "must be strictly increasing")
        if self.modulo is not None and self.modulo < 1:
            raise ConfigError(f"{path}.modulo", "must be >= 1")
        if self.delimiter is not None and not self.delimiter:
            raise ConfigError(f"{path}.delimiter", "must not be empty")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"{path}.max_length", "must be >= 1")
        if self.transform is not None and not self.transform:
            raise ConfigError(f"{path}.transform", "must not be empty")
