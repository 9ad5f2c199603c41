"""Data executors on Ray (``runtime.data_executors``): actors that read whole
splits of a ``data.dataset`` for the driver on rank 0.

::

    rank 0: Driver (plans, waits for readiness, shuffles, accounts, scatters)
      worker thread --read(split)--> RayExecutorPool --> DataExecutorActor e
                                       an idle executor takes the split; the
                                       blocks come back through the object store
      executor e dies mid-split: the pool starts a new one in e's bundle of the
      placement group and reads the split again there (no row of it was handed
      out: a split's blocks come back whole), nothing else restarts

Executors lost and replaced are counted (``data_executor_restarts`` in
summary.json); past ``runtime.max_restarts`` replacements the read fails with
an error naming the executor and its cause.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from estuary.config.spec import RoleResources
from estuary.data.errors import DataError
from estuary.data.graph.executors import Block, SplitReader, read_split_whole

__all__ = ["DataExecutorActor", "DataExecutorLost", "RayExecutorPool", "RayExecutors"]


class DataExecutorLost(DataError):
    """A data executor died more often than ``runtime.max_restarts`` allows."""


@ray.remote
class DataExecutorActor:
    """Reads whole splits (``read_split_whole``) for a remote driver."""

    def pid(self) -> int:
        return os.getpid()

    def read(self, reader: SplitReader) -> tuple[list[Block], int, int]:
        return read_split_whole(reader)


@dataclass(frozen=True)
class RayExecutors:
    """What rank 0 needs to run the job's data executors (picklable: it travels
    in the ``WorkerLaunch``); calling it starts them (a ``RayExecutorPool``).

    Args:
        count: E.
        resources: each executor's ask.
        group: the job's placement group.
        first_bundle: the bundle of executor 0 (executor e takes ``first + e``).
        max_restarts: executors that may be lost and replaced in one run.
        name: prefix of the executors' actor names (``NAME-e``).
    """

    count: int
    resources: RoleResources
    group: Any
    first_bundle: int
    max_restarts: int
    name: str

    def __call__(self) -> RayExecutorPool:
        return RayExecutorPool(self)


class RayExecutorPool:
    """E data executor actors behind the driver's ``SplitPool`` interface."""

    def __init__(self, spec: RayExecutors) -> None:
        self.spec = spec
        self.actors = [self._start(e) for e in range(spec.count)]
        self._idle: queue.Queue[int] = queue.Queue()
        for e in range(spec.count):
            self._idle.put(e)
        self._lock = threading.Lock()
        self.restarts: list[dict[str, Any]] = []

    def _start(self, executor: int) -> Any:
        res = self.spec.resources
        options: dict[str, Any] = {
            "num_cpus": res.cpus,
            "num_gpus": res.gpus,
            "name": f"{self.spec.name}-{executor}",
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.spec.group,
                placement_group_bundle_index=self.spec.first_bundle + executor,
            ),
        }
        if res.memory_mb is not None:
            options["memory"] = res.memory_mb * 2**20
        return DataExecutorActor.options(**options).remote()  # type: ignore[attr-defined]

    def read(self, reader: SplitReader) -> tuple[list[Block], int, int]:
        executor = self._idle.get()  # Blocking wait: an idle executor
        try:
            while True:
                actor = self.actors[executor]
                try:
                    # Blocking wait: the executor reads the whole split.
                    got: tuple[list[Block], int, int] = ray.get(actor.read.remote(reader))
                    return got
                except RayActorError as exc:
                    self._replace(executor, exc, reader)
        finally:
            self._idle.put(executor)

    def _replace(self, executor: int, exc: RayActorError, reader: SplitReader) -> None:
        with self._lock:
            if len(self.restarts) >= self.spec.max_restarts:
                raise DataExecutorLost(
                    f"data executor {executor} died reading split {reader.split.name} "
                    f"({_first_line(exc)}) after {len(self.restarts)} restart(s); "
                    f"runtime.max_restarts is {self.spec.max_restarts}"
                ) from exc
            self.restarts.append({"executor": executor, "split": reader.split.name})
            ray.kill(self.actors[executor], no_restart=True)
            self.actors[executor] = self._start(executor)

    def summary(self) -> dict[str, Any]:
        return {
            "data_executors": self.spec.count,
            "data_executor_restarts": len(self.restarts),
            "data_executor_restart_log": list(self.restarts),
        }

    def close(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except ValueError:  # not an actor handle any more
                continue


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
