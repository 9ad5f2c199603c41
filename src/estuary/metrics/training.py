"""What a training run exports to Prometheus (``output.metrics_port``), on the
standard client (``prometheus_client``).

Two kinds of figure, two update paths:

* per step, on the training thread (``step``: two counter increments and three
  gauge sets, each a lock round trip of about a microsecond, no I/O);
* every ``refresh_s`` seconds (``step`` returns True), a ``RunSample`` of
  figures that cost more to read (table stats take each table's lock or a
  parameter-server request per table; data lag, queue depths, windowed AUC). ``refresh``
  stores the sample; a scrape renders the latest one through a custom collector
  (``_SampleCollector``) and never touches a table.

Counts kept elsewhere (a table's admissions since it was built, bad rows) are
counters whose value the collector mirrors, the client's idiom for counters
that are not incremented here. One registry per run, served by rank 0 with
rows counted over all trainers.

Metric names (every one prefixed ``estuary_``) are listed in docs/observability.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from estuary.config.errors import ConfigError
from estuary.metrics.logs import LogSettings
from estuary.metrics.prometheus import MetricsServer

if TYPE_CHECKING:
    from estuary.embedding.types import TableStats
    from estuary.metrics.evaluation import EvalResult

__all__ = ["CHECKPOINT_BUCKETS_S", "RunSample", "TrainingMetrics", "show_metrics_url"]

CHECKPOINT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Histogram buckets of ``estuary_checkpoint_duration_seconds``."""


@dataclass(frozen=True)
class RunSample:
    """The figures read every few seconds (rank 0), for metrics and the run's
    time series.

    Args:
        tables: table name -> its stats.
        staleness_max: most sparse updates in flight at any lookup so far.
        bad_rows: malformed input rows skipped so far: the job's, each once
            over restarts.
        bad_rows_run: the ones this process's reads skipped (re-read splits
            again); ``None``: ``bad_rows``.
        newest_event_s: stream -> event time (s since 1970) of the newest trained
            row, to its window's start (``data.dataset`` runs; empty otherwise).
        queues: queue name -> items waiting (``sparse_updates``: steps submitted,
            not yet applied; ``data_splits``: splits planned, not yet read).
        restarts: times this run was resumed from its own checkpoints.
        auc_window: AUC of the training predictions (made before each step's
            update) over the rows since the previous sample; NaN when unknown.
    """

    tables: Mapping[str, TableStats]
    staleness_max: int
    bad_rows: int
    newest_event_s: Mapping[str, float] = field(default_factory=dict)
    queues: Mapping[str, int] = field(default_factory=dict)
    restarts: int = 0
    auc_window: float = math.nan
    bad_rows_run: int | None = None


