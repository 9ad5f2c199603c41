"""``csv`` and ``tsv``: delimited text whose first line names the columns.

Standard CSV quoting (``"``) is understood; a quoted value must not contain a
newline (every row is one line, so bad rows can be reported as ``file:line``).
"""

from __future__ import annotations

from collections.abc import Iterator

from estuary.config.errors import ConfigError
from estuary.data.formats.text import Dialect, read_delimited
from estuary.data.formats.types import RawChunk, ReadRequest

__all__ = ["CsvReader", "TsvReader"]


class _HeaderDelimitedReader:
    name: str
    dialect: Dialect

    def read(self, request: ReadRequest) -> Iterator[RawChunk]:
        if request.source.columns is not None:
            # Refuse rather than silently ignore: the header row names the columns.
            raise ConfigError(
                f"{request.where}.columns",
                f"not used by format {self.name!r}, which reads names from its header row",
            )
        return read_delimited(request, self.dialect)


class CsvReader(_HeaderDelimitedReader):
    """Reader for ``format: csv`` (comma-separated, header row)."""

    name = "csv"
    dialect = Dialect(delimiter=",", quote_char='"', header=True)


class TsvReader(_HeaderDelimitedReader):
    """Reader for ``format: tsv`` (tab-separated, header row)."""

    name = "tsv"
    dialect = Dialect(delimiter="\t", quote_char='"', header=True)
