"""Training from ``data.dataset``: batches from the task graph, exactly once.

``Trainer.fit`` hands over here when the job has ``data.dataset``. The loop is
the Trainer's own step (lookup -> forward/backward -> dense step -> sparse
update); around it:

1. ``Driver`` yields batches in plan order (interleaved, shuffled, seeded);
2. after each step, the batch's rows go into ``Progress`` (``record``);
3. every ``output.checkpoint_every_steps`` steps, and at the end, the sparse
   updates are flushed and the checkpoint is written with the progress in its
   manifest (``data_progress``): model and rows trained are saved together.

With W trainers (``DistributedTrainer``) only rank 0 runs the Driver, with
batches of W x B rows; each step's batch is split into W parts, one per rank
(``estuary.train.batch_scatter``), and rank 0 records the whole batch's rows
after the step and writes the checkpoint. Progress and checkpoint are those of
a one-trainer run with batch W x B, so a resume may use any W.

Resume (``estuary train --resume`` or ``trainer.load_checkpoint(run_dir)``):
the model, optimizer, tables and step come back from the checkpoint, the
Driver skips committed tasks and every row already trained in the others.

What "exactly once" means: the rows committed in a checkpoint are exactly the
rows whose updates are in that checkpoint's model. Rows trained after the last
checkpoint and before a crash are lost with the model state they changed, and
trained again after the resume; so the final checkpoint's accounting (each
split's trained ranges, ``duplicate_rows`` = 0) equals the input, row for row.
In ``hybrid``/``async`` mode the prefetcher may already have looked up (and so
inserted ids for) a batch or two beyond the checkpoint; such rows start from
their initial values either way, but admission counts may see them twice.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from estuary.config.errors import ConfigError
from estuary.data.graph import Driver, Progress
from estuary.metrics.evaluation import EvalResult, evaluate_predictions
from estuary.metrics.progress import ProgressBar
from estuary.train.batch_scatter import BatchScatter, ShareLoss
from estuary.train.sparse_updates import SparseUpdater

if TYPE_CHECKING:
    from estuary.train.trainer import FitResult, Trainer

__all__ = ["evaluate_stream", "fit_streaming", "restored_progress"]

logger = logging.getLogger(__name__)


def restored_progress(trainer: Trainer) -> Progress:
    """The data progress of the checkpoint the trainer was restored from (or fresh)."""
    if trainer.data_progress is None:
        return Progress()
    try:
        return Progress.from_json(trainer.data_progress)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError("", f"checkpoint data_progress is unreadable: {exc}") from exc


def _hash_names(trainer: Trainer) -> dict[str, str]:
    return {m: g for g, ms in trainer.job.model.embedding.shared.items() for m in ms}


def _check(trainer: Trainer) -> None:
    job = trainer.job
    if job.train.epochs != 1:
        raise ConfigError(
            "train.epochs", "must be 1 with data.dataset (streams are read once, in time order)"
        )


def save_with_progress(trainer: Trainer, updater: SparseUpdater, progress: Progress) -> Path:
    """Checkpoint model + tables + data progress, consistent with each other."""
    trainer.data_progress = progress.to_json()
    return trainer.checkpoint_now(updater)


def fit_streaming(
    trainer: Trainer,
    *,
    progress: bool | None = None,
    world_size: int = 1,
    group: Any = None,
) -> FitResult:
    """Train on ``data.dataset`` (see module docstring); returns the run's result.

    Args:
        world_size: W trainers (``DistributedTrainer``): rank 0 reads, plans and
            accounts for every row and hands each rank its part of each step
            (``estuary.train.batch_scatter``); only rank 0 checkpoints.
        group: with W > 1, the gloo process group that carries the batches.
    """
    with trainer.metrics.serving():  # /metrics while training (output.metrics_port)
        return _fit_streaming(trainer, progress=progress, world_size=world_size, group=group)


def _fit_streaming(
    trainer: Trainer, *, progress: bool | None, world_size: int, group: Any
) -> FitResult:
    from estuary.train.trainer import FitResult

    _check(trainer)
    job = trainer.job
    chief = trainer.rank == 0
    show = job.output.progress if progress is None else progress
    state = restored_progress(trainer)
    rows_before = state.rows_trained
    driver = None
    if chief:  # the only reader and planner; a step is W x B rows
        driver = Driver(
            job.data,
            job.base_dir,
            batch_size=job.train.batch_size * world_size,
            seed=job.train.seed,
            hash_names=_hash_names(trainer),
            progress=state,
            should_stop=trainer.stop_asked,  # while idle: end the batches there
        )
    feed = BatchScatter(
        rank=trainer.rank,
        world_size=world_size,
        features=trainer.features,
        num_dense=len(trainer.dataset.dense_names),
        source=driver.batches() if driver is not None else None,
        group=group,
    )
    share_loss, mean_loss = ShareLoss(), trainer.loss_fn
    if world_size > 1:
        trainer.loss_fn = share_loss
    updater = trainer.sparse_updater()
    every = job.output.checkpoint_every_steps if chief else None
    write_final = chief and (job.output.checkpoint or every is not None)
    checkpoint: Path | None = None
    saved_step = trainer.step if trainer.data_progress is not None else None
    rows_done = 0
    t_start = time.perf_counter()
    bar = ProgressBar(total=0, enabled=show)
    try:
        for batch, looked_up in trainer._steps(feed.batches(), updater):
            share = feed.next_share()  # this step's rows over all ranks
            share_loss.scale = world_size / max(share.rows, 1)
            loss = trainer._train_step(batch, looked_up, updater)
            trainer.step += 1
            state.record(share.row_ids)  # committed with the next checkpoint (rank 0)
            rows_done += share.rows
            bar.update(share.rows, loss, 0)
            if trainer.metrics.step(trainer.step, share.rows, loss):
                bad_rows = driver.bad_rows.count if driver is not None else 0
                trainer._refresh_metrics(updater, bad_rows=bad_rows)
            if every is not None and trainer.step % every == 0:
                checkpoint = save_with_progress(trainer, updater, state)
                saved_step = trainer.step
            if trainer.poll_stop():  # the progress goes with the checkpoint
                if chief and write_final and trainer.step != saved_step:
                    save_with_progress(trainer, updater, state)
                    saved_step = trainer.step
                trainer.stop_now(updater, saved_step=saved_step)
        updater.flush()
        if write_final and trainer.step != saved_step:
            checkpoint = save_with_progress(trainer, updater, state)
            saved_step = trainer.step
        if chief and trainer.stop_asked():  # the batches ended on a stop while idle
            trainer.stop_reason = trainer.stop_reason or trainer.asked_reason()
            trainer.stop_now(updater, saved_step=saved_step)
    finally:
        trainer.loss_fn = mean_loss
        updater.close()
        bar.close()
        if driver is not None:
            driver.close()
    train_wall_s = time.perf_counter() - t_start
    samples_per_s = rows_done / train_wall_s if train_wall_s > 0 else 0.0
    result, eval_rows = _evaluate(trainer)
    if result is not None:
        trainer.metrics.evaluated(result)
    stats = {name: t.stats() for name, t in trainer.tables.items()}
    bad_rows = driver.bad_rows.count if driver is not None else 0
    trainer.metrics.refresh(stats, staleness_max=updater.log.max_behind, bad_rows=bad_rows)
    trainer.metrics.trained(samples_per_s)
    return FitResult(
        eval=result,
        train_rows=rows_done,
        eval_rows=eval_rows,
        bad_rows=bad_rows,
        samples_per_s=samples_per_s,
        wall_s=time.perf_counter() - t_start + trainer.load_s,
        mode=job.train.mode,
        checkpoint=checkpoint,
        profile=trainer.times.as_dict(),
        extra={
            "epochs": 1,
            "steps": trainer.step,
            "train_wall_s": train_wall_s,
            "rows_committed": state.rows_trained,
            "rows_committed_before": rows_before,
            "duplicate_rows": state.duplicate_rows,
            "tasks_committed": state.tasks_committed,
            "batch_send_s": round(feed.send_s, 4),  # rank 0 handing parts to W - 1 ranks
            "embedding_rows": sum(s.rows for s in stats.values()),
            "embedding_bytes": sum(s.bytes for s in stats.values()),
            "unknown_grads": sum(s.unknown_grads for s in stats.values()),
        },
    )


def _evaluate(trainer: Trainer) -> tuple[EvalResult | None, int]:
    """Predict ``data.dataset.eval_stream`` (read once, in order); (None, 0) without one."""
    spec = trainer.job.data.dataset
    if spec is None or spec.eval_stream is None or trainer.rank != 0:
        return None, 0
    result = evaluate_stream(trainer)
    return result, result.rows


def evaluate_stream(trainer: Trainer, stream: str | None = None) -> EvalResult:
    """AUC / logloss of the trainer's model on one stream of ``data.dataset``, read
    once, in plan order, unshuffled, from its first window (no data progress).

    Args:
        stream: the stream to predict; default ``data.dataset.eval_stream``, the
            held-out stream a training run evaluates at its end.

    Raises:
        ConfigError: not a ``data.dataset`` job, no such stream, or no stream named
            and no ``eval_stream`` set.
    """
    job = trainer.job
    spec = job.data.dataset
    if spec is None:
        raise ConfigError("data.dataset", "evaluating a stream needs a data.dataset job")
    name = stream if stream is not None else spec.eval_stream
    if name is None:
        raise ConfigError(
            "data.dataset.eval_stream",
            "not set: name the stream to evaluate (estuary eval --stream NAME) "
            "or set data.dataset.eval_stream",
        )
    if name not in spec.streams:
        known = ", ".join(spec.streams)
        raise ConfigError("data.dataset.streams", f"no stream {name!r} (streams: {known})")
    driver = Driver(
        job.data,
        job.base_dir,
        batch_size=job.train.eval_batch_size,
        hash_names=_hash_names(trainer),
        streams=[name],
        shuffle=False,
    )
    labels, probabilities = [], []
    for batch in driver.batches():
        probabilities.append(trainer.predict(batch))
        labels.append(batch.labels)
    if not labels:
        return evaluate_predictions(np.zeros(0), np.zeros(0))
    return evaluate_predictions(np.concatenate(labels), np.concatenate(probabilities))
