"""Per-column value transforms applied to sparse columns before hashing.

A job names them in ``data.schema.transforms`` (``{hour: hour_of_day}``). Each
transform maps a raw column to a new column of text whose values are then
hashed like any categorical value.

Contract of a transform function: it takes an Arrow binary array of R raw values
and returns an Arrow array of R values (binary or string) with a **null where the
input is missing (null or empty) or invalid**. The reader tells the two apart:
a null output for a non-empty input marks the row bad, with the reason
``field <column>: '<value>' is not <expects>``.

Registered names:

=============== =============================================== ================
name            output                                          input
=============== =============================================== ================
``identity``    the value unchanged                             any
``hour_of_day`` ``HH`` (``"00"`` .. ``"23"``)                    ``YYMMDDHH``
``day_of_week`` ``"0"`` (Monday) .. ``"6"`` (Sunday)             ``YYMMDDHH``
=============== =============================================== ================

``YYMMDDHH`` must be 8 digits forming a real date and hour (``%y%m%d%H``, years
2000-2068 per ``%y``); anything else is invalid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from estuary.config.errors import ConfigError
from estuary.plugins import TRANSFORMS

__all__ = [
    "TRANSFORMS",
    "ColumnTransform",
    "get_transform",
    "register_transform",
    "resolve_transforms",
]

TransformFn = Callable[[pa.Array], pa.Array]


@dataclass(frozen=True)
class ColumnTransform:
    """A named value transform.

    Args:
        name: registry name (``hour_of_day``).
        fn: (R,) raw binary -> (R,) text; null where the input is missing or invalid.
        expects: the valid input in words, used in bad-row reasons (``YYMMDDHH``).
    """

    name: str
    fn: TransformFn
    expects: str = "valid"

    def __call__(self, values: pa.Array) -> pa.Array:
        return self.fn(values)


# ``TRANSFORMS`` (name -> ColumnTransform) is ``estuary.plugins.TRANSFORMS``; add to
# it with ``register_transform``.


def register_transform(
    name: str, *, expects: str = "valid"
) -> Callable[[TransformFn], TransformFn]:
    """Decorator registering ``fn`` as transform ``name``."""

    def add(fn: TransformFn) -> TransformFn:
        TRANSFORMS.register(name, ColumnTransform(name=name, fn=fn, expects=expects))
        return fn

    return add


def get_transform(name: str, column: str) -> ColumnTransform:
    """The transform registered as ``name`` for ``column``.

    Raises:
        ConfigError: ``data.schema.transforms.<column>: unknown transform ...``.
    """
    transform: ColumnTransform = TRANSFORMS.get(name, f"data.schema.transforms.{column}")
    return transform


def resolve_transforms(
    transforms: Mapping[str, str], sparse: list[str]
) -> dict[str, ColumnTransform]:
    """Check ``SchemaSpec.transforms`` against the sparse columns and look names up.

    Raises:
        ConfigError: a transform on a column that is not a sparse feature, or an
            unknown transform name; the path names the column.
    """
    out: dict[str, ColumnTransform] = {}
    for column, name in transforms.items():
        if column not in sparse:
            raise ConfigError(
                f"data.schema.transforms.{column}",
                f"transforms apply to sparse columns only; {column!r} is not in data.schema.sparse",
            )
        out[column] = get_transform(name, column)
    return out


@register_transform("identity")
def _identity(values: pa.Array) -> pa.Array:
    return values


def _parse_yymmddhh(values: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(text, timestamp) of valid ``YYMMDDHH`` values; null elsewhere."""
    # The regex first: strptime alone accepts things like "1410210" and the cast
    # to string must never see invalid UTF-8.
    digits = pc.match_substring_regex(values, r"^[0-9]{8}$")
    text = pc.if_else(digits, values, pa.scalar(None, values.type)).cast(pa.string())
    stamp = pc.strptime(text, format="%y%m%d%H", unit="s", error_is_null=True)
    return text, stamp


@register_transform("hour_of_day", expects="YYMMDDHH")
def _hour_of_day(values: pa.Array) -> pa.Array:
    text, stamp = _parse_yymmddhh(values)
    hour = pc.utf8_slice_codeunits(text, 6, 8)
    return pc.if_else(stamp.is_valid(), hour, pa.scalar(None, pa.string()))


@register_transform("day_of_week", expects="YYMMDDHH")
def _day_of_week(values: pa.Array) -> pa.Array:
    _, stamp = _parse_yymmddhh(values)
    return pc.day_of_week(stamp).cast(pa.string())  # Monday = 0; null stays null
