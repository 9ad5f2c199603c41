"""``RunObserver``: what rank 0 tells the outside while it trains.

After each step it updates the Prometheus step counters (``TrainingMetrics.step``)
and the log context's step, and keeps a reference to the step's logits and
labels. Every so often (``series_interval_s``: every 0.25 s at first, spreading
out to ``output.timeseries_every_s`` as the run goes; and the metrics'
``refresh_s``) it reads a ``RunSample`` (table stats, staleness, bad rows, data
lag, queue depths, the AUC of the interval's predictions) and hands it to the
metrics and to the run's time series (``timeseries.jsonl``). Checkpoints,
evaluations and the end of the fit become records too.

Cost per step: a few attribute writes and two list appends; per sample: the
table stats (a lock per table; a parameter-server request per remote table), an AUC over
the interval's newest rows (at most ``AUC_WINDOW_ROWS``; a sort: about 4 ms per
20k rows on 2 cores) and one flushed line.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from estuary.embedding.types import stats_of
from estuary.metrics.evaluation import EvalResult, roc_auc
from estuary.metrics.logs import LOG_CONTEXT
from estuary.metrics.timeseries import TimeSeriesWriter
from estuary.metrics.training import RunSample, TrainingMetrics
from estuary.train.callbacks import Callback, LoopState

if TYPE_CHECKING:
    from estuary.train.engine import Engine
    from estuary.train.feeds import Feed
    from estuary.train.sparse_updates import SparseUpdater

__all__ = ["AUC_MIN_ROWS", "AUC_WINDOW_ROWS", "RunObserver", "series_interval_s"]

AUC_WINDOW_ROWS = 32_768
"""The windowed AUC reads at most this many of an interval's newest rows (the
whole interval below ~32k rows/s), which bounds its sort and memory."""

AUC_MIN_ROWS = 2_048
"""...and at least this many (the newest, from earlier intervals too): an AUC of a
few hundred rows (the tail after the last sample) is mostly noise."""


def series_interval_s(elapsed_s: float, every_s: float) -> float:
    """Seconds to the next sample of the series, ``elapsed_s`` into the fit: 0.25
    at first, then 1/40 of the time so far, at most ``every_s``. A short run gets
    enough points to plot (40 in its first 10 s), a long one a bounded file (a
    day at ``every_s`` 10: 8,640 lines, ~20 MB with 26 tables)."""
    return min(every_s, max(0.25, elapsed_s / 40))


class RunObserver(Callback):
    """Metrics and time series of one rank's fit (see module docstring).

    Args:
        metrics: the run's Prometheus metrics (no-ops unless serving).
        engine: the steps' engine (logits, labels, stage times).
        feed: the fit's feed (bad rows, data lag, queues).
        tables: table name -> table (``stats()``).
        updater: the fit's sparse updater (staleness, updates in flight).
        folder: the run folder for ``timeseries.jsonl`` (``None``: no series;
            only rank 0 writes one).
        every_s: the longest interval between samples of the series
            (``series_interval_s``).
        job_name: the job's name (the series' start record).
        mode: ``train.mode`` (the series' start record).
    """

    def __init__(
        self,
        metrics: TrainingMetrics,
        engine: Engine,
        feed: Feed,
        tables: Mapping[str, Any],
        updater: SparseUpdater,
        *,
        folder: Path | None,
        every_s: float | None,
        job_name: str = "",
        mode: str = "",
    ) -> None:
        self.metrics, self.engine, self.feed, self.tables = metrics, engine, feed, tables
        self.updater = updater
        self.folder, self.every_s = folder, every_s
        self.job_name, self.mode = job_name, mode
        self.series: TimeSeriesWriter | None = None
        self._t_start, self._next_sample = 0.0, math.inf
        self._t_rate, self._rows, self._rows_at_rate = 0.0, 0, 0
        self._loss_sum, self._loss_steps = 0.0, 0
        self._logits: deque[torch.Tensor] = deque()
        self._labels: deque[torch.Tensor] = deque()
        self._window_rows = 0  # rows held in _logits
        self._fresh_rows = 0  # of them, rows since the last sample
        self._restarts = 0
        self._step = 0

    @property
    def _watching(self) -> bool:
        return self.series is not None or self.metrics.server is not None

    def on_fit_start(self, state: LoopState) -> None:
        LOG_CONTEXT.step = state.step
        self._restarts, self._step = state.restarts, state.step
        self._t_rate = time.monotonic()
        if self.folder is not None and self.every_s is not None and state.chief:
            self.series = TimeSeriesWriter(self.folder)
            self.series.write(
                "start",
                step=state.step,
                world_size=state.world_size,
                mode=self.mode,
                job=self.job_name,
                restarts=state.restarts,
            )
            self._t_start = time.monotonic()
            self._next_sample = self._t_start + series_interval_s(0.0, self.every_s)

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        LOG_CONTEXT.step = self._step = state.step
        refresh = self.metrics.step(state.step, rows, loss)
        if not self._watching:
            return
        self._rows += rows
        self._loss_sum += loss
        self._loss_steps += 1
        logits, labels = self.engine.last_logits, self.engine.last_labels
        if logits is not None and labels is not None:
            self._logits.append(logits)
            self._labels.append(labels)
            self._window_rows += int(logits.shape[0])
            self._fresh_rows += int(logits.shape[0])
            while self._window_rows - int(self._logits[0].shape[0]) >= AUC_WINDOW_ROWS:
                self._window_rows -= int(self._logits.popleft().shape[0])  # keep the newest
                self._labels.popleft()
        if refresh or time.monotonic() >= self._next_sample:
            self.sample()

    def sample(self, *, record: bool = True) -> RunSample:
        """Read the figures, publish them and (``record``) append a series record;
        returns them."""
        now = time.monotonic()
        stats = stats_of(self.tables)  # one request per PS server
        lag_now_s = time.time()
        newest = self.feed.newest_event_s()
        queues = {"sparse_updates": self.updater.submitted - self.updater.landed}
        queues.update(self.feed.queue_depths())
        sample = RunSample(
            tables=stats,
            staleness_max=self.updater.log.max_behind,
            bad_rows=self.feed.bad_rows(),
            bad_rows_run=self.feed.bad_rows_this_run(),
            newest_event_s=newest,
            queues=queues,
            restarts=self._restarts,
            auc_window=self._window_auc(),
        )
        self.metrics.refresh(sample)
        if self.series is not None and record:
            elapsed_s = now - self._t_rate
            rate = (self._rows - self._rows_at_rate) / elapsed_s if elapsed_s > 0 else 0.0
            self.series.write(
                "sample",
                step=self._step,
                rows=self._rows,
                loss=self._loss_sum / self._loss_steps if self._loss_steps else None,
                rows_per_s=round(rate, 1),
                auc_window=sample.auc_window,
                staleness_max=sample.staleness_max,
                bad_rows=sample.bad_rows,
                stages=self.engine.times.as_dict(),
                tables={
                    name: {
                        "rows": s.rows,
                        "bytes": s.bytes,
                        "admissions": s.admissions,
                        "evictions": s.evictions,
                    }
                    for name, s in stats.items()
                },
                data_lag_s={k: round(max(0.0, lag_now_s - v), 3) for k, v in newest.items()},
                queues=queues,
            )
            assert self.every_s is not None
            self._next_sample = now + series_interval_s(now - self._t_start, self.every_s)
        self._t_rate, self._rows_at_rate = now, self._rows
        self._loss_sum, self._loss_steps = 0.0, 0
        return sample

    def _window_auc(self) -> float:
        """AUC of the predictions since the last sample, or of the newest
        ``AUC_MIN_ROWS`` when fewer came since (NaN: one class or none)."""
        if self._fresh_rows == 0:
            return math.nan
        want = max(self._fresh_rows, AUC_MIN_ROWS)
        logits: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        rows = 0
        for step_logits, step_labels in zip(
            reversed(self._logits), reversed(self._labels), strict=True
        ):
            if rows >= want:
                break
            logits.append(step_logits)
            labels.append(step_labels)
            rows += int(step_logits.shape[0])
        scores = torch.cat(logits).float().cpu().numpy()  # (N,)
        truth = torch.cat(labels).float().cpu().numpy()  # (N,)
        # Keep the newest steps holding AUC_MIN_ROWS rows for a short next interval.
        while self._logits and self._window_rows - int(self._logits[0].shape[0]) >= AUC_MIN_ROWS:
            self._window_rows -= int(self._logits.popleft().shape[0])
            self._labels.popleft()
        self._fresh_rows = 0
        return roc_auc(truth.astype(np.float32), scores)

    def checkpointed(self, step: int, duration_s: float) -> None:
        """A checkpoint of ``step`` was committed ``duration_s`` seconds after it
        began (the ``Checkpointer`` tells the metrics itself); an asynchronous
        one's is called on its writer thread."""
        if self.series is not None:
            self.series.write("checkpoint", step=step, duration_s=round(duration_s, 4))

    def evaluated(self, step: int, result: EvalResult) -> None:
        self.metrics.evaluated(result)
        if self.series is not None:
            self.series.write(
                "eval", step=step, auc=result.auc, logloss=result.logloss, rows=result.rows
            )

    def finished(self, step: int, rows: int, samples_per_s: float) -> None:
        """Training ended (before evaluation): a last sample and the end record."""
        if self._watching:
            self.sample()
        self.metrics.trained(samples_per_s)
        if self.series is not None:
            self.series.write("end", step=step, rows=rows, rows_per_s=round(samples_per_s, 1))

    @contextlib.contextmanager
    def watching(self, listeners: list[Callable[[int, float], None]]) -> Iterator[RunObserver]:
        """For one fit: hear of its checkpoints (a ``Checkpointer``'s ``listeners``);
        afterwards, however the fit ended, close the series and clear the log
        context's step (a later fit in this process starts without one)."""
        listeners.append(self.checkpointed)
        try:
            yield self
        finally:
            listeners.remove(self.checkpointed)
            self.close()
            LOG_CONTEXT.step = None

    def on_fit_end(self, state: LoopState) -> None:
        """Close the series file (a later record, e.g. the evaluation's, reopens it)."""
        if self.series is not None:
            self.series.close()

    def close(self) -> None:
        """No more records (the fit is done)."""
        if self.series is not None:
            self.series.close()
            self.series = None
