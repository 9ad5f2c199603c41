"""Typed values -> the raw text of the ``RawChunk`` contract (typed formats only).

Text formats hand the decoder the bytes of each field. Typed formats (Parquet,
JSON) hold numbers, booleans and strings instead; ``to_text`` writes them as
text so that the decoder parses and hashes them exactly like the text formats
(``hashing``: "text, not type"). One rule for every typed format:

============== ==============================================================
value          text
============== ==============================================================
string, binary its bytes, unchanged (UTF-8 for strings)
integer        decimal, no leading zeros, ``-`` for negatives: ``15706``, ``-1``
float          a whole number in the int64 range is written as that integer:
               ``15706.0`` -> ``15706``, ``2.0`` -> ``2``, ``-0.0`` -> ``0``;
               any other finite value as the shortest text that reads back to
               the same float (``0.1``, ``2.5``, ``1e-7``, ``1e+20``; float32
               values use the float32 shortest: ``0.1``, not ``0.100000001``);
               NaN -> ``nan``, infinities -> ``inf`` / ``-inf`` (a dense column
               rejects them as not finite, like the text ``nan``)
boolean        ``1`` / ``0``
decimal        exact digits, trailing fractional zeros dropped: ``2.00`` -> ``2``
date, time     Arrow's text: ``2014-10-21``, ``2014-10-21 00:00:00``
null           null = missing (like an empty field)
============== ==============================================================

So an int64 ``15706``, a float64 ``15706.0`` (pandas' integer-with-NaN column),
the JSON ``15706``, ``15706.0`` or ``"15706"`` and the TSV field ``15706`` all get
the same id. Lists, structs and maps are not single values and are refused.

Readers call ``to_raw``, which skips writing text where the decoder does not
need it: integer columns (and all-whole float columns) stay ``int64`` (the
decoder parses an int64 to the same float as its text, and ``hashing`` hashes it
as its decimal text), and repetitive dictionary columns stay dictionaries.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["float_texts", "is_scalar_type", "one_array", "to_raw", "to_text"]

_INT64_LIMIT = 2.0**63  # whole floats in [-2**63, 2**63) are written as integers
_ONE, _ZERO = pa.scalar(b"1", pa.binary()), pa.scalar(b"0", pa.binary())


def one_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column as one array, without a copy when it already is one chunk
    (``combine_chunks`` always copies)."""
    if isinstance(values, pa.Array):
        return values
    return values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()


def is_scalar_type(kind: pa.DataType) -> bool:
    """True for the Arrow types ``to_text`` accepts (single values, not nested)."""
    if pa.types.is_dictionary(kind):
        return is_scalar_type(kind.value_type)
    return not pa.types.is_nested(kind)


def to_raw(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """(R,) typed Arrow values -> a ``RawChunk`` column: the cheapest exact form.

    - integers (and floats that are all whole numbers in the int64 range) ->
      ``int64``, which stands for its decimal text: the decoder parses and hashes
      it exactly as that text, without writing it;
    - a dictionary with fewer distinct values than half its rows -> a dictionary
      of ``pa.binary()`` text: the decoder hashes each distinct value once;
    - anything else -> ``to_text``.

    Raises:
        TypeError: as ``to_text``.
    """
    values = one_array(values)
    kind = values.type
    if pa.types.is_dictionary(kind):
        dictionary = to_text(values.dictionary)
        if 2 * len(dictionary) <= len(values):
            # The indices are the reader's own: valid, so not checked again (an O(R) pass).
            return pa.DictionaryArray.from_arrays(values.indices, dictionary, safe=False)
        return dictionary.take(values.indices)
    if pa.types.is_int64(kind):
        return values
    if pa.types.is_integer(kind) and not pa.types.is_uint64(kind):
        return values.cast(pa.int64())
    if pa.types.is_floating(kind):
        x = _float64(values)
        with np.errstate(invalid="ignore"):
            whole = (np.floor(x) == x) & (x >= -_INT64_LIMIT) & (x < _INT64_LIMIT)
        if whole.all():
            return pa.array(x.astype(np.int64), mask=_nulls(values))
    return to_text(values)


def to_text(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """(R,) typed Arrow values -> (R,) ``pa.binary()`` text per the table above.

    Raises:
        TypeError: a nested type (list, struct, map) or one Arrow cannot write as text.
    """
    values = one_array(values)
    kind = values.type
    if pa.types.is_dictionary(kind):
        return to_text(values.dictionary).take(values.indices)
    if pa.types.is_null(kind):
        return pa.nulls(len(values), pa.binary())
    if pa.types.is_binary(kind):
        return values
    if pa.types.is_string(kind):
        # The same layout: a zero-copy view (``cast`` also shares the buffers but
        # costs ~35 us a call, paid per dictionary column per Parquet batch).
        return pa.Array.from_buffers(
            pa.binary(), len(values), values.buffers(), values.null_count, values.offset
        )
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_string_view(kind)
        or pa.types.is_binary_view(kind)
        or pa.types.is_fixed_size_binary(kind)
    ):
        return values.cast(pa.binary())
    if pa.types.is_boolean(kind):
        return pc.if_else(values, _ONE, _ZERO)
    if pa.types.is_integer(kind):
        return _ints_to_text(values)
    if pa.types.is_floating(kind):
        return _floats_to_text(values)
    if pa.types.is_decimal(kind):
        return _decimals_to_text(values)
    if pa.types.is_nested(kind):
        raise TypeError(f"{kind} is not a single value")
    try:
        return pc.cast(values, pa.string()).cast(pa.binary())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as e:
        raise TypeError(f"{kind} cannot be read as text: {e}") from None


def _nulls(values: pa.Array) -> np.ndarray | None:
    """bool (R,) null mask, or None without nulls."""
    return values.is_null().to_numpy(zero_copy_only=False) if values.null_count else None


def _float64(values: pa.Array) -> np.ndarray:
    """float64 (R,) values, 0.0 for nulls (float16 widened exactly)."""
    if pa.types.is_float16(values.type):
        values = values.cast(pa.float32())
    return values.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)


