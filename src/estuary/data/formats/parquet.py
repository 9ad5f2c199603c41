"""``parquet``: Apache Parquet files, read with ``pyarrow.parquet``.

Read row group by row group, in batches of about ``block_size_bytes`` of the
requested columns (estimated from the row group's uncompressed sizes), and only
the requested columns: memory is one row group's compressed column chunks plus
one batch. Compression (snappy, zstd, gzip, ...) is inside the file and handled
by Parquet; ``compression`` must be ``auto`` or ``none``.

- Column names come from the file's schema (top-level fields); a requested
  column that is not there is a ``ConfigError``; a nested column (list, struct,
  map) too.
- Typed values become text per ``values`` (integers in decimal, whole floats as
  integers, booleans ``1``/``0``, strings unchanged; null = missing), so ids are
  the same as from the same rows in a text format.
- A "line" is a **row**: line numbers are 1-based row numbers in the file
  (row groups in order), so a bad row is reported as ``file.parquet:<row>``.
- A 0-byte file has no rows (like an empty text file); a file that is not
  Parquet, truncated or with a corrupt page is a ``DataFileError`` naming it.
  Page checksums are verified where the writer stored them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from estuary.config.errors import ConfigError
from estuary.data.errors import DataFileError
from estuary.data.formats.types import RawChunk, ReadRequest
from estuary.data.formats.values import is_scalar_type, to_raw

__all__ = ["ParquetReader"]

_MIN_BYTES_PER_ROW = 1
_DICTIONARY_DATA_BYTES_PER_VALUE = 3  # more: plain pages (a dictionary fallback)


class ParquetReader:
    """Reader for ``format: parquet``."""

    name = "parquet"

    def read(self, request: ReadRequest) -> Iterator[RawChunk]:
        if request.source.columns is not None:
            raise ConfigError(
                f"{request.where}.columns",
                "not used by format 'parquet', which reads names from the file's schema",
            )
        if request.source.compression not in ("auto", "none"):
            raise ConfigError(
                f"{request.where}.compression",
                f"{request.source.compression!r} does not apply to format 'parquet', "
                "which is compressed inside the file; use auto or none",
            )
        return self._read(request)

    def _read(self, request: ReadRequest) -> Iterator[RawChunk]:
        display = request.display
        try:
            size = request.path.stat().st_size
        except FileNotFoundError:
            raise DataFileError(f"{display}: file not found") from None
        if size == 0:
            return  # 0 rows; the caller warns
        try:
            file = pq.ParquetFile(str(request.path), page_checksum_verification=True)
        except (OSError, pa.ArrowException) as e:
            raise DataFileError(
                f"{display}: not a readable Parquet file (corrupt or truncated?): {e}"
            ) from e
        try:
            yield from self._row_groups(request, file)
        finally:
            file.close()

    def _row_groups(self, request: ReadRequest, file: pq.ParquetFile) -> Iterator[RawChunk]:
        display = request.display
        schema = file.schema_arrow
        _check_columns(request, schema)
        columns = list(request.columns)
        leaf = {file.schema.column(i).path: i for i in range(len(file.schema))}
        text_columns = [c for c in columns if _is_text(schema.field(c).type) and c in leaf]
        readers: dict[tuple[str, ...], pq.ParquetFile] = {(): file}
        first = 1
        try:
            for group in range(file.num_row_groups):
                meta = file.metadata.row_group(group)
                batch_rows = _batch_rows(meta, [leaf[c] for c in columns if c in leaf], request)
                # Text columns stored as a dictionary stay one (see ``values.to_text``).
                dictionary = tuple(c for c in text_columns if _all_dictionary(meta.column(leaf[c])))
                if dictionary not in readers:
                    readers[dictionary] = pq.ParquetFile(
                        str(request.path),
                        metadata=file.metadata,
                        read_dictionary=list(dictionary),
                        page_checksum_verification=True,
                    )
                batches = readers[dictionary].iter_batches(
                    batch_size=batch_rows,
                    row_groups=[group],
                    columns=columns,
                    use_threads=request.threads > 1,
                )
                while True:
                    try:
                        batch = next(batches, None)
                    except (OSError, pa.ArrowException) as e:
                        raise DataFileError(
                            f"{display}: corrupt data in row group {group} (at row {first}): {e}"
                        ) from e
                    if batch is None:
                        break
                    if batch.num_rows == 0:
                        continue
                    yield RawChunk(
                        file=display,
                        columns={c: to_raw(batch.column(c)) for c in columns},
                        line_numbers=np.arange(first, first + batch.num_rows, dtype=np.int64),
                        invalid=[],
                    )
                    first += batch.num_rows
        finally:
            for key, reader in readers.items():
                if key:
                    reader.close()


def _is_text(kind: pa.DataType) -> bool:
    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def _all_dictionary(column: pq.ColumnChunkMetaData) -> bool:
    """The column chunk looks dictionary-encoded throughout: a dictionary page and
    data pages of a few bytes per value (indices). A writer whose dictionary grew
    too big falls back to plain pages; reading those as a dictionary would make
    Arrow build one, slower than reading plain text."""
    if not column.has_dictionary_page or column.dictionary_page_offset is None:
        return False
    dictionary_bytes = column.data_page_offset - column.dictionary_page_offset
    if dictionary_bytes <= 0 or column.num_values <= 0:
        return False
    data_bytes = column.total_compressed_size - dictionary_bytes
    return data_bytes <= _DICTIONARY_DATA_BYTES_PER_VALUE * column.num_values


def _check_columns(request: ReadRequest, schema: pa.Schema) -> None:
    names = schema.names
    for c in request.columns:
        if c not in names:
            raise ConfigError(
                "data.schema",
                f"column {c!r} is not in {request.display} (schema: {', '.join(names)})",
            )
        if names.count(c) > 1:
            raise DataFileError(f"{request.display}: column {c!r} appears twice in the schema")
        kind = schema.field(c).type
        if not is_scalar_type(kind):
            raise ConfigError(
                "data.schema",
                f"column {c!r} of {request.display} has type {kind}, not a single value",
            )


def _batch_rows(meta: pq.RowGroupMetaData, indices: list[int], request: ReadRequest) -> int:
    """Rows per batch so the requested columns hold about ``block_size_bytes``."""
    rows = meta.num_rows
    if rows <= 0:
        return 1
    size = sum(meta.column(i).total_uncompressed_size for i in indices)
    per_row = max(_MIN_BYTES_PER_ROW, size // rows)
    return max(1, request.block_size_bytes // per_row)
