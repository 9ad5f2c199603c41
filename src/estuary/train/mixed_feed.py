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

With ``live: arrival`` a reader thread drains the data as it comes: a live
source's batches (``type: stream``) are queued as soon as they are read, a
file source's only when the trainer needs rows (so files are never shed for
being fast); between steps the trainer scores and offers everything queued,
then takes one step. A live surge is then shed by the policy instead of waiting
in its broker; the queue holds at most ``capacity_bytes`` of rows (and one
batch; beyond that the reader waits, and the broker holds the rest). The
feed's close stops the reader (``stop_reader``, ``join_reader``).

Trained rows are recorded by the feed after their step (``GraphFeed.commit``);
rows still in the buffer (or the arrival queue) at a checkpoint are in neither
count, so a resume reads them again: every row is trained once or counted
dropped once. A drop is filed (``on_dropped``) and recorded under
``commit_lock``, which a checkpoint holds while it takes the data position and
the progressive figures (``GraphFeed.commits_paused``): in hybrid/async mode
drops happen on the read-ahead thread, and both or neither hold each one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from estuary.config.mixed_buffer import MixedBufferSpec
from estuary.data import DataError
from estuary.data.graph import Progress
from estuary.data.types import Batch
from estuary.metrics.training import TrainingMetrics
from estuary.train.mixed_buffer import BufferPolicy, MixedBuffer, MixedBufferCollector, row_bytes

__all__ = ["Arrivals", "BufferedSource", "StreamWeights", "register_collector"]

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
        max_age_rows=spec.max_age_rows,
        seed=seed,
    )


@dataclass
class _Arrived:
    """A batch read and not yet offered in full; ``scores`` once scored."""

    batch: Batch
    scores: np.ndarray | None = None
    scored: bool = False


_END = object()  # the source ended


