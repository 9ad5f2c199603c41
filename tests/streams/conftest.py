"""Real NATS and Redis servers for the stream tests, started on loopback.

Each server runs from the Debian binary (``nats-server``, ``redis-server``) on a
free port with its data in a temp folder, and is SIGKILLed at the end. Tests
that kill and restart a server get their own (``fresh_nats``, ``fresh_redis``);
the others share one per session and use unique subjects/keys. Without the
binary the tests skip, saying what to install (``.ci/run`` installs both).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_READY_TIMEOUT_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nats_ready(port: int) -> bool:
    """The server greets with INFO {...}; JetStream must be on."""
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        line = s.makefile("rb").readline()
    if not line.startswith(b"INFO "):
        return False
    return bool(json.loads(line[5:]).get("jetstream"))


def _redis_ready(port: int) -> bool:
    """PING answers +PONG once the data (AOF) is loaded (-LOADING before)."""
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")


class Server:
    """One broker process on 127.0.0.1:``port`` keeping its data in ``data_dir``.

    ``kill()`` is SIGKILL (no clean shutdown); ``start()`` again reuses the port
    and the data, like a crashed server coming back.
    """

    def __init__(
        self,
        kind: str,
        argv: Callable[[int, Path], list[str]],
        ready: Callable[[int], bool],
        data_dir: Path,
    ) -> None:
        self.kind = kind
        self.port = _free_port()
        self.data_dir = data_dir
        self._argv = argv
        self._ready = ready
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir / "server.log"

    @property
    def url(self) -> str:
        return f"{self.kind}://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None, "already running"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self._argv(self.port, self.data_dir), stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if self._ready(self.port):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        self.kill()
        tail = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.kind} server on port {self.port} did not start:\n{tail}")

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()


def _binary(name: str) -> str | None:
    """The binary's path; Debian puts nats-server in /usr/sbin, often not on PATH."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/usr/local/bin")


def _nats_argv(port: int, data_dir: Path) -> list[str]:
    return [
        _binary("nats-server") or "nats-server",
        "-js",
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        "-sd",
        str(data_dir),
    ]


def _redis_argv(port: int, data_dir: Path) -> list[str]:
    # --save '' (no RDB snapshots); the append-only file with fsync on every
    # write is what lets a SIGKILLed server come back with all its entries.
    return [
        _binary("redis-server") or "redis-server",
        "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(data_dir),
        "--appendonly", "yes", "--appendfsync", "always",
    ]  # fmt: skip


_KINDS = {
    "nats": ("nats-server", "nats", _nats_argv, _nats_ready),
    "redis": ("redis-server", "redis", _redis_argv, _redis_ready),
}


def _server(kind: str, data_dir: Path) -> Iterator[Server]:
    binary, module, argv, ready = _KINDS[kind]
    if _binary(binary) is None:
        pytest.skip(f"{binary} is not installed (apt-get install {binary}; .ci/run does)")
    pytest.importorskip(module, reason=f"the {module} client is missing (pip install -e '.[dev]')")
    server = Server(kind, argv, ready, data_dir)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server("nats", tmp_path_factory.mktemp("nats"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server("redis", tmp_path_factory.mktemp("redis"))


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[Server]:
    """A server of its own, for tests that kill it."""
    yield from _server("nats", tmp_path)


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[Server]:
    """A server of its own, for tests that kill it."""
    yield from _server("redis", tmp_path)