class TrainingMetrics:
    """The training run's metrics and, while ``serving``, their HTTP endpoint.

    Args:
        port: TCP port to serve on; 0 picks a free one (logged, and readable as
            ``url``); ``None`` = off: every call is a no-op.
        host: interface to bind.
        job: the job's name (label of ``estuary_train_info``).
        mode: ``train.mode`` (label of ``estuary_train_info``).
        refresh_s: seconds between samples (``step`` returns True).
        smoothing: weight of the newest loss in ``estuary_train_loss_smoothed``.
    """

    def __init__(
        self,
        *,
        port: int | None,
        host: str = "127.0.0.1",
        job: str = "",
        mode: str = "",
        refresh_s: float = 2.0,
        smoothing: float = 0.05,
    ) -> None:
        self.port = port
        self.host = host
        self.refresh_s = refresh_s
        self.smoothing = smoothing
        self.registry = r = CollectorRegistry()
        self.server: MetricsServer | None = None
        self._depth = 0  # nested ``serving`` blocks (DistributedTrainer -> Trainer.fit)
        self._next_refresh = 0.0
        self._rate_t = 0.0
        self._rate_rows = 0
        self._rows = 0
        self._loss_smoothed: float | None = None

        info = Gauge("estuary_train_info", "The run (always 1).", ("job", "mode"), registry=r)
        info.labels(job=job, mode=mode).set(1)
        self.steps = Counter(
            "estuary_train_steps_total", "Training steps taken by this run.", registry=r
        )
        self.step_number = Gauge(
            "estuary_train_step",
            "Global step (counts steps restored from a checkpoint).",
            registry=r,
        )
        self.rows = Counter(
            "estuary_train_rows_total",
            "Training rows processed by this run (all trainers).",
            registry=r,
        )
        self.loss = Gauge("estuary_train_loss", "Loss of the last training step.", registry=r)
        self.loss_smoothed = Gauge(
            "estuary_train_loss_smoothed",
            "Exponential moving average of the training loss.",
            registry=r,
        )
        self.samples_per_s = Gauge(
            "estuary_train_samples_per_second",
            "Training rows per second over the last refresh interval (the run's average "
            "once training ends).",
            registry=r,
        )
        self.staleness = Gauge(
            "estuary_sparse_staleness_max",
            "Most sparse updates still in flight at any lookup so far (0 in sync mode).",
            registry=r,
        )
        self.checkpoints = Counter(
            "estuary_checkpoints_total", "Checkpoints written by this run.", registry=r
        )
        self.checkpoint_step = Gauge(
            "estuary_checkpoint_last_step",
            "Global step of the newest checkpoint written.",
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "estuary_checkpoint_duration_seconds",
            "Seconds to write a checkpoint (flush of in-flight updates included).",
            buckets=CHECKPOINT_BUCKETS_S,
            registry=r,
        )
        # Rendered at scrape time by ``_SampleCollector``; absent until first set.
        self._sample: RunSample | None = None
        self._auc_window = math.nan  # the newest finite windowed AUC
        self._eval: EvalResult | None = None
        r.register(_SampleCollector(self))

    def value(self, name: str, **labels: str) -> float | None:
        """A sample's current value (``None`` when absent), e.g.
        ``value("estuary_table_rows", table="C1")``; for tests and tools."""
        return self.registry.get_sample_value(name, labels)

    @property
    def url(self) -> str | None:
        """``http://HOST:PORT/metrics`` while serving, else ``None``."""
        return self.server.url if self.server is not None else None

    @contextlib.contextmanager
    def serving(self) -> Iterator[TrainingMetrics]:
        """Serve ``/metrics`` for the block (nested blocks share one server); the
        port is released when the outermost block ends. A no-op when ``port`` is None.

        Raises:
            ConfigError: the port cannot be bound (``output.metrics_port``).
        """
        if self.port is None:
            yield self
            return
        if self._depth == 0:
            server = MetricsServer(self.registry, host=self.host, port=self.port)
            try:
                self.server = server.start()
            except OSError as exc:
                raise ConfigError(
                    "output.metrics_port", f"cannot serve metrics on {self.host}:{self.port}: {exc}"
                ) from exc
            self._rate_t = time.monotonic()
            self._rate_rows = self._rows
            self._next_refresh = 0.0  # refresh at the first step
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0 and self.server is not None:
                self.server.stop()
                self.server = None

    def step(self, step: int, rows: int, loss: float) -> bool:
        """Record one training step (global step number, rows over all trainers,
        loss). Cheap; returns True when a ``refresh`` is due."""
        if self.server is None:
            return False
        self._rows += rows
        smoothed = self._loss_smoothed
        smoothed = loss if smoothed is None else smoothed + self.smoothing * (loss - smoothed)
        self._loss_smoothed = smoothed
        self.steps.inc()
        self.rows.inc(rows)
        self.step_number.set(step)
        self.loss.set(loss)
        if not math.isnan(smoothed):
            self.loss_smoothed.set(smoothed)
        return time.monotonic() >= self._next_refresh

    def refresh(self, sample: RunSample) -> None:
        """Publish a sample (table stats, staleness, bad rows, data lag, queues,
        restarts, windowed AUC) and the recent rows/s."""
        if self.server is None:
            return
        now = time.monotonic()
        self._next_refresh = now + self.refresh_s
        elapsed_s = now - self._rate_t
        if elapsed_s > 0 and self._rows > self._rate_rows:
            self.samples_per_s.set((self._rows - self._rate_rows) / elapsed_s)
            self._rate_t, self._rate_rows = now, self._rows
        self.staleness.set(sample.staleness_max)
        if not math.isnan(sample.auc_window):
            self._auc_window = sample.auc_window
        self._sample = sample  # one reference swap: a scrape sees one sample whole

    def trained(self, samples_per_s: float) -> None:
        """Training ended: rows/s becomes the run's average."""
        if self.server is not None:
            self.samples_per_s.set(samples_per_s)

    def evaluated(self, result: EvalResult) -> None:
        if self.server is not None:
            self._eval = result

    def checkpointed(self, step: int, duration_s: float) -> None:
        if self.server is not None:
            self.checkpoints.inc()
            self.checkpoint_step.set(step)
            self.checkpoint_seconds.observe(duration_s)


