"""Applying sparse gradients to the tables: inline, or in the background with a
bounded staleness.

Modes (``train.mode``):

* ``sync``: ``submit`` applies the update before returning, so every lookup sees
  every earlier update.
* ``hybrid``: one background thread applies updates in step order. Before the
  lookup of step ``s`` the trainer calls ``wait_landed(s - staleness)``: batch
  ``s`` may miss at most the ``staleness`` most recent updates.
* ``async``: as hybrid, without the wait (for comparison; the queue is unbounded).

The tables' numba kernels release the GIL, so the update thread runs beside the
torch compute of the next step. Where no core is free for it (see
``estuary.train.placement``), hybrid and async apply each update inline in
``submit``, like sync: staleness is an upper bound, and 0 meets it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from estuary.embedding import EmbeddingShard, EmbeddingTable
from estuary.embedding.types import (
    EmbeddingStore,
    Float32Array,
    Int64Array,
    TableStats,
    shared_multi_store,
)
from estuary.nn.embedding_collection import SparseGradients
from estuary.train.placement import Placement, choose_placement

T = TypeVar("T")


class LockedStore:
    """An ``EmbeddingStore`` whose calls are serialised by a lock, so a prefetch
    thread's lookups and the update thread's writes never interleave inside a
    table. The lock is held only for the duration of one kernel call."""

    def __init__(self, inner: EmbeddingStore) -> None:
        self.inner = inner
        self.lock = threading.Lock()

    @property
    def dim(self) -> int:
        return self.inner.dim

    def lookup(
        self, ids: Int64Array, *, train: bool, out: Float32Array | None = None
    ) -> Float32Array:
        with self.lock:
            return self.inner.lookup(ids, train=train, out=out)

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        with self.lock:
            self.inner.apply_gradients(ids, grads, lr_scale=lr_scale)

    def stats(self) -> TableStats:
        with self.lock:
            return self.inner.stats()


def computes_in_process(store: EmbeddingStore) -> bool:
    """True for tables whose calls are CPU work in this process (numba kernels),
    False for stores that may wait on something else (a parameter server)."""
    inner = store.inner if isinstance(store, LockedStore) else store
    return isinstance(inner, EmbeddingTable | EmbeddingShard)


def placement_for(tables: Mapping[str, EmbeddingStore], mode: str) -> Placement:
    """Where ``mode``'s sparse work on ``tables`` runs (``choose_placement``)."""
    cpu_bound = all(computes_in_process(t) for t in tables.values())
    return choose_placement(mode, cpu_bound=cpu_bound)


@dataclass
class StalenessLog:
    """Instrumentation: for each lookup, how many submitted updates had not landed.

    Args:
        max_behind: the largest such count seen.
        lookups: lookups recorded.
    """

    max_behind: int = 0
    lookups: int = 0
    behind_histogram: dict[int, int] = field(default_factory=dict)

    def record(self, behind: int) -> None:
        self.lookups += 1
        self.max_behind = max(self.max_behind, behind)
        self.behind_histogram[behind] = self.behind_histogram.get(behind, 0) + 1


