"""The fit loop: one loop over an ``Engine`` and a ``Feed``, for every data path
and any number of trainers. Reads top to bottom::

    per epoch (a graph feed has one):
      callbacks.on_epoch_start
      per batch (looked up inline, or one ahead on the prefetch thread):
        share = feed.share(batch)          rows over all ranks, loss reduction
        callbacks.before_step              fault injection (tests)
        engine.step(batch, plan)           lookup -> fwd/bwd -> dense step -> sparse hand-off
        progressive.record(batch, logits)  train.progressive_eval: the step's pre-update scores
                                           (with a mixed buffer in sync mode: rows are
                                           scored on arrival instead; the step files the lag)
        feed.commit(share)                 rows recorded as trained (graph feed)
        callbacks.after_step               progress bar, metrics, checkpoint cadence
        stop.poll(step) -> checkpoint the step, raise TrainingStopped
    flush sparse updates -> final checkpoint / evaluation (rank 0) -> FitResult

The feed's ``CheckpointRules`` say when a stop or the end writes a checkpoint;
the ``plan_for`` function picks each batch's ``UpdatePlan`` (default: none, the
plain step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from estuary.data.types import Batch
from estuary.embedding.types import stats_of
from estuary.metrics.evaluation import EvalResult, evaluate_predictions
from estuary.metrics.progress import ProgressBar
from estuary.metrics.training import TrainingMetrics
from estuary.train.callbacks import (
    Callback,
    Callbacks,
    CheckpointCadence,
    LoopState,
    ProgressCallback,
)
from estuary.train.checkpointer import Checkpointer
from estuary.train.engine import Engine, UpdatePlan
from estuary.train.feeds import Feed
from estuary.train.observe import RunObserver
from estuary.train.progressive import (
    CHECKPOINT_NAME,
    ProgressiveEval,
    progressive_for,
    score_on_arrival,
)
from estuary.train.result import FitResult, TrainingStopped
from estuary.train.sparse_updates import SparseUpdater

__all__ = ["FitLoop", "evaluate_batches"]


def evaluate_batches(
    predict: Callable[[Batch], np.ndarray],
    batches: Iterator[Batch],
    progress: ProgressBar | None = None,
    sink: Callable[[Batch, np.ndarray], None] | None = None,
) -> EvalResult:
    """AUC / logloss of ``predict`` over ``batches`` (counting rows on ``progress``,
    which it closes); ``sink`` gets each batch with its probabilities (B,)."""
    labels, probabilities = [], []
    try:
        for batch in batches:
            probabilities.append(predict(batch))
            labels.append(batch.labels)
            if sink is not None:
                sink(batch, probabilities[-1])
            if progress is not None:
                progress.count(batch.num_rows)
    finally:
        if progress is not None:
            progress.close()
    if not labels:
        return evaluate_predictions(np.zeros(0), np.zeros(0))
    return evaluate_predictions(np.concatenate(labels), np.concatenate(probabilities))


class FitLoop:
    """Trains one rank over a feed (see module docstring).

    Args:
        engine: does the steps.
        feed: this rank's batches.
        state: the run's loop state (restored by a resume), updated as it trains.
        checkpointer: writes the checkpoints.
        metrics: Prometheus metrics of the run.
        tables: table name -> table (stats for metrics, the time series and the summary).
        callbacks: more callbacks, called after the built-in ones.
        progress: show the progress bar.
        load_s: seconds spent loading before the loop (counted in ``wall_s``).
        plan_for: batch -> its ``UpdatePlan`` (``None``: the plain step).
    """

    def __init__(
        self,
        engine: Engine,
        feed: Feed,
        state: LoopState,
        checkpointer: Checkpointer,
        metrics: TrainingMetrics,
        tables: Mapping[str, Any],
        *,
        callbacks: Sequence[Callback] = (),
        progress: bool = False,
        load_s: float = 0.0,
        plan_for: Callable[[Batch], UpdatePlan | None] | None = None,
    ) -> None:
        self.engine, self.feed, self.state = engine, feed, state
        self.checkpointer, self.metrics, self.tables = checkpointer, metrics, tables
        self.extra_callbacks, self.progress, self.load_s = list(callbacks), progress, load_s
        self.plan_for = plan_for
        self._final = False  # True: checkpoints block (a stop's, the last ones)
        self._progressive: ProgressiveEval | None = None
        self._scored_on_arrival = False

    def run(self) -> FitResult:
        state, feed, engine = self.state, self.feed, self.engine
        updater = engine.sparse_updater()
        every = self.checkpointer.job.output.checkpoint_every_steps if state.chief else None
        cadence = CheckpointCadence(
            every,
            lambda: self._save(updater),
            saved_step=state.step if feed.restored else None,
        )
        job = self.checkpointer.job
        self._progressive = progressive_for(job, feed, state, self.metrics)
        if self._progressive is not None:  # saved with each checkpoint; a resume continues
            self.checkpointer.add_extra(CHECKPOINT_NAME, self._progressive)
        self._scored_on_arrival = score_on_arrival(feed, engine, self._progressive, state)
        observer = RunObserver(
            self.metrics,
            engine,
            feed,
            self.tables,
            updater,
            folder=job.resolve(job.output.dir),
            every_s=job.output.timeseries_every_s,
            job_name=job.name,
            mode=job.train.mode,
        )
        callbacks = Callbacks(
            [
                ProgressCallback(feed.total_rows, self.progress),
                observer,
                cadence,
                *self.extra_callbacks,
            ]
        )
        with observer.watching(self.checkpointer.listeners):  # its checkpoints, then closed
            rows_done, train_wall_s = self._train(callbacks, cadence, updater)
            return self._finish(updater, observer, cadence, rows_done, train_wall_s)

    def _train(
        self, callbacks: Callbacks, cadence: CheckpointCadence, updater: SparseUpdater
    ) -> tuple[int, float]:
        """The epochs and steps; returns (rows trained over all ranks, seconds)."""
        state, feed, engine, progressive = self.state, self.feed, self.engine, self._progressive
        rows_done = 0
        finished_by_stop = False  # train.continuous: a stop ended the steps
        t_start = time.perf_counter()
        callbacks.on_fit_start(state)
        try:
            for epoch in range(state.epoch if feed.epoch_positions else 0, feed.epochs):
                if feed.epoch_positions:
                    state.epoch = epoch
                callbacks.on_epoch_start(state)
                skip = state.epoch_step if feed.epoch_positions else 0
                steps = engine.looked_up(feed.batches(epoch, skip), updater)
                for batch, looked_up in steps:
                    share = feed.share(batch)
                    callbacks.before_step(state)
                    plan = self.plan_for(batch) if self.plan_for is not None else None
                    loss = engine.step(batch, looked_up, updater, plan, loss_scale=share.loss_scale)
                    if progressive is not None and self._scored_on_arrival:
                        # Scored on arrival: every rank's rows of the step filed now,
                        # as the feed commits them (with the lag).
                        progressive.file_trained(
                            share.row_ids if share.row_ids is not None else batch.row_ids
                        )
                    elif progressive is not None:  # the step's logits, before its update
                        assert engine.last_logits is not None
                        progressive.record(batch, engine.last_logits)
                    state.step += 1
                    if feed.epoch_positions:
                        state.epoch_step += 1
                    feed.commit(share)
                    rows_done += share.rows
                    callbacks.after_step(state, share.rows, loss)
                    if state.stop.poll(state.step):
                        if feed.rules.stop_finishes:  # train.continuous: end as if drained
                            finished_by_stop = True
                            break
                        self._stop(cadence)
                if finished_by_stop:
                    close = getattr(steps, "close", None)  # the generator's prefetch
                    if close is not None:
                        close()
                    break
                if feed.epoch_positions:
                    state.epoch, state.epoch_step = epoch + 1, 0
            updater.flush()
            rules = feed.rules
            self._final = True  # the last checkpoints are written before fit returns
            if rules.final and rules.final_before_eval and state.step != cadence.saved_step:
                cadence.write(state)
            drained_stop = rules.stop_when_drained and not rules.stop_finishes
            if drained_stop and state.chief and state.stop.asked():
                self._stop(cadence)  # the batches ended on a stop while idle
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.checkpointer.wait()
            raise
        finally:
            updater.close()
            callbacks.on_fit_end(state)
            feed.close()
        self.checkpointer.wait()  # Blocking wait: the last asynchronous checkpoint commits
        return rows_done, time.perf_counter() - t_start

    def _save(self, updater: SparseUpdater) -> Path:
        # The data position and the state that goes with it (progressive figures:
        # rows dropped by the mixed buffer are filed and recorded together, in
        # hybrid/async mode on the read-ahead thread) are captured at one moment.
        with self.feed.commits_paused():
            position = self.feed.position()
            extras = self.checkpointer.capture_extras()
        if position is not None:  # the data position goes with the model state
            self.checkpointer.data_progress = position
        if self.checkpointer.job.output.checkpoint_async and not self._final:
            return self.checkpointer.save_async(updater, self.state, extras)
        return self.checkpointer.save_consistent(updater, self.state, extras)

    def _stop(self, cadence: CheckpointCadence) -> None:
        """Checkpoint the current step (rank 0, when the feed's rules ask for it
        and the last checkpoint is not of it) and raise ``TrainingStopped``."""
        state = self.state
        self._final = True  # a stop's checkpoint is on disk before TrainingStopped
        if state.chief and self.feed.rules.on_stop and cadence.saved_step != state.step:
            cadence.write(state)
        self.checkpointer.wait()  # Blocking wait: the stop's checkpoint is on disk
        link = self.checkpointer.link
        path = link.path if link is not None and cadence.saved_step == state.step else None
        raise TrainingStopped(state.stop.reason(), state.step, path)

    def _finish(
        self,
        updater: SparseUpdater,
        observer: RunObserver,
        cadence: CheckpointCadence,
        rows: int,
        train_wall_s: float,
    ) -> FitResult:
        state, feed, engine, job = self.state, self.feed, self.engine, self.checkpointer.job
        t_end = time.perf_counter()
        samples_per_s = rows / train_wall_s if train_wall_s > 0 else 0.0
        observer.finished(state.step, rows, samples_per_s)
        result = None
        batches = feed.eval_batches(job.train.eval_batch_size) if state.chief else None
        if batches is not None:  # one trainer evaluates
            result = evaluate_batches(engine.predict, batches)
            observer.evaluated(state.step, result)
        checkpoint = cadence.last if feed.rules.final_before_eval else None
        if feed.rules.final and not feed.rules.final_before_eval and state.chief:
            checkpoint = self.checkpointer.save(state)
        stats = stats_of(self.tables)  # one request per PS server
        bad_rows = feed.bad_rows()
        if self.metrics.server is not None:  # the final figures (the eval's lookups too)
            observer.sample(record=False)
        return FitResult(
            eval=result,
            train_rows=rows,
            eval_rows=result.rows if result is not None else 0,
            bad_rows=bad_rows,
            samples_per_s=samples_per_s,
            wall_s=train_wall_s + (time.perf_counter() - t_end) + self.load_s,
            mode=job.train.mode,
            checkpoint=checkpoint,
            profile=engine.times.as_dict(),
            extra={
                **feed.summary(),
                "steps": state.step,
                "train_wall_s": train_wall_s,
                "load_s": self.load_s,
                "max_staleness_seen": updater.log.max_behind,
                "sparse_placement": updater.placement.value,
                "precision": job.train.precision,
                **(
                    {"stopped": state.stop.reason()}
                    if feed.rules.stop_finishes and state.stop.asked()
                    else {}
                ),
                "device": str(engine.device),
                "embedding_rows": sum(s.rows for s in stats.values()),
                "embedding_bytes": sum(s.bytes for s in stats.values()),
                "unknown_grads": sum(s.unknown_grads for s in stats.values()),
                **{k: round(v, 6) for k, v in self.checkpointer.timings.items()},
                **(
                    {"progressive": self._progressive.stats.report()}
                    if self._progressive is not None
                    else {}
                ),
            },
        )
