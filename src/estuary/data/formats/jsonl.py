"""``jsonl``: one JSON object per line (JSON Lines), keys naming the columns.

Pipeline for one file: the same decompression and blocks of whole lines as the
delimited formats (``text``), then per block, on the parse pool:

- **fast path**: ``pyarrow.json.read_json`` on the whole block (C++, releases
  the GIL), taken only when the result can be mapped to lines with certainty:
  every line starts with ``{`` and ends with ``}``, the block is valid UTF-8,
  Arrow parses it without error into exactly one row per line, and every
  requested column holds plain values (integers, floats that cannot hide a
  rounded big integer, strings, booleans, nulls);
- **exact path** otherwise: ``json.loads`` line by line (Python), which tells
  each bad line apart, then the columns converted by Arrow from the parsed
  objects (per value in Python only for a column of mixed types). Both paths
  give identical text for identical input.

Rows and values:

- a key is a column; a missing key or ``null`` is a missing value (empty field);
  a key given twice in one object: the last value counts;
- values become text per ``values`` (integers in decimal, whole floats as
  integers, ``true``/``false`` as ``1``/``0``, strings unchanged);
- a bad row (skipped, reported as ``file:line``): a line that is not valid
  UTF-8, not valid JSON, not an object, or has an array/object (or a string
  with an unpaired surrogate escape) under a requested key;
- blank lines (empty or only spaces, tabs, ``\\r``) are not rows and not bad;
- line numbers are physical lines of the decompressed file, 1-based.

A requested column that appears in no row of a file is not an error (writers
such as Spark drop null keys), but it is warned about (``DataWarning``) since it
usually means a misspelt schema name.

Throughput of the parse alone (one core, Criteo rows as JSON, ~475 bytes a
row): ~200k rows/s on the fast path, ~70k rows/s on the exact path (a block
with one bad line takes it). Blocks parse in parallel on the fast path; the
exact path mostly holds the GIL. ``bench/data.py --jsonl`` measures the whole
pipeline.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson

from estuary.config.errors import ConfigError
from estuary.data.badrows import BadRow
from estuary.data.errors import DataWarning
from estuary.data.formats.text import parse_blocks, text_blocks
from estuary.data.formats.types import RawChunk, ReadRequest
from estuary.data.formats.values import float_texts, one_array, to_raw

__all__ = ["JsonlReader", "block_parser", "object_columns"]

_OPEN, _CLOSE, _CR, _NEWLINE = ord("{"), ord("}"), ord("\r"), ord("\n")
_EXACT_FLOAT = 2.0**53  # a whole double at or above this may be a rounded integer
_BLANK = b" \t\r"
_BOM = b"\xef\xbb\xbf"
# What pa.array may raise on Python values it cannot convert as one column (mixed
# types, an integer beyond int64, a lone surrogate, deep nesting).
_CONVERSION_ERRORS = (pa.ArrowException, ValueError, TypeError, OverflowError, RecursionError)


class JsonlReader:
    """Reader for ``format: jsonl``."""

    name = "jsonl"

    def read(self, request: ReadRequest) -> Iterator[RawChunk]:
        if request.source.columns is not None:
            raise ConfigError(
                f"{request.where}.columns",
                "not used by format 'jsonl', whose keys name the columns",
            )
        return self._read(request)

    def _read(self, request: ReadRequest) -> Iterator[RawChunk]:
        parser = _BlockParser(request)
        seen: set[str] = set()
        rows = 0
        for chunk in parse_blocks(request, text_blocks(request), parser):
            seen.update(c for c, values in chunk.columns.items() if values.null_count < len(values))
            rows += chunk.num_rows
            yield chunk
        absent = [c for c in request.columns if c not in seen]
        if rows and absent:
            warnings.warn(
                f"{request.display}: no row has a value for {', '.join(map(repr, absent))} "
                "(all missing; is the schema name right?)",
                DataWarning,
                stacklevel=2,
            )


def block_parser(request: ReadRequest) -> Callable[[bytes, int, int], RawChunk]:
    """The parser of one block of whole JSON lines, ``parse(block, first_line,
    lines)``, for text that is not a file (stream messages); thread-safe."""
    return _BlockParser(request)


class _BlockParser:
    """Parses one block of whole lines into a RawChunk (thread-safe, stateless)."""

    def __init__(self, request: ReadRequest) -> None:
        self.display = request.display
        self.columns = list(request.columns)

    def __call__(self, block: bytes, first_line: int, lines: int) -> RawChunk:
        chunk = self._fast(block, first_line, lines)
        return chunk if chunk is not None else self._exact(block, first_line)

    # -- fast path: pyarrow.json ----------------------------------------------------

    def _fast(self, block: bytes, first_line: int, lines: int) -> RawChunk | None:
        """The chunk via pyarrow.json, or None where it cannot be trusted line by line."""
        if not _one_object_per_line(block) or not _valid_utf8(block):
            return None
        table = _read_json(block, None)
        if table is None or table.num_rows != lines:
            return None
        # pyarrow infers timestamps from date-like strings; read those as strings.
        stamps = [
            c
            for c in self.columns
            if c in table.column_names and pa.types.is_temporal(table.schema.field(c).type)
        ]
        if stamps:
            table = _read_json(block, pa.schema([(c, pa.string()) for c in stamps]))
            if table is None or table.num_rows != lines:
                return None
        columns: dict[str, pa.Array] = {}
        for c in self.columns:
            if c not in table.column_names:
                columns[c] = pa.nulls(lines, pa.binary())
                continue
            values = one_array(table.column(c))
            if not _plain_json_type(values):
                return None  # arrays or objects (bad rows) or a rounded big integer
            columns[c] = to_raw(values)
        return RawChunk(
            file=self.display,
            columns=columns,
            line_numbers=np.arange(first_line, first_line + lines, dtype=np.int64),
            invalid=[],
        )

    # -- exact path: json.loads per line --------------------------------------------

    def _exact(self, block: bytes, first_line: int) -> RawChunk:
        objects: list[dict[str, Any]] = []
        numbers: list[int] = []
        invalid: list[BadRow] = []
        lines = block.split(b"\n")
        if block.endswith(b"\n"):
            lines.pop()
        for i, line in enumerate(lines):
            number = first_line + i
            if number == 1:
                line = line.removeprefix(_BOM)
            if not line.strip(_BLANK):
                continue
            reason = None
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                reason = f"not valid UTF-8 (byte {e.start + 1} is {line[e.start]:#04x})"
            else:
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    reason = f"not valid JSON: {e.msg} (column {e.colno})"
                except (ValueError, RecursionError) as e:  # e.g. an integer of 5000 digits
                    reason = f"not valid JSON: {e}"
                else:
                    if isinstance(obj, dict):
                        objects.append(obj)
                        numbers.append(number)
                        continue
                    reason = f"not a JSON object (found {_json_kind(obj)})"
            invalid.append(BadRow(self.display, number, reason))

        bad: dict[int, str] = {}  # row -> reason of its first bad requested value
        columns = object_columns(self.columns, objects, bad)
        index = np.arange(len(objects))
        if bad:
            for row, reason in bad.items():
                invalid.append(BadRow(self.display, numbers[row], reason))
            invalid.sort(key=lambda b: b.line)
            keep = np.ones(len(objects), dtype=bool)
            keep[list(bad)] = False
            index = np.flatnonzero(keep)
            columns = {c: values.take(pa.array(index)) for c, values in columns.items()}
        return RawChunk(
            file=self.display,
            columns=columns,
            line_numbers=np.asarray(numbers, dtype=np.int64)[index],
            invalid=invalid,
        )


def object_columns(
    names: Sequence[str], objects: list[dict[str, Any]], bad: dict[int, str]
) -> dict[str, pa.Array]:
    """The requested columns of parsed JSON objects as ``RawChunk`` columns (R,);
    rows with unusable values (arrays, objects, unpaired surrogates) go into ``bad``
    (row -> reason naming the field). Used by this reader's exact path and by the
    prediction server (``estuary.serve.pipeline``), so both read values alike."""
    try:  # every key one type throughout (the usual case): converted in C++
        table: pa.StructArray | None = pa.array(objects, pa.struct([]) if not objects else None)
    except _CONVERSION_ERRORS:
        table = None
    columns = {}
    for c in names:
        if table is not None and table.type.get_field_index(c) < 0:
            columns[c] = pa.nulls(len(objects), pa.binary())
        elif table is not None and _plain_json_type(table.field(c)):
            columns[c] = to_raw(table.field(c))
        else:
            columns[c] = _column(c, [obj.get(c) for obj in objects], bad)
    return columns


def _column(name: str, values: Sequence[Any], bad: dict[int, str]) -> pa.Array:
    """One column of Python values as a RawChunk column; rows with unusable values
    (arrays, objects, unpaired surrogates) go into ``bad``."""
    try:  # one type throughout (the usual case): converted in C++
        array = pa.array(values)
    except _CONVERSION_ERRORS:
        array = None  # mixed types, an integer beyond int64, a lone surrogate
    if array is not None and _plain_json_type(array):
        return to_raw(array)
    return pa.array(_column_texts(name, values, bad), pa.binary())


def _plain_json_type(array: pa.Array) -> bool:
    """Null, boolean, int64, string, or a double that cannot hide a rounded integer."""
    kind = array.type
    if pa.types.is_floating(kind):
        return not _may_hide_big_integer(array)
    return (
        pa.types.is_null(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_integer(kind)
        or pa.types.is_string(kind)
    )


def _column_texts(name: str, values: Sequence[Any], bad: dict[int, str]) -> list[bytes | None]:
    """One column's Python values as text; rows with unusable values go into ``bad``."""
    out: list[bytes | None] = [None] * len(values)
    floats: list[int] = []
    for i, v in enumerate(values):
        if v is None:
            continue
        if isinstance(v, str):
            try:
                out[i] = v.encode("utf-8")
            except UnicodeEncodeError:
                bad.setdefault(i, f"field {name}: a string with an unpaired surrogate escape")
        elif isinstance(v, bool):  # before int: bool is an int
            out[i] = b"1" if v else b"0"
        elif isinstance(v, int):
            out[i] = str(v).encode()
        elif isinstance(v, float):
            floats.append(i)
        else:
            bad.setdefault(i, f"field {name}: a JSON {_json_kind(v)} is not a single value")
    if floats:
        for i, text in zip(floats, float_texts([values[i] for i in floats]), strict=True):
            out[i] = text
    return out


