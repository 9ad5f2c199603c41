"""Prefetching: the lookup for batch t+1 runs while batch t computes.

``Prefetcher`` wraps a batch iterator; a background thread pulls the next batch,
waits for the staleness bound (``SparseUpdater.before_lookup``) and gathers its
rows, then hands ``(batch, looked_up)`` over a bounded queue. The torch thread
only ever waits on that queue when lookups are slower than compute.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from estuary.data.types import Batch
from estuary.nn.embedding_collection import LookedUpBatch


@dataclass
class StageTimes:
    """Seconds spent per stage, summed over a run (for ``--profile``)."""

    data_s: float = 0.0
    lookup_s: float = 0.0
    wait_s: float = 0.0
    forward_backward_s: float = 0.0
    dense_step_s: float = 0.0
    sparse_submit_s: float = 0.0
    steps: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


_DONE = object()


class Prefetcher:
    """Iterate ``(step, batch, looked_up)`` with lookups ``depth`` batches ahead.

    Args:
        batches: the batch source (consumed on the prefetch thread).
        lookup: ``batch -> LookedUpBatch``; called on the prefetch thread.
        before_lookup: ``step -> None``; may block (staleness barrier).
        first_step: step number of the first batch (1-based).
        depth: batches in flight ahead of the consumer.
        times: where to add data/lookup/wait seconds.
    """

    def __init__(
        self,
        batches: Iterable[Batch],
        lookup: Callable[[Batch], LookedUpBatch],
        before_lookup: Callable[[int], None],
        *,
        first_step: int,
        depth: int = 2,
        times: StageTimes | None = None,
    ) -> None:
        self._batches = batches
        self._lookup = lookup
        self._before_lookup = before_lookup
        self._step = first_step
        self._times = times or StageTimes()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="estuary-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        step = self._step
        try:
            iterator = iter(self._batches)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                batch = next(iterator, None)
                t1 = time.perf_counter()
                self._times.data_s += t1 - t0
                if batch is None:
                    break
                self._before_lookup(step)
                t2 = time.perf_counter()
                looked_up = self._lookup(batch)
                self._times.lookup_s += time.perf_counter() - t2
                if not self._put((step, batch, looked_up)):
                    return
                step += 1
            self._put(_DONE)
        except BaseException as exc:  # re-raised on the consumer thread
            self._put(exc)

    def __iter__(self) -> Iterator[tuple[int, Batch, LookedUpBatch]]:
        try:
            while True:
                t0 = time.perf_counter()
                # Blocking wait: only when lookups are slower than compute.
                item = self._queue.get()
                self._times.wait_s += time.perf_counter() - t0
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
