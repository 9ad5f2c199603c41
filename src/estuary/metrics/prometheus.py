"""A dependency-free Prometheus exporter: counters and gauges with labels, rendered
in the text exposition format 0.0.4 and served at ``/metrics`` by a stdlib HTTP
server on a daemon thread.

::

    registry = Registry()
    steps = registry.counter("estuary_train_steps_total", "Training steps.")
    rows = registry.gauge("estuary_table_rows", "Rows held.", labels=("table",))
    steps.inc()
    rows.set(1234, table="C1")
    server = MetricsServer(registry, host="127.0.0.1", port=0).start()  # 0: a free port
    ...  # GET http://127.0.0.1:{server.port}/metrics
    server.stop()  # the port is released

Updates and rendering share one lock per registry: an update costs a lock
round trip and a dict write (about a microsecond), a scrape copies the values.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, TypeVar

__all__ = [
    "CONTENT_TYPE",
    "Counter",
    "Gauge",
    "MetricsServer",
    "Registry",
    "escape_help",
    "escape_label_value",
    "format_value",
]

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of the text exposition format 0.0.4."""

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def escape_help(text: str) -> str:
    """A ``# HELP`` docstring: backslash and newline escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label_value(value: str) -> str:
    """A label value inside double quotes: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: integers without a point, ``NaN``, ``+Inf`` / ``-Inf``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or (value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    return repr(float(value))


class _Metric:
    """One metric family: a name, help text, label names and one value per label set.

    Args:
        name: metric name (``[a-zA-Z_:][a-zA-Z0-9_:]*``).
        help: one-line description (the ``# HELP`` line).
        labels: label names; every update passes a value for each, as keywords.
        lock: the registry's lock, shared with rendering.
    """

    kind: ClassVar[str]

    def __init__(self, name: str, help: str, labels: Sequence[str], lock: threading.Lock) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labels:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"{name}: invalid label name {label!r}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"{name}: duplicate label names {list(labels)}")
        self.name = name
        self.help = help
        self.labels = tuple(labels)
        self._lock = lock
        self._values: dict[tuple[str, ...], float] = {}

    def _key(self, labels: dict[str, Any]) -> tuple[str, ...]:
        if not self.labels and not labels:
            return ()
        if set(labels) != set(self.labels):
            expected, got = list(self.labels), list(labels)
            raise ValueError(f"{self.name}: expected labels {expected}, got {got}")
        return tuple(str(labels[name]) for name in self.labels)

    def value(self, **labels: Any) -> float | None:
        """The current value for ``labels`` (``None`` when never set)."""
        key = self._key(labels)
        with self._lock:
            return self._values.get(key)

    def remove(self, **labels: Any) -> None:
        """Drop the sample for ``labels`` (e.g. a table that no longer exists)."""
        key = self._key(labels)
        with self._lock:
            self._values.pop(key, None)

    def _render(self, out: list[str]) -> None:
        """Append the family's lines; the caller holds the lock."""
        out.append(f"# HELP {self.name} {escape_help(self.help)}")
        out.append(f"# TYPE {self.name} {self.kind}")
        for key, value in self._values.items():
            if key:
                pairs = ",".join(
                    f'{name}="{escape_label_value(v)}"'
                    for name, v in zip(self.labels, key, strict=True)
                )
                out.append(f"{self.name}{{{pairs}}} {format_value(value)}")
            else:
                out.append(f"{self.name} {format_value(value)}")


class Counter(_Metric):
    """A count that only goes up (name it ``..._total``). An unlabelled counter
    reads 0 until its first increment."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str], lock: threading.Lock) -> None:
        super().__init__(name, help, labels, lock)
        if not self.labels:
            self._values[()] = 0

    def inc(self, amount: float = 1, **labels: Any) -> None:
        """Add ``amount`` (>= 0)."""
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def set_total(self, value: float, **labels: Any) -> None:
        """Mirror a count kept elsewhere (e.g. a table's admissions since it was built)."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = value


class Gauge(_Metric):
    """A value that goes up and down. Absent from a scrape until first set."""

    kind = "gauge"

    def set(self, value: float, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = value

    def inc(self, amount: float = 1, **labels: Any) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount


_M = TypeVar("_M", bound=_Metric)


class Registry:
    """The metric families one exporter serves, rendered in registration order.
    Thread-safe: updates and ``render`` share one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """Register a counter (``ValueError`` if the name is taken)."""
        return self._add(Counter(name, help, labels, self._lock))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        """Register a gauge (``ValueError`` if the name is taken)."""
        return self._add(Gauge(name, help, labels, self._lock))

    def _add(self, metric: _M) -> _M:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name!r} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        """Every family in the text exposition format 0.0.4 (ends with a newline)."""
        out: list[str] = []
        with self._lock:
            for metric in self._metrics.values():
                metric._render(out)
        return "\n".join(out) + "\n"


class _Handler(BaseHTTPRequestHandler):
    """``GET /metrics`` -> the registry's text; anything else -> 404."""

    registry: ClassVar[Registry]  # set on a per-server subclass

    def do_GET(self) -> None:  # http.server's hook name
        path = self.path.split("?", 1)[0]
        if path != "/metrics":
            body = b"not found: metrics are at /metrics\n"
            self._reply(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", body)
            return
        self._reply(HTTPStatus.OK, CONTENT_TYPE, self.registry.render().encode("utf-8"))

    def _reply(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a line each on stderr."""


class MetricsServer:
    """Serves a registry at ``http://HOST:PORT/metrics`` from a daemon thread.

    Args:
        registry: what to serve.
        host: interface to bind (``127.0.0.1``: this machine only; ``0.0.0.0``: all).
        port: TCP port; 0 picks a free one (read it from ``port`` after ``start``).
    """

    def __init__(self, registry: Registry, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.registry = registry
        self.host = host
        self.requested_port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int | None:
        """The bound port while serving, else ``None``."""
        return self._server.server_address[1] if self._server is not None else None

    @property
    def url(self) -> str | None:
        """``http://HOST:PORT/metrics`` while serving, else ``None``."""
        return f"http://{self.host}:{self.port}/metrics" if self._server is not None else None

    def start(self) -> MetricsServer:
        """Bind and serve (returns self). Raises ``OSError`` if the port is taken."""
        if self._server is not None:
            return self
        handler = type("MetricsHandler", (_Handler,), {"registry": self.registry})
        server = ThreadingHTTPServer((self.host, self.requested_port), handler)
        server.daemon_threads = True  # a hung scraper never keeps the process alive
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how fast stop() returns
            name="estuary-metrics",
            daemon=True,
        )
        self._thread.start()
        logger.info("serving Prometheus metrics at %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server, thread = self._server, self._thread
        self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()  # Blocking wait: serve_forever sees the flag within poll_interval
        server.server_close()
        if thread is not None:
            thread.join()
