"""Numeric fields: every value gets a verdict, and accepted values are exact."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.data.dense import (
    DENSE_TRANSFORMS,
    MISSING,
    NOT_A_NUMBER,
    NOT_FINITE,
    OK,
    parse_numbers,
)

CASES = {
    "0": (0.0, OK),
    "17": (17.0, OK),
    "-1": (-1.0, OK),
    "+3": (3.0, OK),
    "2.5": (2.5, OK),
    ".5": (0.5, OK),
    "5.": (5.0, OK),
    "1e3": (1000.0, OK),
    "-2.5E-2": (-0.025, OK),
    "123456789012345678901234": (1.2345678901234568e23, OK),
    "1e-300": (1e-300, OK),
    "": (0.0, MISSING),
    "abc": (0.0, NOT_A_NUMBER),
    " 5": (0.0, NOT_A_NUMBER),
    "5 ": (0.0, NOT_A_NUMBER),
    "1,5": (0.0, NOT_A_NUMBER),
    "0x10": (0.0, NOT_A_NUMBER),
    "1e": (0.0, NOT_A_NUMBER),
    "-": (0.0, NOT_A_NUMBER),
    ".": (0.0, NOT_A_NUMBER),
    "nan": (0.0, NOT_FINITE),
    "NaN": (0.0, NOT_FINITE),
    "-inf": (0.0, NOT_FINITE),
    "Infinity": (0.0, NOT_FINITE),
    "1e999": (0.0, NOT_FINITE),
}


def test_each_value_gets_the_right_verdict_and_value() -> None:
    texts = list(CASES)
    values, codes = parse_numbers(pa.array([t.encode() for t in texts], pa.binary()))
    for text, value, code in zip(texts, values, codes, strict=True):
        assert (value, code) == CASES[text], text


def test_nulls_are_missing() -> None:
    values, codes = parse_numbers(pa.array(["1", None], pa.string()))
    assert values.tolist() == [1.0, 0.0]
    assert codes.tolist() == [OK, MISSING]


def test_sliced_nullable_integers_are_exact_with_nulls_missing() -> None:
    # Read through the validity bitmap at the slice's bit offset.
    raw = [None if i % 3 == 0 else (-1) ** i * (2**53 + i) for i in range(40)]
    for kind in (pa.int64(), pa.uint64(), pa.int32()):
        kept = [v if v is None or kind != pa.int32() else v % 1000 for v in raw]
        kept = [v if v is None or kind != pa.uint64() else abs(v) for v in kept]
        column = pa.array(kept, kind)
        for start, length in ((0, 40), (5, 20), (11, 29)):
            values, codes = parse_numbers(column.slice(start, length))
            part = kept[start : start + length]
            assert values.tolist() == [0.0 if v is None else float(v) for v in part]
            assert codes.tolist() == [MISSING if v is None else OK for v in part]


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.integers(-(10**25), 10**25).map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
        st.tuples(st.integers(0, 10**18), st.integers(-40, 40)).map(lambda t: f"{t[0]}e{t[1]}"),
    )
)
def test_values_are_correctly_rounded_like_python_float(text: str) -> None:
    values, codes = parse_numbers(pa.array([text]))
    assert codes[0] == OK
    assert values[0] == float(text)


def test_log1p_is_signed_and_float32() -> None:
    x = np.array([-1.0, 0.0, 1.0, -100.0, 5000.0])
    out = DENSE_TRANSFORMS["log1p"](x)
    assert out.dtype == np.float32
    expected = [math.copysign(math.log1p(abs(v)), v) for v in x]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out[0] == pytest.approx(-math.log(2), rel=1e-6)


def test_none_transform_keeps_values() -> None:
    out = DENSE_TRANSFORMS["none"](np.array([-3.0, 2.5]))
    assert out.dtype == np.float32
    assert out.tolist() == [-3.0, 2.5]
