"""Backends are found by name, imported lazily, and a missing client says what
to install."""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid
from typing import Any

import pytest

import estuary.data.streams as streams
import estuary.data.streams.backends as backends
from estuary.config.errors import ConfigError
from estuary.config.streams import StreamSourceSpec
from estuary.data.streams import StreamError, StreamReader, get_backend, open_publisher
from estuary.data.streams.memory import MemoryBackend
from estuary.testing.streams import COLUMNS, read_rows, row


def test_builtin_backends_are_listed() -> None:
    assert {"memory", "nats", "redis"} <= set(streams.available_backends())


def test_an_unknown_kind_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^s\.kind: stream kind 'kafka' is unknown"):
        get_backend("kafka", "s.kind")


def test_a_missing_client_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def without_nats(name: str, *args: Any) -> Any:
        if name == "estuary.data.streams.nats":
            raise ModuleNotFoundError("No module named 'nats'", name="nats")
        return real(name, *args)

    monkeypatch.setattr(backends, "BACKENDS", backends.BACKENDS.copy())  # nats not yet imported
    monkeypatch.setattr(importlib, "import_module", without_nats)
    with pytest.raises(StreamError, match=r"needs the 'nats-py' package: pip install"):
        get_backend("nats")


def test_a_registered_backend_is_used_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    class Mine(MemoryBackend):
        name = "mine"

    monkeypatch.setattr(backends, "BACKENDS", backends.BACKENDS.copy())
    streams.register_backend(Mine())
    assert "mine" in streams.available_backends()
    key = uuid.uuid4().hex
    open_publisher(f"mine://x/{key}").publish([row(1), row(2)])
    spec = StreamSourceSpec(kind="memory", url="memory://x", key=key, format="csv", columns=COLUMNS)
    reader = StreamReader(spec, COLUMNS, connector=get_backend("mine").connector(spec))
    with reader.open():
        assert read_rows(reader, 2)[0] == [1, 2]


def test_importing_streams_does_not_import_the_clients() -> None:
    code = (
        "import sys, estuary.data.streams, estuary.config.streams;"
        "print(sorted(m for m in ('nats', 'redis', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
