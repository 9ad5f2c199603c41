"""``Timer``: emits the tasks of every source in plan order and waits until each
one's partitions are ready.

Plan order is ``(window start, -priority, stream, source)``: time first, so a
day of clicks is never trained before the previous day of impressions; among
windows that start together, the higher-priority stream goes first. Planning is
pure arithmetic (no file system): a year of hourly windows over ten sources is
~90k tuples merged in ~0.1 s.

Readiness is polled every ``poll_interval_s``:

- a closed range (``end`` set): a partition unready for ``ready_timeout_s``
  fails with ``PartitionNotReadyError`` naming it (or is skipped with a warning,
  ``on_timeout: skip``); no timeout = wait for ever (logged once per partition);
- an open-ended range: the run ends cleanly once the next partition has been
  unready for ``idle_timeout_s`` (and never plans past ``until``);
- a join waiting for a right stream's late events (``Readiness.until_s``) is
  neither idle nor timed out: it is ready once the clock passes ``until_s``.
"""

from __future__ import annotations

import enum
import heapq
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

from estuary.config.dataset import TimerSpec
from estuary.data.errors import DataError, DataWarning
from estuary.data.graph.types import SourceOperator, Task

__all__ = ["PartitionNotReadyError", "Timer", "WaitOutcome", "plan_tasks"]

logger = logging.getLogger(__name__)


class PartitionNotReadyError(DataError):
    """A partition of a closed time range stayed unready past ``ready_timeout_s``."""


class WaitOutcome(enum.Enum):
    """What the driver does with a task after waiting: read it, skip it, or end."""

    READY = "ready"
    SKIP = "skip"
    END = "end"


def plan_tasks(
    operators: Iterable[SourceOperator], done: Callable[[Task], bool] | None = None
) -> Iterator[Task]:
    """Every operator's tasks merged into plan order (lazy), minus ``done`` ones.

    Raises:
        ValueError: two operators plan the same (stream, source) tasks.
    """
    ops = list(operators)
    names = [(op.stream, op.name) for op in ops]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate source operators: {names}")
    merged = heapq.merge(*(op.tasks() for op in ops))  # tuples compare in plan order
    if done is None:
        return merged
    return (task for task in merged if not done(task))


class Timer:
    """Plans tasks in order and waits for their readiness (see module docstring).

    Args:
        spec: ``data.dataset.timer``.
        operators: the sources.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        spec: TimerSpec,
        operators: Sequence[SourceOperator],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.operators = list(operators)
        self._by_name = {(op.stream, op.name): op for op in self.operators}
        self.clock = clock

    def operator(self, task: Task) -> SourceOperator:
        return self._by_name[(task.stream, task.source)]

    def windows(self, done: Callable[[Task], bool] | None = None) -> Iterator[Task]:
        """Tasks in plan order, skipping ``done`` ones (already trained)."""
        return plan_tasks(self.operators, done)

    def wait_ready(self, task: Task, stop: threading.Event | None = None) -> WaitOutcome:
        """Block until ``task`` is ready (polling), or decide to skip it / end the run.

        Raises:
            PartitionNotReadyError: closed range, unready past ``ready_timeout_s``.
        """
        op = self.operator(task)
        stop = stop or threading.Event()
        first = self.clock()
        logged = False
        while True:
            readiness = op.check_ready(task)
            if readiness.ready:
                return WaitOutcome.READY
            waited = self.clock() - first
            if readiness.until_s is not None:
                pass  # a join's wait for late events: not idle, ready by until_s
            elif op.open_ended:
                idle = self.spec.idle_timeout_s
                if idle is not None and waited >= idle:
                    logger.info(
                        "no new data for %.0f s (%s): ending", waited, readiness.waiting_for
                    )
                    return WaitOutcome.END
            else:
                timeout = self.spec.ready_timeout_s
                if timeout is not None and waited >= timeout:
                    message = (
                        f"partition not ready after {waited:.1f} s: {readiness.waiting_for} "
                        "(data.dataset.timer.ready_timeout_s)"
                    )
                    if self.spec.on_timeout == "skip":
                        warnings.warn(f"skipped {message}", DataWarning, stacklevel=2)
                        return WaitOutcome.SKIP
                    raise PartitionNotReadyError(message)
            if not logged:
                logger.info("waiting for %s", readiness.waiting_for)
                logged = True
            # Blocking wait: the poll interval, cut short at the timeout or when the run stops.
            pause = self._next_poll_s(op.open_ended, waited)
            if readiness.until_s is not None:
                pause = self.spec.poll_interval_s
            if stop.wait(pause):
                return WaitOutcome.END

    def _next_poll_s(self, open_ended: bool, waited: float) -> float:
        limit = self.spec.idle_timeout_s if open_ended else self.spec.ready_timeout_s
        if limit is None:
            return self.spec.poll_interval_s
        return max(0.0, min(self.spec.poll_interval_s, limit - waited))
