"""Errors raised while reading a job specification (``ConfigError``, defined in
``estuary.errors`` so that the plugin registries can raise it too)."""

from __future__ import annotations

from estuary.errors import ConfigError

__all__ = ["ConfigError"]
