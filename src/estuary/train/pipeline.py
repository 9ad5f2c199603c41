"""Prefetching: the lookup for batch t+1 runs while batch t computes.

``Prefetcher`` wraps a batch iterator; a background thread pulls the next batch,
waits for the staleness bound (``SparseUpdater.before_lookup``) and gathers its
rows, then hands ``(batch, looked_up)`` over a bounded queue. The torch thread
only ever waits on that queue when lookups are slower than compute.

With ``Placement.INLINE`` (no core free for a helper thread, see
``estuary.train.placement``) the same steps run on the consuming thread, one
batch at a time, when it asks for the next batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from estuary.data.types import Batch
from estuary.nn.embedding_collection import LookedUpBatch
from estuary.train.placement import Placement, choose_placement
from estuary.train.sparse_updates import SparseUpdater


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


def _default_placement(before_lookup: Callable[[int], None]) -> Placement:
    updater = getattr(before_lookup, "__self__", None)
    if isinstance(updater, SparseUpdater):
        return updater.placement
    return choose_placement("hybrid")


class Prefetcher:
    """Iterate ``(step, batch, looked_up)`` with lookups ``depth`` batches ahead.

    Args:
        batches: the batch source (consumed on the prefetch thread, or on the
            consuming thread when inline).
        lookup: ``batch -> LookedUpBatch``; called where ``batches`` is consumed.
        before_lookup: ``step -> None``; may block (staleness barrier).
        first_step: step number of the first batch (1-based).
        depth: batches in flight ahead of the consumer.
        times: where to add data/lookup/wait seconds.
        placement: ``BACKGROUND`` (a prefetch thread) or ``INLINE`` (no thread);
            default: the updater's when ``before_lookup`` is a ``SparseUpdater``'s
            (lookups and updates run where the same policy put them), else
            ``choose_placement("hybrid")``.
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
        placement: Placement | None = None,
    ) -> None:
        self._batches = batches
        self._lookup = lookup
        self._before_lookup = before_lookup
        self._step = first_step
        self._times = times or StageTimes()
        self.placement = placement or _default_placement(before_lookup)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.placement is Placement.BACKGROUND:
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

    def _produce(self) -> Iterator[tuple[int, Batch, LookedUpBatch]]:
        """Read, wait for the staleness bound, look up: on whichever thread iterates."""
        step = self._step
        iterator = iter(self._batches)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            batch = next(iterator, None)
            t1 = time.perf_counter()
            self._times.data_s += t1 - t0
            if batch is None:
                return
            self._before_lookup(step)
            t2 = time.perf_counter()
            looked_up = self._lookup(batch)
            self._times.lookup_s += time.perf_counter() - t2
            yield step, batch, looked_up
            step += 1

    def _run(self) -> None:
        try:
            for item in self._produce():
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as exc:  # re-raised on the consumer thread
            self._put(exc)

    def __iter__(self) -> Iterator[tuple[int, Batch, LookedUpBatch]]:
        if self._thread is None:
            yield from self._produce()
            return
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
        if self._thread is not None:
            self._thread.join(timeout=10)
