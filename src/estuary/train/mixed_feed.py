"""``train.mixed_buffer``: rank 0's batches of a ``data.dataset`` job pass
through a ``MixedBuffer`` before training::

    per batch the task graph reads (origin "stream/source"):
      scores = scorer(batch)               with a scorer (importance: loss, or
                                           progressive evaluation): the model's
                                           probabilities as the rows arrive;
                                           on_scored(batch, scores) holds them
      buffer.offer(batch, origin, scores)  sampled down / evicted under pressure
      progress.record(dropped, dropped=True)   consumed and dropped: never read again
                                           (on_dropped(ids): their scores filed)
      fifo, buffer full: train a step from the buffer, offer the rest (backpressure)
      every offer_per_take x step rows offered: take one step (importance weights
          in ``Batch.weights``, which the engine's loss multiplies row by row)
    the data ended: take steps until the buffer is empty

Trained rows are recorded by the feed after their step (``GraphFeed.commit``);
rows still in the buffer at a checkpoint are in neither count, so a resume reads
them again: every row is trained once or counted dropped once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from estuary.config.mixed_buffer import MixedBufferSpec
from estuary.data import DataError
from estuary.data.graph import Progress
from estuary.data.types import Batch
from estuary.metrics.training import TrainingMetrics
from estuary.train.mixed_buffer import BufferPolicy, MixedBuffer, MixedBufferCollector

__all__ = ["BufferedSource", "StreamWeights", "register_collector"]

UNKNOWN_SOURCE = "unknown"


class StreamWeights(Mapping[str, float]):
    """``source_weights`` by ``stream/source`` or by stream name alone (the exact
    key wins)."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self._weights = dict(weights)

    def __getitem__(self, source: str) -> float:
        if source in self._weights:
            return self._weights[source]
        return self._weights[source.split("/", 1)[0]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, source: object) -> bool:
        try:
            self[str(source)]
        except KeyError:
            return False
        return True


def policy_for(spec: MixedBufferSpec, seed: int) -> BufferPolicy:
    """The buffer's policy for the job's settings."""
    return BufferPolicy(
        capacity_bytes=spec.capacity_bytes,
        policy=spec.policy,
        source_weights=StreamWeights(spec.source_weights),
        label_weight=spec.label_weight,
        half_life_rows=spec.half_life_rows,
        high_water=spec.high_water,
        min_keep=spec.min_keep,
        normalize_weights=spec.normalize_weights,
        order_by_importance=spec.order_by_importance,
        importance_from=spec.importance,
        loss_floor=spec.loss_floor,
        shed=spec.shed,
        seed=seed,
    )


class BufferedSource:
    """Steps of ``step_rows`` rows out of a ``MixedBuffer`` (module docstring).

    Args:
        spec: ``train.mixed_buffer``.
        step_rows: rows per step over all ranks (W x ``train.batch_size``).
        progress: where dropped rows are recorded as consumed.
        seed: the sampling's seed.

    Attributes:
        scorer: batch -> (B,) click probabilities under the model now, called
            on each arriving batch before it is offered (set by the training
            loop; required by ``importance: loss``).
        on_scored: called with each scored batch and its scores (progressive
            evaluation at arrival: a row later dropped is scored too).
        on_dropped: called with the row ids (N,) of every row dropped, as they
            are recorded in the data progress.
    """

    def __init__(
        self, spec: MixedBufferSpec, step_rows: int, progress: Progress, seed: int = 0
    ) -> None:
        self.spec, self.step_rows, self.progress = spec, step_rows, progress
        self.buffer = MixedBuffer(policy_for(spec, seed))
        self.rows_dropped = 0
        self.scorer: Callable[[Batch], np.ndarray] | None = None
        self.on_scored: Callable[[Batch, np.ndarray], None] | None = None
        self.on_dropped: Callable[[np.ndarray], None] | None = None

    @property
    def scores_on_arrival(self) -> bool:
        """Whether the buffer needs each arriving row's score (``importance: loss``)."""
        return self.spec.importance == "loss"

    def batches(self, source: Iterator[Batch]) -> Iterator[Batch]:
        """The steps to train, in order, until ``source`` ends and the buffer is empty.

        Raises:
            DataError: a fifo buffer cannot take one row while empty.
            ValueError: ``importance: loss`` and no ``scorer``.
        """
        if self.scores_on_arrival and self.scorer is None:
            raise ValueError("train.mixed_buffer.importance=loss: the buffer has no scorer")
        credit = 0.0  # rows offered since the last step
        per_step = self.spec.offer_per_take * self.step_rows
        for batch in source:
            origin = batch.origin or UNKNOWN_SOURCE
            scores = None
            if self.scorer is not None:
                scores = np.asarray(self.scorer(batch))
                if self.on_scored is not None:
                    self.on_scored(batch, scores)
            pending = batch
            while pending.num_rows:
                taken = self.buffer.offer(pending, origin, scores)
                self._record_dropped()
                credit += taken
                pending = pending.slice(taken, pending.num_rows)
                if scores is not None:
                    scores = scores[taken:]
                if pending.num_rows:  # fifo and full: train to make room
                    step = self._take()
                    if step is None:
                        raise DataError(
                            "train.mixed_buffer.capacity_bytes: "
                            f"{self.spec.capacity_bytes} bytes cannot hold one row of {origin}"
                        )
                    credit = max(0.0, credit - per_step)
                    yield step
            while credit >= per_step:
                credit -= per_step
                step = self._take()
                if step is None:
                    break
                yield step
        while (step := self._take()) is not None:  # the data ended: drain
            yield step

    def _take(self) -> Batch | None:
        step = self.buffer.take(self.step_rows)
        self._record_dropped()
        return step

    def _record_dropped(self) -> None:
        dropped = self.buffer.pop_dropped()
        if dropped.size:
            self.progress.record(dropped, dropped=True)
            self.rows_dropped += int(dropped.size)
            if self.on_dropped is not None:
                self.on_dropped(dropped)

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s ``mixed_buffer``: the buffer's stats (per source:
        offered, kept, sampled_out, evicted, delayed, taken) and rows dropped."""
        return {
            **self.buffer.stats(),
            "offer_per_take": self.spec.offer_per_take,
            "rows_dropped": self.rows_dropped,
        }


def register_collector(metrics: TrainingMetrics, source: BufferedSource) -> MixedBufferCollector:
    """Export ``source``'s buffer on the run's registry (``estuary_mixed_*``);
    unregister the returned collector when the fit ends."""
    collector = MixedBufferCollector(source.buffer)
    metrics.registry.register(collector)
    return collector
