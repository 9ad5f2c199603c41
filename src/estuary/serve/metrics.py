"""The prediction server's Prometheus metrics (``GET /metrics``).

estuary_serve_requests_total{code}       requests by HTTP status
estuary_serve_rows_total                 rows predicted
estuary_serve_request_seconds            /predict latency (body read -> reply)
estuary_serve_batch_rows                 rows per forward pass (micro-batching)
estuary_serve_updates_total{kind}        updates applied while following a run
estuary_serve_update_failures_total      checkpoints that could not be applied
estuary_serve_update_age_seconds         seconds since the newest update
estuary_serve_freshness_seconds          checkpoint commit -> served
estuary_serve_table_bytes                bytes the serving tables hold (a standby copy not counted)
estuary_serve_update_cpu_seconds         serving process's CPU time per update (follower thread)
estuary_serve_prepare_cpu_seconds        preparing process's CPU time per update
estuary_serve_behind_seconds             how long the version served has been behind the run
estuary_serve_prepare_restarts_total{reason}  preparing processes replaced (exited, hung;
                                         dropped: a Ray replica, by its preparer)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from estuary.serve.model import ServingModel

__all__ = ["ServeMetrics"]

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
        table_bytes = Gauge(
            "estuary_serve_table_bytes",
            "Bytes the serving tables hold: ids, rows as stored, scales, unknown rows "
            "(training tables: also optimizer slots and index; a standby copy not counted).",
            registry=r,
        )
        table_bytes.set_function(lambda: model.table_bytes)
        self.stall = Histogram(
            "estuary_serve_update_stall_seconds",
            "Time an update held predictions back (the model's lock held).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.freshness = Histogram(
            "estuary_serve_freshness_seconds",
            "Time from a checkpoint's commit to its rows being served.",
            buckets=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
            registry=r,
        )
        _cpu_buckets = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
        self.update_cpu = Histogram(
            "estuary_serve_update_cpu_seconds",
            "CPU time the serving process's follower thread spent per update (time the "
            "event loop and the prediction thread may wait for the GIL).",
            buckets=_cpu_buckets,
            registry=r,
        )
        self.prepare_cpu = Histogram(
            "estuary_serve_prepare_cpu_seconds",
            "CPU time the preparing process spent per update (--prepare process).",
            buckets=_cpu_buckets,
            registry=r,
        )
        self.prepare_restarts = Counter(
            "estuary_serve_prepare_restarts",
            "Preparing processes replaced (reason: exited, or hung: no progress by the "
            "deadline while a checkpoint was pending; dropped: a Ray replica dropped by "
            "its node's preparer).",
            ["reason"],
            registry=r,
        )
        self.behind_s: Callable[[], float] | None = None

    def follow_behind(self, behind_s: Callable[[], float]) -> None:
        """Export ``behind_s()`` (seconds the version served has been behind the
        run's newest checkpoint) as ``estuary_serve_behind_seconds`` and in /healthz."""
        gauge = Gauge(
            "estuary_serve_behind_seconds",
            "Seconds since the run's latest checkpoint first differed from the one "
            "served (0: the newest is served).",
            registry=self.registry,
        )
        gauge.set_function(behind_s)
        self.behind_s = behind_s
