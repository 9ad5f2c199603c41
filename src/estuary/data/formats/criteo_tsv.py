"""``criteo_tsv``: the Criteo Display Advertising Challenge layout.

Tab-separated, no header, no quoting; by default 40 columns
``label, I1..I13, C1..C26`` (``SourceSpec.columns`` overrides the names).
"""

from __future__ import annotations

from collections.abc import Iterator

from estuary.data.formats.text import Dialect, read_delimited
from estuary.data.formats.types import RawChunk, ReadRequest

__all__ = ["CRITEO_COLUMNS", "CriteoTsvReader"]

CRITEO_COLUMNS: list[str] = (
    ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
)


class CriteoTsvReader:
    """Reader for ``format: criteo_tsv``."""

    name = "criteo_tsv"
    dialect = Dialect(delimiter="\t", quote_char=False, header=False)

    def read(self, request: ReadRequest) -> Iterator[RawChunk]:
        names = request.source.columns or CRITEO_COLUMNS
        return read_delimited(request, self.dialect, list(names))
