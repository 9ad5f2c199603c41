"""Errors raised while reading a job specification."""

from __future__ import annotations


class ConfigError(ValueError):
    """A job-spec value is wrong. ``path`` is the dotted field path
    (``model.embedding.default.dim``); the message reads ``path: reason``."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)
