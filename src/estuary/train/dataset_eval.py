"""Training from ``data.dataset``: batches from the task graph, exactly once.

A ``data.dataset`` job's ``Trainer.fit`` runs the one fit loop
(``estuary.train.loop``) over a ``GraphFeed`` (``estuary.train.feeds``); around
each step (lookup -> forward/backward -> dense step -> sparse update):

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

from collections.abc import Callable
from typing import Protocol

import numpy as np

from estuary.config import JobSpec
from estuary.data.types import Batch
from estuary.metrics.evaluation import EvalResult
from estuary.metrics.progress import ProgressBar
from estuary.train.feeds import stream_batches
from estuary.train.loop import evaluate_batches
from estuary.train.plan import TrainPlan

__all__ = ["evaluate_stream"]


class Predictor(Protocol):
    """What ``evaluate_stream`` needs of a trainer."""

    job: JobSpec
    plan: TrainPlan

    def predict(self, batch: Batch) -> np.ndarray: ...


def evaluate_stream(
    trainer: Predictor,
    stream: str | None = None,
    *,
    progress: bool = False,
    sink: Callable[[Batch, np.ndarray], None] | None = None,
) -> EvalResult:
    """AUC / logloss of the trainer's model on one stream of ``data.dataset``, read
    once, in plan order, unshuffled, from its first window (no data progress).

    Args:
        stream: the stream to predict; default ``data.dataset.eval_stream``, the
            held-out stream a training run evaluates at its end.
        progress: a bar of rows evaluated on stderr.
        sink: gets each batch and its probabilities (B,).

    Raises:
        ConfigError: not a ``data.dataset`` job, no such stream, or no stream named
            and no ``eval_stream`` set.
    """
    size = trainer.job.train.eval_batch_size
    bar = ProgressBar(None, enabled=progress, desc="eval")  # a stream's length is unknown
    batches = stream_batches(trainer.job, trainer.plan, stream, size)
    return evaluate_batches(trainer.predict, batches, bar, sink)