def _floats_to_text(values: pa.Array) -> pa.Array:
    if pa.types.is_float16(values.type):
        values = values.cast(pa.float32())  # exact; Arrow writes float16 poorly
    x = _float64(values)
    with np.errstate(invalid="ignore"):
        whole = (np.floor(x) == x) & (x >= -_INT64_LIMIT) & (x < _INT64_LIMIT)
    all_whole = bool(whole.all())
    if all_whole or whole.any():
        int_text = _decimal_text(np.where(whole, x, 0.0).astype(np.int64), False, values)
        if all_whole:
            return int_text
    shortest = pc.cast(values, pa.string()).cast(pa.binary())  # shortest round trip
    if not whole.any():
        return shortest
    return pc.if_else(pa.array(whole), int_text, shortest)


@numba.njit(cache=True, nogil=True, inline="always")
def _magnitude(v: np.int64, negative: bool) -> np.uint64:
    """|v| as uint64 (v's bits as uint64 unless negative); no overflow at int64 min."""
    return np.uint64(-(v + 1)) + np.uint64(1) if negative else np.uint64(v)


@numba.njit(cache=True, nogil=True)
def _decimal_kernel(values: np.ndarray, unsigned: bool) -> tuple[np.ndarray, np.ndarray]:
    """(int32 offsets (R + 1,), uint8 text) of the decimal text of int64 values
    (read as uint64 bits if ``unsigned``), as ``hashing._hash_decimal`` writes them."""
    n = values.shape[0]
    offsets = np.empty(n + 1, dtype=np.int32)
    offsets[0] = 0
    ten = np.uint64(10)
    for i in range(n):  # pass 1: lengths
        v = values[i]
        negative = (not unsigned) and v < 0
        mag = _magnitude(v, negative)
        digits = 1
        while mag >= ten:
            mag = mag // ten
            digits += 1
        offsets[i + 1] = offsets[i] + digits + (1 if negative else 0)
    data = np.empty(offsets[n], dtype=np.uint8)
    for i in range(n):  # pass 2: digits, right to left
        v = values[i]
        negative = (not unsigned) and v < 0
        mag = _magnitude(v, negative)
        p = offsets[i + 1]
        while True:
            p -= 1
            data[p] = np.uint8(48 + mag % ten)
            mag = mag // ten
            if mag == 0:
                break
        if negative:
            data[p - 1] = 45  # '-'
    return offsets, data


def _decimal_text(ints: np.ndarray, unsigned: bool, like: pa.Array) -> pa.Array:
    """Binary decimal text of int64 ``ints`` (R,), null where ``like`` is null."""
    offsets, data = _decimal_kernel(ints, unsigned)
    validity = pc.is_valid(like).buffers()[1] if like.null_count else None
    return pa.Array.from_buffers(
        pa.binary(),
        len(ints),
        [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=like.null_count,
    )


def _ints_to_text(values: pa.Array) -> pa.Array:
    unsigned = pa.types.is_unsigned_integer(values.type)
    ints = values.fill_null(0).to_numpy(zero_copy_only=False)
    ints = ints.astype(np.uint64 if unsigned else np.int64, copy=False).view(np.int64)
    return _decimal_text(ints, unsigned, values)


def _decimals_to_text(values: pa.Array) -> pa.Array:
    text = pc.cast(values, pa.string())
    if values.type.scale > 0:
        text = pc.replace_substring_regex(text, r"(\.[0-9]*?)0+$", r"\1")
        text = pc.replace_substring_regex(text, r"\.$", "")
        text = pc.replace_substring_regex(text, r"^-0$", "0")
    return text.cast(pa.binary())


def float_texts(values: list[float]) -> list[bytes]:
    """The text of Python floats per the table above (the same as ``to_text``)."""
    out: list[bytes | None] = [None] * len(values)
    rest: list[int] = []
    for i, v in enumerate(values):
        if math.isfinite(v) and v.is_integer() and -_INT64_LIMIT <= v < _INT64_LIMIT:
            out[i] = str(int(v)).encode()
        else:
            rest.append(i)
    if rest:
        shortest = pc.cast(pa.array([values[i] for i in rest], pa.float64()), pa.string())
        for i, text in zip(rest, shortest.to_pylist(), strict=True):
            out[i] = text.encode()
    return out  # type: ignore[return-value]
