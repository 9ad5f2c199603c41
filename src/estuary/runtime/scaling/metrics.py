"""What the scaling policy reads: one ``Snapshot`` of the job per interval, and
the clocks that measure its parts (time a consumer waits for data, time an
executor spends reading).

::

    trainer (rank 0) --next batch--> WaitClock   wait fraction, rows/s
    data executors   --read split--> BusyClock   busy fraction, splits waiting
    PS shards        --stats()-----> ShardMetrics load, memory, budget
                      all of it --> Snapshot --> policy
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["BusyClock", "ExecutorMemory", "ShardMetrics", "Snapshot", "WaitClock"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class ShardMetrics:
    """One PS shard at one moment.

    Args:
        shard: its index p.
        load: ids served per second over the last interval.
        rows: ids holding a row.
        memory_bytes: memory held by its tables.
        budget_bytes: its memory budget (``runtime.roles.ps.memory_mb``); ``None``: none.
        capacity_rows: its row cap now; ``None``: none.
        allocated_rows: rows its arrays hold before they grow (rows moved or
            evicted away leave room that new rows reuse); ``None``: not known.
        admission_min_count: the least admission ``min_count`` of its tables
            that count sightings; ``None``: every table admits every id.
    """

    shard: int
    load: float
    rows: int
    memory_bytes: int
    budget_bytes: int | None = None
    capacity_rows: int | None = None
    allocated_rows: int | None = None
    admission_min_count: int | None = None


@dataclass(frozen=True)
class ExecutorMemory:
    """The data executor holding the most memory over one interval.

    Args:
        base_bytes: its resident bytes with no read in flight.
        peak_bytes: the most resident bytes it reached over the interval.
        budget_bytes: each executor's memory ask (``runtime.roles.data_executor.
            memory_mb``); ``None``: none.
    """

    base_bytes: int
    peak_bytes: int
    budget_bytes: int | None = None

    def per_read(self, threads: int) -> float:
        """Bytes one concurrent read costs, from this interval at ``threads``."""
        return max(0, self.peak_bytes - self.base_bytes) / max(1, threads)

    def forecast(self, threads: int, now_threads: int) -> float:
        """Peak bytes at ``threads`` concurrent reads (measured at ``now_threads``)."""
        return self.base_bytes + threads * self.per_read(now_threads)


@dataclass(frozen=True)
class Snapshot:
    """The job over one interval (rates and fractions are over the interval).

    Args:
        t: seconds since the manager started (end of the interval).
        executors: data executors now.
        trainer_wait: fraction of the trainer's time spent waiting for data;
            ``None``: not measured.
        executor_busy: fraction of the executors' time spent reading splits.
        queue_depth: splits waiting for an idle executor now.
        rows_per_s: rows trained per second.
        executor_threads: threads (CPUs) of each executor.
        executors_starting: executors added and not up yet (counted in ``executors``).
        cpu: role -> CPU use as a fraction of its cores.
        shards: the PS shards.
        executor_memory: the executors' memory; ``None``: not measured.
        executor_cpu: CPU seconds an executor spent per second of a read, over
            the reads done in the interval (near 0: the reads wait on a
            latency-bound source; near 1: they parse, CPU-bound); ``None``: no
            read done reported it.
    """

    t: float
    executors: int
    trainer_wait: float | None
    executor_busy: float
    queue_depth: int
    rows_per_s: float
    executor_threads: int = 1
    executors_starting: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    shards: tuple[ShardMetrics, ...] = ()
    executor_memory: ExecutorMemory | None = None
    executor_cpu: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "t": round(self.t, 3),
            "executors": self.executors,
            "executor_threads": self.executor_threads,
            "executors_starting": self.executors_starting,
            "trainer_wait": None if self.trainer_wait is None else round(self.trainer_wait, 4),
            "executor_busy": round(self.executor_busy, 4),
            "queue_depth": self.queue_depth,
            "rows_per_s": round(self.rows_per_s, 2),
            "executor_cpu": None if self.executor_cpu is None else round(self.executor_cpu, 4),
            "cpu": {k: round(v, 4) for k, v in self.cpu.items()},
            "shards": [
                {
                    "shard": s.shard,
                    "load": round(s.load, 2),
                    "rows": s.rows,
                    "memory_bytes": s.memory_bytes,
                    "budget_bytes": s.budget_bytes,
                    "capacity_rows": s.capacity_rows,
                    "allocated_rows": s.allocated_rows,
                }
                for s in self.shards
            ],
            "executor_memory": (
                None
                if self.executor_memory is None
                else {
                    "base_bytes": self.executor_memory.base_bytes,
                    "peak_bytes": self.executor_memory.peak_bytes,
                    "budget_bytes": self.executor_memory.budget_bytes,
                }
            ),
        }


class WaitClock:
    """Time a consumer spends waiting for the next item of an iterator, and the
    rows it took (one consumer; ``read`` from any thread). A wait in progress
    counts up to the moment it is read, so an interval spent wholly waiting
    reads as waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waited = 0.0
        self._rows = 0
        self._since: float | None = None  # a wait in progress: since (or last read)
        self._started = time.monotonic()

    def wrap(self, items: Iterator[_T]) -> Iterator[_T]:
        """``items``, timing each ``next`` (rows are counted by ``add_rows``)."""
        while True:
            with self._lock:
                self._since = time.monotonic()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                with self._lock:
                    if self._since is not None:
                        self._waited += time.monotonic() - self._since
                    self._since = None
            yield item

    def add_rows(self, rows: int) -> None:
        with self._lock:
            self._rows += rows

    def read(self) -> tuple[float, float, int]:
        """(seconds since start, seconds waited, rows): cumulative."""
        with self._lock:
            now = time.monotonic()
            if self._since is not None:
                self._waited += now - self._since
                self._since = now
            return now - self._started, self._waited, self._rows