class _Call(Generic[T]):
    """A call the update thread runs in order with the updates (``after_submitted``)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.future: Future[T] = Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # the caller reads it from the future
            self.future.set_exception(exc)


class SparseUpdater:
    """Delivers each step's sparse gradients to the tables, exactly once, in step
    order.

    Args:
        tables: table name -> store.
        mode: ``sync``, ``hybrid`` or ``async``.
        staleness: the hybrid bound k (>= 0; 0 behaves like sync).
        placement: ``BACKGROUND`` (an update thread) or ``INLINE`` (applied in
            ``submit``); default ``placement_for(tables, mode)``. Sync mode is inline.
    """

    def __init__(
        self,
        tables: Mapping[str, EmbeddingStore],
        mode: str,
        staleness: int,
        *,
        placement: Placement | None = None,
    ) -> None:
        if mode not in ("sync", "hybrid", "async"):
            raise ValueError(f"unknown train.mode {mode!r}")
        if mode == "sync" and placement is Placement.BACKGROUND:
            raise ValueError("sync mode applies updates inline; it cannot run them in background")
        self.tables = dict(tables)
        self.mode = mode
        self.staleness = staleness
        self.placement = placement or placement_for(self.tables, mode)
        self.submitted = 0  # steps handed in
        self.landed = 0  # steps whose update is applied (updates land in order)
        self.log = StalenessLog()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        # A step's gradients, a call to run in order (``after_submitted``), or None: stop.
        self._queue: queue.Queue[Sequence[SparseGradients] | _Call[Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self.placement is Placement.BACKGROUND:
            self._thread = threading.Thread(
                target=self._run, name="estuary-sparse-update", daemon=True
            )
            self._thread.start()

    def submit(self, grads: Sequence[SparseGradients]) -> None:
        """Hand in one step's gradients (step number = submission order), each
        table's applied at its ``lr_scale``."""
        self._raise_if_failed()
        with self._cond:
            self.submitted += 1
        if self._thread is None:
            self._apply(grads)
            with self._cond:
                self.landed += 1
        else:
            self._queue.put(grads)

    def before_lookup(self, step: int) -> None:
        """Called before the lookup for step ``step`` (1-based: the step about to be
        submitted next is ``submitted + 1``). Blocks in hybrid mode until the
        update of step ``step - staleness - 1`` or earlier has landed, i.e. at most
        ``staleness`` submitted updates are still in flight."""
        self._raise_if_failed()
        with self._cond:
            if self.mode == "hybrid":
                need = step - 1 - self.staleness
                # Blocking wait: the bounded-staleness barrier.
                while self.landed < need and self._error is None:
                    self._cond.wait()
            self.log.record(min(self.submitted, step - 1) - self.landed)
        self._raise_if_failed()

    def after_submitted(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` once every update submitted so far has landed, in order with
        the updates (on the update thread: the trainer does not wait; inline: now).
        Its result or error comes back through the returned future."""
        call = _Call(fn)
        if self._thread is None:
            call.run()
            return call.future
        with self._cond:  # a failed update thread drains the queue once, under the lock
            if self._error is not None:
                call.future.set_exception(
                    RuntimeError(f"sparse update thread failed: {self._error}")
                )
            else:
                self._queue.put(call)
        return call.future

    def flush(self) -> None:
        """Block until every submitted update has landed (before eval/checkpoint)."""
        with self._cond:
            # Blocking wait: drains the update queue.
            while self.landed < self.submitted and self._error is None:
                self._cond.wait()
        self._raise_if_failed()

    def close(self) -> None:
        """Flush and stop the update thread."""
        if self._thread is not None:
            try:
                self.flush()
            finally:
                self._queue.put(None)
                self._thread.join()
                self._thread = None

    def _apply(self, grads: Sequence[SparseGradients]) -> None:
        stores = [self.tables[g.table] for g in grads]
        multi = shared_multi_store(stores) if len(stores) > 1 else None
        if multi is not None:  # e.g. parameter-server tables: one request for the step
            multi.apply_gradients_many(
                stores,
                [g.ids for g in grads],
                [g.grads for g in grads],
                [g.lr_scale for g in grads],
            )
            return
        for store, g in zip(stores, grads, strict=True):
            store.apply_gradients(g.ids, g.grads, lr_scale=g.lr_scale)

    def _run(self) -> None:
        while True:
            grads = self._queue.get()
            if grads is None:
                return
            if isinstance(grads, _Call):  # after_submitted: every earlier update landed
                grads.run()
                continue
            try:
                self._apply(grads)
            except BaseException as exc:  # surfaced on the trainer thread
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                    self._cancel_calls(exc)
                return
            with self._cond:
                self.landed += 1
                self._cond.notify_all()

    def _cancel_calls(self, exc: BaseException) -> None:
        """After a failure (lock held): the queued calls will never run; their
        futures fail."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Call):
                item.future.set_exception(
                    RuntimeError(f"sparse update thread failed before this call: {exc}")
                )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("sparse update thread failed") from self._error
