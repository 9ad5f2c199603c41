"""File formats, found by name.

``get_format("criteo_tsv")`` returns a ``FormatReader``. Built-in readers are
imported lazily from the table below; ``register_format`` adds more. Adding a
format = one module with a reader class + one line here (or a
``register_format`` call) + a subclass of the conformance suite in
``tests/data/test_formats.py``.
"""

from __future__ import annotations

import importlib

from estuary.config.errors import ConfigError
from estuary.data.formats.types import FormatReader, RawChunk, ReadRequest

__all__ = [
    "FormatReader",
    "RawChunk",
    "ReadRequest",
    "available_formats",
    "get_format",
    "register_format",
]

_BUILTIN: dict[str, str] = {
    "criteo_tsv": "estuary.data.formats.criteo_tsv:CriteoTsvReader",
    "csv": "estuary.data.formats.delimited:CsvReader",
    "jsonl": "estuary.data.formats.jsonl:JsonlReader",
    "parquet": "estuary.data.formats.parquet:ParquetReader",
    "tsv": "estuary.data.formats.delimited:TsvReader",
}
_REGISTERED: dict[str, FormatReader] = {}


def register_format(reader: FormatReader, *, name: str | None = None) -> None:
    """Make ``reader`` available as ``name`` (default ``reader.name``)."""
    _REGISTERED[name or reader.name] = reader


def available_formats() -> list[str]:
    """Names ``get_format`` accepts, sorted."""
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def get_format(name: str, where: str = "data.sources[].format") -> FormatReader:
    """The reader registered as ``name``.

    Raises:
        ConfigError: unknown format; the path is ``where``.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    target = _BUILTIN.get(name)
    if target is None:
        known = ", ".join(available_formats())
        raise ConfigError(where, f"format {name!r} is unknown (available: {known})")
    module_name, _, attr = target.partition(":")
    reader: FormatReader = getattr(importlib.import_module(module_name), attr)()
    _REGISTERED[name] = reader
    return reader
