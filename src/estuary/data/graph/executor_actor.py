"""The data executor's Ray actor class (``estuary.runtime.ray.executors`` runs
and resizes them). It lives here, away from ``estuary.runtime``, so that an
executor's process imports the reader only (numba, pyarrow), not the trainer's
modules (torch): an executor added while the job runs starts in ~1/4 of the time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import ray

from estuary.data.graph.executor_memory import MemoryWatch
from estuary.data.graph.executors import SplitReader
from estuary.data.graph.routing import BlockRows, RemoteBlock

__all__ = ["DataExecutorActor"]


@ray.remote
class DataExecutorActor:
    """Reads whole splits (``read_split_whole``) for a remote driver, and says
    how much memory it holds (``memory``)."""

    def __init__(self) -> None:
        self._memory = MemoryWatch()
        self._warm = False  # a read has ended here (imports done, reader compiled)

    def pid(self) -> int:
        return os.getpid()

    def memory(self) -> tuple[int, int]:
        """``(base, peak)`` resident bytes (``MemoryWatch``); the peak restarts."""
        return self._memory.take()

    def read(self, reader: SplitReader) -> Iterator[Any]:
        """A streaming generator: per block its ``BlockRows`` then its
        ``RemoteBlock`` (payload ``None``), then ``(good rows, last row, CPU
        seconds)``: the CPU time the read's thread spent (parsing, handing on
        blocks; not time waiting on the source), which with the read's wall time
        tells the scaling policy a latency-bound source from a CPU-bound one.
        ``None`` for a read begun before any other ended here: it paid the
        executor's warm-up (lazy imports, the reader's JIT compiling), which
        no later read costs."""
        self._memory.read_started()
        warm = self._warm
        began = time.thread_time()  # Ray runs a generator call in one thread
        try:
            for block in reader.blocks():
                self._memory.sample()
                yield BlockRows.of(block)
                yield RemoteBlock.of(block, None)
            cpu_s = time.thread_time() - began if warm else None
            self._warm = True
            yield reader.good_rows, reader.last_row, cpu_s
        finally:
            self._memory.read_ended()
