"""The prediction service as an ASGI application (Starlette).

Routes::

    POST /predict   {"instances": [{"I1": 3, "C1": "68fd1e64", ...}, ...]}
                    -> {"predictions": [0.12, ...], "model_version": "ctr@step-000000120"}
    GET  /healthz   {"status": "ok", "model_version": ..., "update_age_s": ...}
    GET  /metrics   Prometheus text (OpenMetrics when the scraper asks)

The request convention is KServe v1 / TF Serving's ``instances``. The handler
checks a request's shape (``FeaturePipeline.check``); its rows are then decoded
and predicted together with other requests' (``MicroBatcher`` ->
``ServingModel.predict_requests``). The body is read as JSON whatever its
``Content-Type`` says (``curl -d`` sends a form type). Bad requests get a 4xx and
``{"error": "..."}`` naming what was wrong: 400 broken JSON or a bad value,
413 a body over ``max_body_bytes`` or too many rows, 422 JSON of
the wrong shape (no ``instances``, a row that is not an object, a missing or
unknown field).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from estuary.serve.batching import MicroBatcher
from estuary.serve.metrics import ServeMetrics
from estuary.serve.model import Prediction, ServingModel
from estuary.serve.pipeline import RequestError

__all__ = ["create_app"]


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
    max_body_bytes: int = 8 << 20,
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
    batcher: MicroBatcher[list[dict[str, Any]], Prediction | RequestError] = MicroBatcher(
        model.predict_requests,
        max_rows=max_batch_rows,
        max_wait_s=max_wait_s,
        on_batch=metrics.batch_rows.observe,
    )

    async def predict(request: Request) -> Response:
        started = time.perf_counter()
        try:
            rows = model.pipeline.check(_instances(await _read_body(request, max_body_bytes)))
            result = await batcher.submit(rows)  # decoded and predicted with others
            if isinstance(result, RequestError):
                raise result
        except RequestError as exc:
            metrics.requests.labels(str(exc.status)).inc()
            return _error(exc.status, str(exc))
        metrics.requests.labels("200").inc()
        metrics.rows.inc(len(rows))
        metrics.latency.observe(time.perf_counter() - started)
        return JSONResponse(
            {"predictions": result.probabilities.tolist(), "model_version": result.version}
        )

    async def healthz(request: Request) -> Response:
        health: dict[str, Any] = {
            "status": "ok",
            "model_version": model.version,
            "update_age_s": time.time() - model.updated_at,
        }
        if metrics.behind_s is not None:  # following a run in a preparing process
            health["behind_s"] = metrics.behind_s()
        return JSONResponse(health)

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
