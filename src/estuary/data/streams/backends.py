"""Stream backends by name: ``get_backend("nats")`` (``estuary.plugins.STREAM_BACKENDS``,
imported on first use, with an install hint when the client package is missing)."""

from __future__ import annotations

from typing import Any

from estuary.data.streams.types import StreamBackend, StreamError
from estuary.plugins import STREAM_BACKENDS
from estuary.registry import PluginImportError, Registry

__all__ = ["BACKENDS", "available_backends", "get_backend", "register_backend"]

BACKENDS: Registry[StreamBackend] = STREAM_BACKENDS
"""The backends by name (``estuary.plugins.STREAM_BACKENDS``)."""


def register_backend(
    backend: StreamBackend, *, name: str | None = None, section: Any = None
) -> None:
    """Make ``backend`` available as ``name`` (default ``backend.name``).

    ``section`` declares the fields of its stream section (a dataclass, or a
    ``"module:attr"`` string naming one); default: ``backend.section``, if it has
    one. Without a declaration the section takes the former flat fields
    (``UndeclaredSection``)."""
    BACKENDS.register(name or backend.name, backend, section=section)


def available_backends() -> list[str]:
    """Names ``get_backend`` accepts, sorted."""
    return BACKENDS.names()


def get_backend(name: str, where: str = "stream.kind") -> StreamBackend:
    """The backend registered as ``name``, importing it on first use.

    Raises:
        ConfigError: unknown name (the path is ``where``).
        StreamError: its client package is not installed (with the pip command).
    """
    try:
        return BACKENDS.get(name, where)
    except PluginImportError as e:
        raise StreamError(str(e)) from e