class BusyClock:
    """Read-slot-seconds spent reading (a slot: one concurrent read of one
    executor), readers waiting for a free slot, and, of the reads done, their
    wall seconds and the CPU seconds their executors spent on them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0.0
        self._cpu = 0.0  # CPU seconds of the reads done that reported it
        self._cpu_wall = 0.0  # ... and their wall seconds
        self._capacity = 0.0  # slot-seconds available
        self._slots = 0
        self._since = time.monotonic()
        self._running: dict[int, float] = {}  # read token -> start (or last roll)
        self._started: dict[int, float] = {}  # read token -> start
        self._tokens = 0
        self.waiting = 0  # readers waiting for an idle executor now

    def set_slots(self, count: int) -> None:
        with self._lock:
            self._roll()
            self._slots = count

    def _roll(self) -> None:
        now = time.monotonic()
        self._capacity += self._slots * (now - self._since)
        self._since = now

    def start(self) -> int:
        """A read began; returns its token for ``stop``."""
        with self._lock:
            self._tokens += 1
            self._running[self._tokens] = self._started[self._tokens] = time.monotonic()
            return self._tokens

    def stop(self, token: int, cpu_s: float | None = None) -> None:
        """The read ``token`` ended; ``cpu_s``: the CPU seconds it cost its
        executor (``None``: not known)."""
        now = time.monotonic()
        with self._lock:
            began = self._running.pop(token, None)
            if began is not None:
                self._busy += now - began
            start = self._started.pop(token, None)
            if cpu_s is not None and start is not None:
                self._cpu += cpu_s
                self._cpu_wall += now - start

    def read(self) -> tuple[float, float]:
        """(busy slot-seconds, available slot-seconds): cumulative,
        reads in progress counted up to now."""
        with self._lock:
            self._roll()
            now = time.monotonic()
            for token, began in self._running.items():
                self._busy += now - began
                self._running[token] = now
            return self._busy, self._capacity

    def cpu(self) -> tuple[float, float]:
        """(CPU seconds, wall seconds) of the reads done that reported their
        CPU: cumulative."""
        with self._lock:
            return self._cpu, self._cpu_wall
