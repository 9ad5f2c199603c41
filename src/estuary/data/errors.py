"""Errors and warnings raised while reading data."""

from __future__ import annotations

__all__ = ["BadDataError", "DataError", "DataFileError", "DataWarning"]


class DataError(Exception):
    """Base class of the data layer's errors."""


class BadDataError(DataError):
    """Bad rows exceeded ``data.max_bad_row_ratio``; the message has the counts and
    the first bad rows as ``file:line: reason``."""


class DataFileError(DataError):
    """A file cannot be read at all (missing, no glob match, truncated or corrupt
    compressed stream, rows spanning lines); the message names the file."""


class DataWarning(UserWarning):
    """Something worth a look that does not stop the run (an empty file)."""
