"""Synthetic-data file formats, by name: an Arrow table per chunk -> bytes on disk.

``chunk_table`` turns a ``SyntheticChunk`` into the one Arrow table every format
writes (``label`` int8, ``I*`` int64, ``C*`` 8-hex strings, nullable, then the
extra columns); ``SYNTHETIC_FORMATS[name].open(path, gzip_level)`` returns a
writer. Adding a format = one writer class + one line in the table.
"""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from estuary.data.synthetic.model import SyntheticChunk

__all__ = ["EXTRA_COLUMNS", "SYNTHETIC_FORMATS", "FileWriter", "SyntheticFormat", "chunk_table"]

EXTRA_COLUMNS = ("row_id", "event_time_ms")
"""Optional columns, appended after ``C*`` in this order."""


def chunk_table(chunk: SyntheticChunk, extra_columns: tuple[str, ...] = ()) -> pa.Table:
    """The chunk as an Arrow table: ``label`` int8, ``I*`` int64 and ``C*`` string
    (8 hex digits), nullable, then ``extra_columns`` (int64)."""
    columns: dict[str, pa.Array] = {"label": pa.array(chunk.labels)}
    for d in range(chunk.dense.shape[1]):
        columns[f"I{d + 1}"] = pa.array(chunk.dense[:, d], mask=~chunk.dense_valid[:, d])
    for f in range(chunk.sparse.shape[1]):
        columns[f"C{f + 1}"] = _hex_strings(chunk.sparse[:, f], chunk.sparse_valid[:, f])
    extras = {"row_id": chunk.row_ids, "event_time_ms": chunk.event_time_ms}
    for name in extra_columns:
        columns[name] = pa.array(extras[name])
    return pa.table(columns)


# 65536 x 4 ASCII bytes: the hex digits of every 16-bit value, read as one uint32.
_HEX16 = np.frombuffer(b"".join(b"%04x" % v for v in range(1 << 16)), dtype=np.uint32)


def _hex_strings(ids: np.ndarray, valid: np.ndarray) -> pa.Array:
    """uint32 (B,) -> Arrow strings of 8 lowercase hex digits; null where not valid.
    Built straight from buffers (two table lookups per id, no Python strings)."""
    text = np.empty((ids.shape[0], 2), np.uint32)
    text[:, 0] = _HEX16[ids >> np.uint32(16)]
    text[:, 1] = _HEX16[ids & np.uint32(0xFFFF)]
    offsets = np.arange(0, 8 * ids.shape[0] + 1, 8, dtype=np.int32)
    nulls = int(ids.shape[0] - np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.StringArray.from_buffers(
        ids.shape[0], pa.py_buffer(offsets), pa.py_buffer(text), bitmap, nulls
    )


class FileWriter(Protocol):
    """Writes Arrow tables (chunks of one file) in order; ``close`` finishes the file."""

    def write(self, table: pa.Table) -> None: ...
    def close(self) -> None: ...


class _TextSink:
    """A binary file, gzip-compressed on the way when ``level`` is set (zlib
    releases the GIL while compressing)."""

    def __init__(self, path: Path, level: int | None) -> None:
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._zip = zlib.compressobj(level, zlib.DEFLATED, 31) if level else None

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(self._zip.compress(data) if self._zip else data)

    def close(self) -> None:
        if self._zip:
            self._file.write(self._zip.flush())
        self._file.close()


class _DelimitedWriter:
    def __init__(self, sink: _TextSink, delimiter: str, header: bool) -> None:
        self._sink, self._delimiter, self._header = sink, delimiter, header

    def write(self, table: pa.Table) -> None:
        buffer = io.BytesIO()
        options = pacsv.WriteOptions(
            include_header=self._header, delimiter=self._delimiter, quoting_style="none"
        )  # no value ever needs quoting: numbers and hex digits only
        pacsv.write_csv(table, buffer, options)
        self._header = False
        self._sink.write(buffer.getbuffer())

    def close(self) -> None:
        self._sink.close()


class _JsonLinesWriter:
    def __init__(self, sink: _TextSink) -> None:
        self._sink = sink

    def write(self, table: pa.Table) -> None:
        """One ``{"name": value, ...}`` line per row, joined by Arrow kernels."""
        parts: list[pa.Array | str] = []
        for i, (name, column) in enumerate(zip(table.column_names, table.columns, strict=True)):
            if pa.types.is_string(column.type):
                text = pc.binary_join_element_wise('"', column, '"', "")
            else:
                text = pc.cast(column, pa.string())
            parts += [("{" if i == 0 else ",") + json.dumps(name) + ":", pc.fill_null(text, "null")]
        lines = pc.binary_join_element_wise(*parts, "}\n", "").combine_chunks()
        offsets = np.frombuffer(lines.buffers()[1], np.int32)[lines.offset :]
        data = memoryview(lines.buffers()[2])[offsets[0] : offsets[len(lines)]]
        self._sink.write(data)

    def close(self) -> None:
        self._sink.close()


class _ParquetWriter:
    def __init__(self, path: Path, compression: str) -> None:
        self._path, self._compression = path, compression
        self._writer: Any = None  # pyarrow.parquet.ParquetWriter, opened on first write

    def write(self, table: pa.Table) -> None:
        import pyarrow.parquet as pq

        if self._writer is None:
            self._writer = pq.ParquetWriter(self._path, table.schema, compression=self._compression)
        self._writer.write_table(table)  # one row group per chunk

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


@dataclass(frozen=True)
class SyntheticFormat:
    """One output format.

    Args:
        extension: file name suffix, without ``.gz``.
        text: gzip wraps the whole file (and adds ``.gz``); else the format
            compresses inside (Parquet pages).
        open: ``(path, gzip_level or None) -> writer`` with ``write(table)``, ``close()``.
    """

    extension: str
    text: bool
    open: Callable[[Path, int | None], FileWriter]


SYNTHETIC_FORMATS: dict[str, SyntheticFormat] = {
    "criteo_tsv": SyntheticFormat(
        "tsv", True, lambda p, z: _DelimitedWriter(_TextSink(p, z), "\t", False)
    ),
    "csv": SyntheticFormat("csv", True, lambda p, z: _DelimitedWriter(_TextSink(p, z), ",", True)),
    "jsonl": SyntheticFormat("jsonl", True, lambda p, z: _JsonLinesWriter(_TextSink(p, z))),
    "parquet": SyntheticFormat(
        "parquet", False, lambda p, z: _ParquetWriter(p, "snappy" if z is None else "gzip")
    ),
}
"""Output formats by name."""
