"""What a training run exports to Prometheus (``output.metrics_port``).

The fit loops call ``step`` once per step (a few counter and gauge writes, no
I/O) and, when it returns True (every ``refresh_s`` seconds), ``refresh`` with
table stats: those take each table's lock (or a parameter-server round trip),
so they are read at that low rate, on the training thread, never by a scrape.

Metric names (every one prefixed ``estuary_``) are listed in docs/job-spec.md
(section "Metrics").
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from estuary.config.errors import ConfigError
from estuary.metrics.prometheus import MetricsServer, Registry

if TYPE_CHECKING:
    from estuary.embedding.types import TableStats
    from estuary.metrics.evaluation import EvalResult

__all__ = ["TrainingMetrics"]


class TrainingMetrics:
    """The training run's metrics and, while ``serving``, their HTTP endpoint.

    Args:
        port: TCP port to serve on; 0 picks a free one (logged, and readable as
            ``url``); ``None`` = off: every call is a no-op.
        host: interface to bind.
        job: the job's name (label of ``estuary_train_info``).
        mode: ``train.mode`` (label of ``estuary_train_info``).
        refresh_s: seconds between table-stats refreshes (``step`` returns True).
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
        self.registry = r = Registry()
        self.server: MetricsServer | None = None
        self._depth = 0  # nested ``serving`` blocks (DistributedTrainer -> Trainer.fit)
        self._next_refresh = 0.0
        self._rate_t = 0.0
        self._rate_rows = 0
        self._rows = 0
        self._loss_smoothed: float | None = None

        info = r.gauge("estuary_train_info", "The run (always 1).", ("job", "mode"))
        info.set(1, job=job, mode=mode)
        self.steps = r.counter("estuary_train_steps_total", "Training steps taken by this run.")
        self.step_number = r.gauge(
            "estuary_train_step", "Global step (counts steps restored from a checkpoint)."
        )
        self.rows = r.counter(
            "estuary_train_rows_total", "Training rows processed by this run (all trainers)."
        )
        self.loss = r.gauge("estuary_train_loss", "Loss of the last training step.")
        self.loss_smoothed = r.gauge(
            "estuary_train_loss_smoothed", "Exponential moving average of the training loss."
        )
        self.samples_per_s = r.gauge(
            "estuary_train_samples_per_second",
            "Training rows per second over the last refresh interval (the run's average "
            "once training ends).",
        )
        self.bad_rows = r.counter("estuary_bad_rows_total", "Malformed input rows skipped.")
        self.staleness = r.gauge(
            "estuary_sparse_staleness_max",
            "Most sparse updates still in flight at any lookup so far (0 in sync mode).",
        )
        self.eval_auc = r.gauge("estuary_eval_auc", "ROC AUC of the last evaluation.")
        self.eval_logloss = r.gauge("estuary_eval_logloss", "Log loss of the last evaluation.")
        self.eval_rows = r.gauge("estuary_eval_rows", "Rows in the last evaluation.")
        self.checkpoints = r.counter(
            "estuary_checkpoints_total", "Checkpoints written by this run."
        )
        self.checkpoint_step = r.gauge(
            "estuary_checkpoint_last_step", "Global step of the newest checkpoint written."
        )
        table = ("table",)
        self.table_rows = r.gauge("estuary_table_rows", "Ids holding their own row.", table)
        self.table_bytes = r.gauge(
            "estuary_table_bytes", "Memory held by index, rows and optimizer state.", table
        )
        self.table_lookups = r.counter(
            "estuary_table_lookups_total", "Ids looked up (train and eval).", table
        )
        self.table_hit_rate = r.gauge(
            "estuary_table_hit_rate", "Share of looked-up ids that had their own row.", table
        )
        self.table_admissions = r.counter(
            "estuary_table_admissions_total", "Ids that got their own row.", table
        )
        self.table_evictions = r.counter(
            "estuary_table_evictions_total", "Rows removed by capacity, TTL or sweeps.", table
        )
        self.table_pending = r.gauge(
            "estuary_table_pending_ids", "Ids seen but not yet admitted.", table
        )
        self.table_unknown_grads = r.counter(
            "estuary_table_unknown_grads_total",
            "Gradient rows routed to the shared unknown row (id not admitted).",
            table,
        )

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

    def refresh(
        self, tables: Mapping[str, TableStats], *, staleness_max: int, bad_rows: int
    ) -> None:
        """Publish table stats, staleness, bad rows and the recent rows/s."""
        if self.server is None:
            return
        now = time.monotonic()
        self._next_refresh = now + self.refresh_s
        elapsed_s = now - self._rate_t
        if elapsed_s > 0 and self._rows > self._rate_rows:
            self.samples_per_s.set((self._rows - self._rate_rows) / elapsed_s)
            self._rate_t, self._rate_rows = now, self._rows
        self.staleness.set(staleness_max)
        self.bad_rows.set_total(bad_rows)
        for name, s in tables.items():
            self.table_rows.set(s.rows, table=name)
            self.table_bytes.set(s.bytes, table=name)
            self.table_lookups.set_total(s.lookups, table=name)
            self.table_hit_rate.set(s.hit_rate, table=name)
            self.table_admissions.set_total(s.admissions, table=name)
            self.table_evictions.set_total(s.evictions, table=name)
            self.table_pending.set(s.pending_ids, table=name)
            self.table_unknown_grads.set_total(s.unknown_grads, table=name)

    def trained(self, samples_per_s: float) -> None:
        """Training ended: rows/s becomes the run's average."""
        if self.server is not None:
            self.samples_per_s.set(samples_per_s)

    def evaluated(self, result: EvalResult) -> None:
        if self.server is not None:
            self.eval_auc.set(result.auc)
            self.eval_logloss.set(result.logloss)
            self.eval_rows.set(result.rows)

    def checkpointed(self, step: int) -> None:
        if self.server is not None:
            self.checkpoints.inc()
            self.checkpoint_step.set(step)


def show_metrics_url() -> None:
    """Let the metrics server's "serving Prometheus metrics at URL" line (INFO)
    reach stderr: with ``output.metrics_port: 0`` it is the only place the port
    shows. Called by ``estuary train`` and by rank 0 of a multi-trainer run."""
    logger = logging.getLogger("estuary.metrics")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler()  # stderr
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # not twice when the root logger prints too
