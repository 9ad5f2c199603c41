"""The prediction service as an ASGI application (Starlette).

Routes::

    POST /predict   {"instances": [{"I1": 3, "C1": "68fd1e64", ...}, ...]}
                    -> {"predictions": [0.12, ...], "model_version": "ctr@step-000000120"}
    GET  /healthz   {"status": "ok", "model_version": ..., "update_age_s": ...}
    GET  /metrics   Prometheus text (OpenMetrics when the scraper asks)

The request convention is KServe v1 / TF Serving's ``instances``. Rows are
parsed by the job's ``FeaturePipeline`` in the handler, then batched with other
requests' rows (``MicroBatcher``). Bad requests get a 4xx and
``{"error": "..."}`` naming what was wrong: 400 broken JSON or a bad value,
413 a body over ``max_body_bytes`` or too many rows, 415 not JSON, 422 JSON of
the wrong shape (no ``instances``, a row that is not an object, a missing or
unknown field).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from estuary.serve.batching import MicroBatcher
from estuary.serve.model import ServingModel
from estuary.serve.pipeline import RequestError

__all__ = ["ServeMetrics", "create_app"]

DEFAULT_MAX_BODY_BYTES = 8 << 20
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class ServeMetrics:
    """The server's Prometheus metrics, in their own registry.

    Args:
        model: the model served (its version and the time of its newest update
            are read at each scrape).
    """

    def __init__(self, model: ServingModel) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "estuary_serve_requests", "Prediction requests by HTTP status.", ["code"], registry=r
        )
        self.rows = Counter("estuary_serve_rows", "Rows predicted.", registry=r)
        self.latency = Histogram(
            "estuary_serve_request_seconds",
            "Time from a /predict request's body read to its reply.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "estuary_serve_batch_rows",
            "Rows per forward pass (after micro-batching).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
            registry=r,
        )
        self.updates = Counter(
            "estuary_serve_updates",
            "Updates applied while serving (kind: delta, dense, full).",
            ["kind"],
            registry=r,
        )
        self.update_failures = Counter(
            "estuary_serve_update_failures", "Checkpoints that could not be applied.", registry=r
        )
        age = Gauge(
            "estuary_serve_update_age_seconds",
            "Seconds since the newest update (or the initial load) was applied.",
            registry=r,
        )
        age.set_function(lambda: time.time() - model.updated_at)
        self.freshness = Histogram(
            "estuary_serve_freshness_seconds",
            "Time from a checkpoint's commit to its rows being served.",
            buckets=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
            registry=r,
        )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"body: {declared} bytes, more than the limit of {limit}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"body: more than the limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _instances(body: bytes) -> Any:
    """The ``instances`` of a request body."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError as exc:
        raise RequestError(f"body: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise RequestError(
            f"body: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:  # e.g. nesting too deep, huge integers
        raise RequestError(f"body: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError('body: expected a JSON object {"instances": [...]}', 422)
    unknown = sorted(k for k in data if k != "instances")
    if unknown:
        raise RequestError(f"body: unknown field {unknown[0]!r} (expected only 'instances')", 422)
    if "instances" not in data:
        raise RequestError("body: missing field 'instances'", 422)
    return data["instances"]


def create_app(
    model: ServingModel,
    *,
    metrics: ServeMetrics | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_batch_rows: int = 1024,
    max_wait_s: float = 0.001,
) -> Starlette:
    """The ASGI application serving ``model`` (see module docstring).

    Args:
        metrics: where to count (default: a new ``ServeMetrics``); ``app.state.metrics``.
        max_body_bytes: larger request bodies get 413.
        max_batch_rows: the most rows in one forward pass (micro-batching).
        max_wait_s: how long a batch waits for more requests.
    """
    metrics = metrics or ServeMetrics(model)
    batcher = MicroBatcher(
        model.predict,
        max_rows=max_batch_rows,
        max_wait_s=max_wait_s,
        on_batch=metrics.batch_rows.observe,
    )

    async def predict(request: Request) -> Response:
        started = time.perf_counter()
        try:
            kind = request.headers.get("content-type", "application/json").split(";")[0]
            if kind.strip().lower() not in ("application/json", ""):
                raise RequestError(f"content-type: {kind!r}, expected application/json", 415)
            batch = model.pipeline.parse(_instances(await _read_body(request, max_body_bytes)))
        except RequestError as exc:
            metrics.requests.labels(str(exc.status)).inc()
            return _error(exc.status, str(exc))
        result = await batcher.submit(batch)
        metrics.requests.labels("200").inc()
        metrics.rows.inc(batch.num_rows)
        metrics.latency.observe(time.perf_counter() - started)
        return JSONResponse(
            {"predictions": result.probabilities.tolist(), "model_version": result.version}
        )

    async def healthz(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model_version": model.version,
                "update_age_s": time.time() - model.updated_at,
            }
        )

    async def scrape(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(metrics.registry), media_type=content_type)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await batcher.close()

    app = Starlette(
        routes=[
            Route("/predict", predict, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", scrape, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.metrics = metrics
    app.state.batcher = batcher
    app.state.model = model
    return app
