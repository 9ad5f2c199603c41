"""The format-reader interface and the chunk it yields."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from estuary.config.spec import SourceSpec
from estuary.data.badrows import BadRow
from estuary.data.types import Int64Array

__all__ = ["FormatReader", "RawChunk", "ReadRequest"]


@dataclass(frozen=True)
class RawChunk:
    """R rows of one file whose fields were split but not yet interpreted.

    Args:
        file: the file's display name (used in bad-row reports).
        columns: requested column -> (R,) raw field text: a ``pa.binary()``
            array; for typed formats also a dictionary array of ``pa.binary()``
            text (each distinct value parsed and hashed once) or an ``int64``
            array standing for its decimal text (see ``formats.values.to_raw``).
            A missing value is empty or null; the decoder treats both alike.
            A mapping, not always a dict: the delimited-text readers hand a
            ``tokenize.TextColumns``, which builds each array when first read.
        line_numbers: int64 (R,) 1-based physical line of each row in the
            decompressed file (header and blank lines included); for formats
            without lines (Parquet) the 1-based row number in the file.
        invalid: rows the reader rejected (wrong field count, a line that is not
            a JSON object, ...), in line order.
    """

    file: str
    columns: Mapping[str, pa.Array]
    line_numbers: Int64Array
    invalid: list[BadRow]

    @property
    def num_rows(self) -> int:
        return int(self.line_numbers.shape[0])

    @property
    def rows_read(self) -> int:
        """Data rows seen, good-so-far + rejected (blank lines excluded)."""
        return self.num_rows + len(self.invalid)


@dataclass(frozen=True)
class ReadRequest:
    """What to read from one file.

    Args:
        path: the file.
        display: its name in messages.
        source: the ``SourceSpec`` it came from.
        where: config path of that source (``data.sources[0]``) for errors.
        columns: columns to return, in order; each must exist in the file.
        block_size_bytes: decompressed text per parsed block (memory per worker).
        threads: parsing threads (1 = parse in the calling thread).
    """

    path: Path
    display: str
    source: SourceSpec
    where: str
    columns: Sequence[str]
    block_size_bytes: int = 2 << 20
    threads: int = 2


class FormatReader(Protocol):
    """Reads one file format into ``RawChunk``s, in file order.

    Implementations register by name in ``estuary.data.formats`` and must pass
    the conformance suite in ``tests/data/test_formats.py``.
    """

    name: str

    def read(self, request: ReadRequest) -> Iterator[RawChunk]:
        """Yield the file's rows in order, a block at a time.

        Raises:
            DataFileError: the file cannot be read (names the file).
            ConfigError: a requested column is not in the file.
        """
        ...
