"""The error every package raises for a wrong job-spec value.

It lives at the top of the package, below ``config`` and ``estuary.registry``,
so that the plugin registries (which the config loader reads) and the config
package can both raise it; ``estuary.config.errors`` re-exports it.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A job-spec value is wrong. ``path`` is the dotted field path
    (``model.embedding.default.dim``); the message reads ``path: reason``."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)