class Arrivals:
    """The queue between ``live: arrival``'s reader thread and the trainer.

    The reader (``fill``) queues live batches as they come and a paced batch
    only once the trainer asks for rows (``take_all(wait=True)``); it waits
    while the queue holds ``limit_bytes`` or more. The trainer takes everything
    queued at once and may give back what its buffer refused (fifo).
    """

    def __init__(self, limit_bytes: int, live: frozenset[str]) -> None:
        self.limit_bytes, self.live = limit_bytes, live
        self._items: deque[object] = deque()
        self._bytes = 0
        self._wanted = False
        self._stopped = False
        self._cond = threading.Condition()

    def fill(self, source: Iterator[Batch]) -> None:
        """The reader thread: queue ``source``'s batches, then the end (or the
        error it raised, to be raised in the trainer's thread)."""
        try:
            for batch in source:
                if batch.origin not in self.live and not self._until_wanted():
                    return
                if not self._put(batch, int(row_bytes(batch).sum())):
                    return
            self._put(_END, 0)
        except BaseException as exc:  # surfaced in the trainer's thread, in order
            self._put(exc, 0)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _until_wanted(self) -> bool:
        with self._cond:
            while not self._wanted and not self._stopped:
                self._cond.wait(0.1)
            self._wanted = False
            return not self._stopped

    def _put(self, item: object, nbytes: int) -> bool:
        with self._cond:
            while self._items and self._bytes + nbytes > self.limit_bytes and not self._stopped:
                self._cond.wait(0.1)
            if self._stopped:
                return False
            self._items.append(item)
            self._bytes += nbytes
            self._cond.notify_all()
            return True

    def take_all(self, wait: bool) -> list[object]:
        """Everything queued (``_Arrived``, the end marker, or an exception);
        ``wait``: ask the reader for rows and wait for at least one item."""
        with self._cond:
            if wait and not self._items:
                self._wanted = True
                self._cond.notify_all()
                while not self._items and not self._stopped:
                    self._cond.wait(0.1)
            self._wanted = False  # what came is enough until the trainer asks again
            items = list(self._items)
            self._items.clear()
            self._bytes = 0
            self._cond.notify_all()
        return [_Arrived(i) if isinstance(i, Batch) else i for i in items]

    def give_back(self, items: list[object]) -> None:
        """Put ``items`` back at the head, in order (rows a full buffer refused)."""
        with self._cond:
            for item in reversed(items):
                self._items.appendleft(item)
                if isinstance(item, _Arrived):
                    self._bytes += int(row_bytes(item.batch).sum())
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped


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
        self,
        spec: MixedBufferSpec,
        step_rows: int,
        progress: Progress,
        seed: int = 0,
        live: frozenset[str] = frozenset(),
    ) -> None:
        self.spec, self.step_rows, self.progress = spec, step_rows, progress
        self.live = live  # origins of the live sources (``live: arrival``)
        self.buffer = MixedBuffer(policy_for(spec, seed))
        self.rows_dropped = 0
        self.scorer: Callable[[Batch], np.ndarray] | None = None
        self.on_scored: Callable[[Batch, np.ndarray], None] | None = None
        self.on_dropped: Callable[[np.ndarray], None] | None = None
        self._arrivals: Arrivals | None = None  # live: arrival, while reading
        self._reader: threading.Thread | None = None
        # Held while dropped rows are filed and recorded (on the read-ahead
        # thread in hybrid/async mode) and while a checkpoint captures the data
        # position with the progressive figures: both or neither hold them.
        self.commit_lock = threading.Lock()

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
        if self.spec.live == "arrival":
            yield from self._on_arrival(source)
            return
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

    def _on_arrival(self, source: Iterator[Batch]) -> Iterator[Batch]:
        """``live: arrival`` (module docstring): offer what arrived, take a step."""
        arrivals = self._arrivals = Arrivals(self.spec.capacity_bytes, self.live)
        reader = self._reader = threading.Thread(
            target=arrivals.fill, args=(source,), name="estuary-mixed-reader", daemon=True
        )
        reader.start()
        ended = False
        try:
            while True:
                short = self.buffer.rows < self.step_rows
                items = arrivals.take_all(wait=short and not ended)
                if arrivals.stopped:  # close(): the run is over
                    return
                refused: list[object] = []
                for item in items:
                    if refused:
                        refused.append(item)
                    elif item is _END:
                        ended = True
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        assert isinstance(item, _Arrived)
                        rest = self._offer(item)
                        if rest is not None:
                            refused.append(rest)
                if refused:  # fifo and full: train to make room, offer the rest next
                    arrivals.give_back(refused)
                if refused or self.buffer.rows >= self.step_rows or ended:
                    step = self._take()
                    if step is not None:
                        yield step
                    elif refused:
                        raise DataError(
                            "train.mixed_buffer.capacity_bytes: "
                            f"{self.spec.capacity_bytes} bytes cannot hold one row"
                        )
                    elif ended:
                        return
        finally:
            arrivals.stop()  # when the steps end or this generator is closed

    def stop_reader(self) -> None:
        """End ``live: arrival``'s reader thread (the feed's close: the run is
        over, whether or not its steps were drained). The reader stops at its
        next queueing, or once the driver's close ends the batch it waits for;
        ``join_reader`` waits for that."""
        if self._arrivals is not None:
            self._arrivals.stop()

    def join_reader(self, timeout_s: float = 10.0) -> None:
        if self._reader is not None:
            self._reader.join(timeout_s)

    def _offer(self, item: _Arrived) -> _Arrived | None:
        """Score ``item`` once (``on_scored``), offer it; the rows the buffer did
        not take (fifo and full), or ``None``."""
        batch = item.batch
        if not item.scored:
            item.scored = True
            if self.scorer is not None:
                item.scores = np.asarray(self.scorer(batch))
                if self.on_scored is not None:
                    self.on_scored(batch, item.scores)
        taken = self.buffer.offer(batch, batch.origin or UNKNOWN_SOURCE, item.scores)
        self._record_dropped()
        if taken == batch.num_rows:
            return None
        scores = None if item.scores is None else item.scores[taken:]
        return _Arrived(batch.slice(taken, batch.num_rows), scores, True)

    def _take(self) -> Batch | None:
        step = self.buffer.take(self.step_rows)
        self._record_dropped()
        return step

    def _record_dropped(self) -> None:
        dropped = self.buffer.pop_dropped()
        if dropped.size:
            with self.commit_lock:
                if self.on_dropped is not None:  # first: the record may end the rows' task,
                    self.on_dropped(dropped)  # after which their ids no longer decode
                self.progress.record(dropped, dropped=True)
                self.rows_dropped += int(dropped.size)

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s ``mixed_buffer``: the buffer's stats (per source:
        offered, kept, sampled_out, evicted, expired, delayed, taken) and rows dropped."""
        return {
            **self.buffer.stats(),
            "offer_per_take": self.spec.offer_per_take,
            "live": self.spec.live,
            "rows_dropped": self.rows_dropped,
        }


def register_collector(metrics: TrainingMetrics, source: BufferedSource) -> MixedBufferCollector:
    """Export ``source``'s buffer on the run's registry (``estuary_mixed_*``);
    unregister the returned collector when the fit ends."""
    collector = MixedBufferCollector(source.buffer)
    metrics.registry.register(collector)
    return collector
