"""File formats, found by name.

``get_format("criteo_tsv")`` returns a ``FormatReader``. Built-in readers are
imported lazily from the ``FORMATS`` table in ``estuary.plugins``;
``register_format`` (or an ``estuary.formats`` entry point) adds more. Adding a
format = one module with a reader class + one line in that table (or a
``register_format`` call) + a subclass of the conformance suite in
``tests/data/test_formats.py``.
"""

from __future__ import annotations

from estuary.data.formats.types import FormatReader, RawChunk, ReadRequest
from estuary.plugins import FORMATS

__all__ = [
    "FormatReader",
    "RawChunk",
    "ReadRequest",
    "available_formats",
    "get_format",
    "register_format",
]


def register_format(reader: FormatReader, *, name: str | None = None) -> None:
    """Make ``reader`` available as ``name`` (default ``reader.name``)."""
    FORMATS.register(name or reader.name, reader)


def available_formats() -> list[str]:
    """Names ``get_format`` accepts, sorted."""
    return FORMATS.names()


def get_format(name: str, where: str = "data.sources[].format") -> FormatReader:
    """The reader registered as ``name``.

    Raises:
        ConfigError: unknown format; the path is ``where``.
    """
    reader: FormatReader = FORMATS.get(name, where)
    return reader