_TABLE_FIGURES: tuple[tuple[str, str, str, str], ...] = (
    # (metric, kind, TableStats field, help)
    ("estuary_table_rows", "gauge", "rows", "Ids holding their own row."),
    ("estuary_table_bytes", "gauge", "bytes", "Memory held by index, rows and optimizer state."),
    ("estuary_table_lookups_total", "counter", "lookups", "Ids looked up (train and eval)."),
    (
        "estuary_table_hit_rate",
        "gauge",
        "hit_rate",
        "Share of looked-up ids that had their own row.",
    ),
    ("estuary_table_admissions_total", "counter", "admissions", "Ids that got their own row."),
    (
        "estuary_table_evictions_total",
        "counter",
        "evictions",
        "Rows removed by capacity, TTL or sweeps.",
    ),
    ("estuary_table_pending_ids", "gauge", "pending_ids", "Ids seen but not yet admitted."),
    (
        "estuary_table_unknown_grads_total",
        "counter",
        "unknown_grads",
        "Gradient rows routed to the shared unknown row (id not admitted).",
    ),
    (
        "estuary_table_memory_hit_rate",
        "gauge",
        "memory_hit_rate",
        "Share of ids with a row whose row was in memory (disk tier: the rest).",
    ),
    ("estuary_table_disk_rows", "gauge", "disk_rows", "Rows held in the disk tier."),
    ("estuary_table_disk_bytes", "gauge", "disk_bytes", "Bytes of the disk tier's files."),
    ("estuary_table_disk_reads_total", "counter", "disk_reads", "Rows read from the disk tier."),
    (
        "estuary_table_disk_writes_total",
        "counter",
        "disk_writes",
        "Rows moved from memory to the disk tier.",
    ),
)


def _family(name: str, kind: str, help: str, labels: Iterable[str] = ()) -> Any:
    if kind == "counter":
        return CounterMetricFamily(name, help, labels=list(labels))
    return GaugeMetricFamily(name, help, labels=list(labels))


class _SampleCollector(Collector):
    """Renders the newest ``RunSample`` at scrape time (nothing before the first).
    ``describe`` lists the families, so the registry never calls ``collect``
    at registration."""

    def __init__(self, metrics: TrainingMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        yield from self._families(None)

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        yield from self._families(m._sample, m._auc_window, m._eval)

    def _families(
        self,
        sample: RunSample | None,
        auc_window: float = math.nan,
        result: EvalResult | None = None,
    ) -> Iterator[Metric]:
        auc = _family(
            "estuary_train_auc_window",
            "gauge",
            "AUC of the training predictions (before each step's update) over the rows "
            "of the last refresh interval (its newest 32768 at most; rank 0's rows).",
        )
        if not math.isnan(auc_window):
            auc.add_metric([], auc_window)
        evaluation = [
            _family("estuary_eval_auc", "gauge", "ROC AUC of the last evaluation."),
            _family("estuary_eval_logloss", "gauge", "Log loss of the last evaluation."),
            _family("estuary_eval_rows", "gauge", "Rows in the last evaluation."),
        ]
        if result is not None:
            for family, value in zip(
                evaluation, (result.auc, result.logloss, result.rows), strict=True
            ):
                family.add_metric([], value)
        yield auc
        yield from evaluation
        bad = _family(
            "estuary_bad_rows_total",
            "counter",
            "Malformed input rows this process's reads skipped (from 0 at each start).",
        )
        job_bad = _family(
            "estuary_job_bad_rows",
            "gauge",
            "Malformed input rows of the job so far, each once over restarts.",
        )
        restarts = _family(
            "estuary_train_restarts_total",
            "counter",
            "Times this run was resumed from its own checkpoints (after a stop or a failure).",
        )
        newest = _family(
            "estuary_data_newest_event_timestamp_seconds",
            "gauge",
            "Event time of the newest trained row per stream, to its window's start "
            "(s since 1970).",
            ("stream",),
        )
        lag = _family(
            "estuary_data_lag_seconds",
            "gauge",
            "Now minus the event time of the newest trained row per stream (to its window).",
            ("stream",),
        )
        queues = _family(
            "estuary_queue_depth", "gauge", "Items waiting in a queue of the run.", ("queue",)
        )
        tables = [
            (_family(name, kind, doc, ("table",)), attr) for name, kind, attr, doc in _TABLE_FIGURES
        ]
        if sample is not None:
            run_bad = sample.bad_rows if sample.bad_rows_run is None else sample.bad_rows_run
            bad.add_metric([], run_bad)
            job_bad.add_metric([], sample.bad_rows)
            restarts.add_metric([], sample.restarts)
            now_s = time.time()
            for stream, event_s in sample.newest_event_s.items():
                newest.add_metric([stream], event_s)
                lag.add_metric([stream], max(0.0, now_s - event_s))
            for queue, depth in sample.queues.items():
                queues.add_metric([queue], depth)
            for table, stats in sample.tables.items():
                for family, attr in tables:
                    family.add_metric([table], getattr(stats, attr))
        yield from (bad, job_bad, restarts, newest, lag, queues)
        yield from (family for family, _ in tables)


def show_metrics_url() -> None:
    """Let the metrics server's "serving Prometheus metrics at URL" line (INFO)
    reach stderr (with ``output.metrics_port: 0`` it is the only place the port
    shows) when nothing configured Estuary's logging: the command line's
    defaults (``LogSettings.parse([])``). For programs that embed a trainer."""
    root = logging.getLogger("estuary")
    if not root.handlers:
        LogSettings.parse([]).apply()
