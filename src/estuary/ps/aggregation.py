"""Exactly-once, in-order application of one table's per-step gradients from W ranks.

Shapes: ``N_r`` ids pushed by rank r, ``U`` distinct ids of a step, ``D`` dim.

::

    push(step=5, rank=1, ids, grads) --> buffered until all W ranks pushed step 5
    all W in and step 4 applied      --> ids, grads of ranks 0..W-1 concatenated,
                                         summed per id (U rows), ONE optimizer step
                                         at the step's lr scale (all W ranks must
                                         push the same one, else the table fails)
    push of an applied or already buffered (step, rank)  --> ignored, counted

Steps are applied strictly in order 1, 2, 3, ... by whichever pushing thread
completes them, under the aggregator's lock, so two steps never interleave.
Readers wait on ``wait_applied`` (the staleness barrier).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from estuary.embedding.types import Float32Array, Int64Array
from estuary.ps.types import PSError, PSTimeoutError

logger = logging.getLogger(__name__)


class ApplyFn(Protocol):
    """One optimizer step: ``(unique ids (U,), summed grads (U, D))`` at the
    learning rate times ``lr_scale`` (``EmbeddingStore.apply_gradients``)."""

    def __call__(self, ids: Int64Array, grads: Float32Array, *, lr_scale: float) -> None: ...


def sum_by_id(
    parts: list[tuple[Int64Array, Float32Array]], dim: int
) -> tuple[Int64Array, Float32Array]:
    """Concatenate ``parts`` (ids (N_r,), grads (N_r, D)) and sum rows per id ->
    (unique ids (U,), summed grads (U, D)). Rows of one id are added in part order
    (a stable sort), so the result does not depend on arrival order."""
    if not parts:
        return np.empty(0, np.int64), np.empty((0, dim), np.float32)
    ids = np.concatenate([p[0] for p in parts])
    grads = np.concatenate([p[1] for p in parts])
    order = np.argsort(ids, kind="stable")  # O(N log N); ~3 ms for 200k ids
    sorted_ids = ids[order]
    if sorted_ids.size == 0:
        return sorted_ids, grads.reshape(0, dim)
    starts = np.flatnonzero(np.concatenate([[True], sorted_ids[1:] != sorted_ids[:-1]]))
    summed = np.add.reduceat(grads[order], starts, axis=0)  # (U, D)
    return sorted_ids[starts], np.ascontiguousarray(summed, dtype=np.float32)


class StepAggregator:
    """Collects each step's pushes from ``world_size`` ranks and applies their sum once.

    Args:
        name: table name (for messages).
        dim: D.
        world_size: W.
        apply: one optimizer step, ``(unique ids (U,), summed grads (U, D), *, lr_scale)``.
        max_pending_steps: how far past the last applied step a push may be.
    """

    def __init__(
        self, name: str, dim: int, world_size: int, apply: ApplyFn, *, max_pending_steps: int = 64
    ) -> None:
        self.name = name
        self.dim = dim
        self.world_size = world_size
        self.max_pending_steps = max_pending_steps
        self._apply = apply
        self._cond = threading.Condition()
        # step -> rank -> (ids, grads, lr_scale)
        self._pending: dict[int, dict[int, tuple[Int64Array, Float32Array, float]]] = {}
        self._error: BaseException | None = None
        self._hooks: dict[int, list[Callable[[], None]]] = {}  # step -> run once applied
        self.applied = 0  # last applied step; steps are 1-based
        self.duplicates = 0  # pushes ignored because (step, rank) was already in
        self.waits = 0  # requests that had to wait for a step
        self.max_behind = 0  # most steps a training lookup missed (see note_lookup)

    def push(
        self,
        step: int,
        rank: int,
        ids: Int64Array,
        grads: Float32Array,
        *,
        lr_scale: float = 1.0,
    ) -> bool:
        """Buffer rank ``rank``'s gradients of ``step``, to be applied at the
        learning rate times ``lr_scale``; apply every step that became complete.
        Returns ``False`` (and changes nothing) for a duplicate push.

        Raises:
            PSError: bad rank/step/shape/scale, the table failed earlier, or this
                push completed a step whose ranks gave different lr scales (the
                table then fails: the step cannot be applied, for any rank).
        """
        if not 0 <= rank < self.world_size:
            raise PSError(f"table {self.name!r}: rank {rank} not in [0, {self.world_size})")
        if step < 1:
            raise PSError(f"table {self.name!r}: steps start at 1, got {step}")
        if ids.ndim != 1 or grads.shape != (ids.size, self.dim):
            raise PSError(
                f"table {self.name!r}: grads must have shape ({ids.size}, {self.dim}) "
                f"for {ids.size} ids, got {grads.shape}"
            )
        if not (math.isfinite(lr_scale) and lr_scale >= 0):
            raise PSError(
                f"table {self.name!r}: lr scale of step {step} must be finite and >= 0, "
                f"got {lr_scale!r}"
            )
        with self._cond:
            self._raise_if_failed()
            buffered = self._pending.get(step, {})
            if step <= self.applied or rank in buffered:
                self.duplicates += 1
                return False
            if step > self.applied + self.max_pending_steps:
                raise PSError(
                    f"table {self.name!r}: push of step {step} is more than "
                    f"{self.max_pending_steps} steps ahead of the last applied step {self.applied}"
                )
            self._pending.setdefault(step, buffered)[rank] = (ids, grads, lr_scale)
            self._apply_complete_steps()
        return True

    def _apply_complete_steps(self) -> None:
        # Called with the lock held: steps are applied one at a time, in order.
        while len(self._pending.get(self.applied + 1, ())) == self.world_size:
            if self._hooks:
                self._run_hooks(self.applied)  # snapshots of the last step come first
            step = self.applied + 1
            by_rank = self._pending.pop(step)
            scales = {r: by_rank[r][2] for r in range(self.world_size)}
            if len(set(scales.values())) > 1:
                self._error = PSError(
                    f"table {self.name!r}: the ranks pushed step {step} with different "
                    f"lr scales {scales} (rank: scale); a step is applied once, at one "
                    "scale: pick the update plan per global batch"
                )
                self._cond.notify_all()
                raise self._error
            parts = [(by_rank[r][0], by_rank[r][1]) for r in range(self.world_size)]
            ids, grads = sum_by_id(parts, self.dim)
            try:
                self._apply(ids, grads, lr_scale=scales[0])
            except BaseException as exc:
                self._error = exc
                self._cond.notify_all()
                raise PSError(f"table {self.name!r}: applying step {step} failed: {exc}") from exc
            self.applied = step
            if step in self._hooks:
                self._spawn_hooks(step)
            self._cond.notify_all()

    def start_at(self, step: int) -> None:
        """Take ``step`` as the last applied one (a server joining a running job:
        the steps before were applied by the others). Only while no push is
        buffered; never goes back."""
        with self._cond:
            if self._pending:
                raise PSError(
                    f"table {self.name!r}: cannot start at step {step}, steps "
                    f"{sorted(self._pending)} are buffered here already"
                )
            self.applied = max(self.applied, step)
            self._cond.notify_all()

    def after_step(self, step: int, hook: Callable[[], None]) -> bool:
        """Run ``hook()`` once ``step`` is applied and before ``step + 1`` is, with
        step application held off meanwhile: a snapshot of exactly that step. A
        step not applied yet runs its hooks on a thread of its own once applied
        (the push that completes it does not wait); for the step applied last,
        the caller runs them (``run_after``: one thread for many tables). Either
        way they run at the latest just before ``step + 1`` is applied. Returns
        ``False`` (and never runs it) when a later step was applied already. A
        hook's error is logged, never fails the table: the hook reports its own
        failure."""
        with self._cond:
            if step < self.applied:
                return False
            self._hooks.setdefault(step, []).append(hook)
            return True

    def run_after(self, step: int) -> None:
        """Run the hooks of ``step`` now if it is the last applied step (else they
        ran, or will run, when it is applied)."""
        with self._cond:
            if self.applied == step:
                self._run_hooks(step)

    def _spawn_hooks(self, step: int) -> None:
        def run() -> None:
            with self._cond:
                if self.applied == step:  # else the next step's apply ran them
                    self._run_hooks(step)

        threading.Thread(target=run, name=f"estuary-ps-after-{step}", daemon=True).start()

    def _run_hooks(self, step: int) -> None:
        # Called with the lock held.
        for hook in self._hooks.pop(step, ()):
            _run_hook(self.name, step, hook)

    def wait_applied(self, step: int, timeout_s: float) -> None:
        """Return once ``step`` (and every step before it) has been applied.

        Raises:
            PSTimeoutError: not within ``timeout_s``; names the ranks still missing.
            PSError: the table failed while waiting.
        """
        if self.applied >= step:  # fast path: an int read, no lock
            return
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self.waits += 1
            # Blocking wait: the staleness barrier (other ranks' pushes land here).
            while self.applied < step and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting_for = self.applied + 1
                    missing = self.missing_ranks(waiting_for)
                    raise PSTimeoutError(
                        f"table {self.name!r}: step {step} not applied within {timeout_s:g} s "
                        f"(last applied {self.applied}; step {waiting_for} still needs "
                        f"pushes from ranks {missing})"
                    )
                self._cond.wait(left)
            self._raise_if_failed()

    def note_lookup(self, step: int) -> None:
        """Instrumentation: a training lookup of ``step`` is about to read the
        table; it sees every step up to ``applied`` (steps only land later), so it
        misses ``step - 1 - applied`` updates at most."""
        behind = step - 1 - self.applied
        if behind > self.max_behind:
            with self._cond:
                self.max_behind = max(self.max_behind, behind)

    def missing_ranks(self, step: int) -> list[int]:
        """Ranks that have not pushed ``step`` yet (empty once applied)."""
        if step <= self.applied:
            return []
        have = self._pending.get(step, {})
        return [r for r in range(self.world_size) if r not in have]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold off step application for the ``with`` block (snapshots, loads)."""
        with self._cond:
            yield

    @property
    def pending_steps(self) -> int:
        """Steps with some but not all pushes buffered."""
        return len(self._pending)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PSError(
                f"table {self.name!r} failed at step {self.applied + 1} and accepts no "
                f"more requests: {self._error}"
            )


def _run_hook(name: str, step: int, hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception:  # the hook's owner reports it; the table goes on
        logger.exception("table %r: a hook after step %d failed", name, step)
