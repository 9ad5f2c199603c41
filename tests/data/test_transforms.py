"""Column transforms: registered by name, null exactly where the input is bad."""

from __future__ import annotations

import pyarrow as pa
import pytest

from estuary.config.errors import ConfigError
from estuary.data.transforms import (
    TRANSFORMS,
    get_transform,
    register_transform,
    resolve_transforms,
)

HOURS = [b"14102100", b"14102123", b"14103005", b"", b"1410210", b"14139999", b"abcdefgh"]


def test_hour_of_day_takes_the_hour_and_nulls_invalid_values() -> None:
    out = get_transform("hour_of_day", "hour")(pa.array(HOURS, pa.binary()))
    assert out.to_pylist() == ["00", "23", "05", None, None, None, None]


def test_day_of_week_counts_from_monday() -> None:
    # 2014-10-21 was a Tuesday, 2014-10-30 a Thursday.
    out = get_transform("day_of_week", "hour")(pa.array(HOURS, pa.binary()))
    assert out.to_pylist() == ["1", "1", "3", None, None, None, None]


def test_identity_returns_the_input() -> None:
    values = pa.array([b"a", b""], pa.binary())
    assert get_transform("identity", "x")(values).to_pylist() == [b"a", b""]


def test_invalid_utf8_is_invalid_not_a_crash() -> None:
    out = get_transform("hour_of_day", "hour")(pa.array([b"\xff\xfe1410210"], pa.binary()))
    assert out.to_pylist() == [None]


def test_unknown_transform_names_the_column() -> None:
    with pytest.raises(
        ConfigError, match=r"data\.schema\.transforms\.hour: unknown transform 'hours'"
    ):
        resolve_transforms({"hour": "hours"}, ["hour"])


def test_transform_on_a_non_sparse_column_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"data\.schema\.transforms\.I1: .*not in data\.schema\.sparse"
    ):
        resolve_transforms({"I1": "identity"}, ["C1"])


def test_registered_transforms_are_found_by_name() -> None:
    @register_transform("upper_for_test", expects="text")
    def upper(values: pa.Array) -> pa.Array:
        return pa.compute.utf8_upper(values.cast(pa.string()))

    try:
        got = resolve_transforms({"c": "upper_for_test"}, ["c"])["c"]
        assert got.expects == "text"
        assert got(pa.array([b"ab"], pa.binary())).to_pylist() == ["AB"]
    finally:
        del TRANSFORMS["upper_for_test"]