def _json_kind(value: object) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return "number"


def _read_json(block: bytes, strings: pa.Schema | None) -> pa.Table | None:
    try:
        return pajson.read_json(
            pa.py_buffer(block),
            read_options=pajson.ReadOptions(use_threads=False, block_size=len(block) + 1),
            parse_options=pajson.ParseOptions(
                explicit_schema=strings, unexpected_field_behavior="infer"
            ),
        )
    except pa.ArrowException:
        return None


def _one_object_per_line(block: bytes) -> bool:
    """Every line starts with ``{`` and ends with ``}`` (before an optional ``\\r``).

    With that, a block Arrow parses without error into as many rows as lines has
    exactly one object per line: each line starts a new top-level value, and a
    ``}`` followed by a newline and ``{`` must end one.
    """
    buf = np.frombuffer(block, dtype=np.uint8)
    if buf.shape[0] == 0:
        return False
    newlines = np.flatnonzero(buf == _NEWLINE)
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [buf.shape[0]]))
    if block.endswith(b"\n"):
        starts, ends = starts[:-1], ends[:-1]
    if (ends - starts < 2).any():
        return False  # a blank line, or one too short to be an object
    last = buf[ends - 1]
    closed = (last == _CLOSE) | ((last == _CR) & (buf[ends - 2] == _CLOSE))
    return bool((buf[starts] == _OPEN).all() and closed.all())


def _valid_utf8(block: bytes) -> bool:
    offsets = pa.py_buffer(np.array([0, len(block)], dtype=np.int64).tobytes())
    text = pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(block)])
    try:
        text.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _may_hide_big_integer(values: pa.Array) -> bool:
    """A whole float with magnitude >= 2**53 (pyarrow reads a big JSON integer as a
    rounded double; the exact path keeps all its digits)."""
    x = values.fill_null(0.0).to_numpy(zero_copy_only=False)
    with np.errstate(invalid="ignore"):
        return bool(((np.abs(x) >= _EXACT_FLOAT) & np.isfinite(x) & (np.floor(x) == x)).any())
