"""Serving a ``prometheus_client`` registry at ``/metrics``.

The metrics themselves are the standard client's (``prometheus_client``:
``Counter``, ``Gauge``, ``Histogram``, custom collectors); this module only
serves one ``CollectorRegistry`` over HTTP from a daemon thread, on a port that
may be 0 (a free one, readable after ``start``) and is released by ``stop``::

    registry = CollectorRegistry()
    steps = Counter("estuary_train_steps_total", "Training steps.", registry=registry)
    server = MetricsServer(registry, host="127.0.0.1", port=0).start()
    ...  # GET http://127.0.0.1:{server.port}/metrics
    server.stop()  # the port is released

The client's own ``start_http_server`` answers every path; this server answers
``/metrics`` only (404 elsewhere, so a wrong URL is noticed) and negotiates the
format from the ``Accept`` header as the client's handler does (Prometheus text
by default, OpenMetrics when asked).
"""

from __future__ import annotations

import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder

__all__ = ["CONTENT_TYPE", "MetricsServer"]

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The ``Content-Type`` of a scrape that asks for no format (text format 0.0.4)."""


class _Handler(BaseHTTPRequestHandler):
    """``GET /metrics`` -> the registry, encoded as the scraper asks; else 404."""

    registry: ClassVar[CollectorRegistry]  # set on a per-server subclass

    def do_GET(self) -> None:  # http.server's hook name
        path = self.path.split("?", 1)[0]
        if path != "/metrics":
            body = b"not found: metrics are at /metrics\n"
            self._reply(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", body)
            return
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        self._reply(HTTPStatus.OK, content_type, encoder(self.registry))

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

    def __init__(
        self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
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
