"""Numeric fields: text -> float64 with a per-value verdict, and dense transforms.

``parse_numbers`` reads a column of raw text (an Arrow binary array) in one numba
pass and says, for every value, whether it is a number. Accepted syntax (ASCII,
no surrounding spaces)::

    [+-]? ( digits [. digits?] | . digits ) ( [eE] [+-]? digits )?

``nan`` / ``inf`` / ``infinity`` (any case, optional sign) are recognised but
rejected as not finite. The empty string is *missing*, not bad.

Values are exact to the last bit: integers below 2**53 and decimals with a
mantissa below 2**53 and a power of ten up to 22 (Clinger's fast path, one
correctly rounded multiply or divide) are computed in the kernel; the rare rest
(long mantissas, big exponents) goes through Python's ``float``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numba
import numpy as np
import pyarrow as pa

from estuary.data.hashing import binary_buffers, integer_values, validity_bits
from estuary.data.types import Float32Array

__all__ = [
    "DENSE_TRANSFORMS",
    "MISSING",
    "NOT_A_NUMBER",
    "NOT_FINITE",
    "OK",
    "parse_number_spans",
    "parse_numbers",
]

OK: Final = 0
MISSING: Final = 1  # empty field
NOT_A_NUMBER: Final = 2
NOT_FINITE: Final = 3  # nan / inf literals, or a value that overflows float64
_SLOW: Final = 4  # valid, but needs a correctly rounded conversion in Python

_POW10 = np.array([10.0**k for k in range(23)], dtype=np.float64)  # all exact doubles
_MAX_EXACT = 1 << 53
_INFINITY = np.frombuffer(b"infinity", dtype=np.uint8).copy()


@numba.njit(cache=True, nogil=True, inline="always")
def _lower(c: np.uint8) -> int:
    return int(c) | 32  # ASCII letters only; callers compare to lowercase letters


@numba.njit(cache=True, nogil=True)
def _is_special(data: np.ndarray, p: int, end: int) -> bool:
    """True if data[p:end] is nan / inf / infinity (case-insensitive)."""
    n = end - p
    if n == 3:
        a, b, c = _lower(data[p]), _lower(data[p + 1]), _lower(data[p + 2])
        return (a == 110 and b == 97 and c == 110) or (a == 105 and b == 110 and c == 102)
    if n == 8:
        k = 0
        while k < 8 and _lower(data[p + k]) == _INFINITY[k]:
            k += 1
        return k == 8
    return False


@numba.njit(cache=True, nogil=True, inline="always")
def _parse_one(data: np.ndarray, p: int, end: int) -> tuple[float, int]:
    """(value, code) of the text data[p:end]; value 0.0 unless the code is OK."""
    if p == end:
        return 0.0, MISSING
    negative = False
    c = data[p]
    if c == 43 or c == 45:  # '+' '-'
        negative = c == 45
        p += 1
    after_sign = p
    mantissa = 0
    digits = 0
    exp10 = 0
    slow = False
    while p < end and 48 <= data[p] <= 57:
        if mantissa < 100_000_000_000_000_000:
            mantissa = mantissa * 10 + int(data[p] - 48)
        else:
            slow = True  # too many digits for int64; Python finishes it
        digits += 1
        p += 1
    if p < end and data[p] == 46:  # '.'
        p += 1
        while p < end and 48 <= data[p] <= 57:
            if mantissa < 100_000_000_000_000_000:
                mantissa = mantissa * 10 + int(data[p] - 48)
                exp10 -= 1
            else:
                slow = True
            digits += 1
            p += 1
    if digits == 0:
        return 0.0, NOT_FINITE if _is_special(data, after_sign, end) else NOT_A_NUMBER
    if p < end and (data[p] == 101 or data[p] == 69):  # 'e' 'E'
        p += 1
        exp_negative = False
        if p < end and (data[p] == 43 or data[p] == 45):
            exp_negative = data[p] == 45
            p += 1
        exp_digits = 0
        exponent = 0
        while p < end and 48 <= data[p] <= 57:
            if exponent < 100_000:
                exponent = exponent * 10 + int(data[p] - 48)
            exp_digits += 1
            p += 1
        if exp_digits == 0:
            return 0.0, NOT_A_NUMBER
        exp10 += -exponent if exp_negative else exponent
    if p != end:
        return 0.0, NOT_A_NUMBER
    if slow or mantissa > _MAX_EXACT or exp10 > 22 or exp10 < -22:
        return 0.0, _SLOW
    value = float(mantissa)
    if exp10 > 0:
        value *= _POW10[exp10]
    elif exp10 < 0:
        value /= _POW10[-exp10]
    return (-value if negative else value), OK


@numba.njit(cache=True, nogil=True)
def _parse_numbers(
    offsets: np.ndarray, data: np.ndarray, values: np.ndarray, codes: np.ndarray
) -> None:
    for i in range(values.shape[0]):
        values[i], codes[i] = _parse_one(data, offsets[i], offsets[i + 1])


@numba.njit(cache=True, nogil=True)
def _integers(
    ints: np.ndarray, validity: np.ndarray, bit_offset: int, values: np.ndarray, codes: np.ndarray
) -> None:
    """values[i] = float64(ints[i]) (rounded to nearest, as numpy's astype) and OK,
    or 0.0 and MISSING where the validity bitmap (empty: no nulls) says null."""
    check = validity.shape[0] > 0
    for i in range(values.shape[0]):
        j = bit_offset + i
        if check and (validity[j >> 3] >> (j & 7)) & 1 == 0:
            values[i], codes[i] = 0.0, MISSING
        else:
            values[i], codes[i] = float(ints[i]), OK


@numba.njit(cache=True, nogil=True)
def _mark_missing(
    validity: np.ndarray, bit_offset: int, values: np.ndarray, codes: np.ndarray
) -> None:
    """0.0 and MISSING where the validity bitmap says null."""
    for i in range(values.shape[0]):
        j = bit_offset + i
        if (validity[j >> 3] >> (j & 7)) & 1 == 0:
            values[i], codes[i] = 0.0, MISSING


@numba.njit(cache=True, nogil=True)
def _parse_spans(
    data: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    columns: np.ndarray,
    values: np.ndarray,
    codes: np.ndarray,
) -> None:
    # Row by row: the spans (R, K) and the text are read front to back once.
    for i in range(starts.shape[0]):
        for j in range(columns.shape[0]):
            k = columns[j]
            values[j, i], codes[j, i] = _parse_one(data, starts[i, k], ends[i, k])


def parse_number_spans(
    data: np.ndarray, starts: np.ndarray, ends: np.ndarray, columns: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``parse_numbers`` of C columns of text fields read in place (a delimited-text
    block, see ``formats.tokenize``): field (i, k) is ``data[starts[i, k]:ends[i, k]]``.

    Args:
        data: uint8 (nbytes,) the text.
        starts: int32 (R, K) first byte of each field; ``ends``: one past its last.
        columns: the C span columns to parse.

    Returns:
        values: float64 (C, R), row j for ``columns[j]``; 0.0 where not ``OK``.
        codes: uint8 (C, R), as ``parse_numbers``.
    """
    n = starts.shape[0]
    values = np.empty((len(columns), n), dtype=np.float64)
    codes = np.empty((len(columns), n), dtype=np.uint8)
    _parse_spans(data, starts, ends, np.asarray(columns, dtype=np.int64), values, codes)
    for j, i in zip(*np.nonzero(codes == _SLOW), strict=True):  # rare, as in parse_numbers
        k = columns[j]
        value = float(data[starts[i, k] : ends[i, k]].tobytes())
        finite = np.isfinite(value)
        values[j, i] = value if finite else 0.0
        codes[j, i] = OK if finite else NOT_FINITE
    return values, codes


def parse_numbers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Parse a column of numeric text.

    Args:
        column: (R,) binary or string Arrow array (or a dictionary of one), or an
            integer array, read as its decimal text (same values, no text
            written). Nulls count as missing.

    Returns:
        values: float64 (R,); 0.0 where the code is not ``OK``.
        codes: uint8 (R,) ``OK``, ``MISSING``, ``NOT_A_NUMBER`` or ``NOT_FINITE``.
    """
    n = len(column)
    values = np.empty(n, dtype=np.float64)
    codes = np.empty(n, dtype=np.uint8)
    validity, bit_offset = validity_bits(column)  # one pass over the bitmap, no masks
    if pa.types.is_integer(column.type):
        # int -> float64 rounds to nearest, as parsing the decimal text does.
        _integers(integer_values(column), validity, bit_offset, values, codes)
        return values, codes
    offsets, data = binary_buffers(column)
    _parse_numbers(offsets, data, values, codes)
    slow = np.flatnonzero(codes == _SLOW)
    for i in slow:  # rare: > 17 significant digits or |exponent| > 22
        value = float(column[int(i)].as_py())
        finite = np.isfinite(value)
        values[i] = value if finite else 0.0
        codes[i] = OK if finite else NOT_FINITE
    if validity.shape[0]:
        _mark_missing(validity, bit_offset, values, codes)
    return values, codes


def _log1p(x: np.ndarray) -> Float32Array:
    # sign(x) * log(1 + |x|): defined for negative counts (Criteo I2 can be -1).
    return (np.sign(x) * np.log1p(np.abs(x))).astype(np.float32)


def _identity(x: np.ndarray) -> Float32Array:
    with np.errstate(over="ignore"):  # > float32 max becomes inf; the caller flags it
        return x.astype(np.float32)


DENSE_TRANSFORMS: dict[str, Callable[[np.ndarray], Float32Array]] = {
    "log1p": _log1p,
    "none": _identity,
}
"""``SchemaSpec.dense_transform`` name -> float64 (R,) -> float32 (R,)."""
