"""The scaling manager over a resizable data executor pool (on Ray:
``RayExecutorPool``), where the pool lives: rank 0, beside its driver.

::

    rank 0 training thread: for step in PoolScaling.wrap(driver.steps(W)):
                               ^ times each wait for the next step (WaitClock)
    thread "estuary-scaling":  every interval: Snapshot(trainer wait, executors
                               busy, readers waiting, rows/s, executor memory)
                               -> policy -> resize / threads / memory ask

The manager starts with the first step and stops (writing ``scaling.json`` and
``scaling.png``) when the steps end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from estuary.config import JobSpec
from estuary.config.scaling import ScalingSpec
from estuary.runtime.scaling.controller import Controller
from estuary.runtime.scaling.metrics import BusyClock, ExecutorMemory, Snapshot, WaitClock
from estuary.runtime.scaling.policy import Bounds, Decision, EstuaryPolicy, Policy

__all__ = ["PoolScaling", "ResizablePool", "scaled_steps"]

_T = TypeVar("_T")


@runtime_checkable
class ResizablePool(Protocol):
    clock: BusyClock
    threads: int

    @property
    def count(self) -> int: ...

    @property
    def starting(self) -> int: ...

    def resize(self, count: int) -> None: ...

    def set_threads(self, threads: int) -> None: ...

    def set_memory(self, memory_mb: int) -> None: ...

    def memory_usage(self) -> ExecutorMemory | None: ...


class PoolScaling:
    """Runs ``policy`` (default ``EstuaryPolicy``) over ``pool`` and the consumer
    of the steps ``wrap`` yields.

    Args:
        pool: the executors.
        spec: ``runtime.scaling``.
        bounds: executor min/max, threads max.
        out: folder for the timeline; ``None``: none written.
        policy: the policy (``bench/elastic.py`` passes ``DLRoverRules``).

    The trainer's CPU use is its busy fraction (1 - wait); with the tables in
    the trainer's process (one shard) that is also the PS's (``cpu["ps"]``).
    """

    def __init__(
        self,
        pool: ResizablePool,
        spec: ScalingSpec,
        bounds: Bounds,
        *,
        out: Path | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.pool = pool
        self.wait = WaitClock()
        self._last = (0.0, 0.0, 0, 0.0, 0.0)  # elapsed, waited, rows, busy, capacity
        self._last_cpu = (0.0, 0.0)  # executor CPU seconds, their reads' wall seconds
        self.controller = Controller(
            policy if policy is not None else EstuaryPolicy(spec, bounds),
            self.sample,
            self,
            interval_s=spec.interval_s,
            hold_intervals=spec.hold_intervals,
            out=out,
        )

    def sample(self, t: float) -> Snapshot:
        elapsed, waited, rows = self.wait.read()
        busy, capacity = self.pool.clock.read()
        cpu, cpu_wall = self.pool.clock.cpu()
        e0, w0, r0, b0, c0 = self._last
        self._last = (elapsed, waited, rows, busy, capacity)
        (u0, uw0), self._last_cpu = self._last_cpu, (cpu, cpu_wall)
        dt = max(elapsed - e0, 1e-9)
        wait = min(1.0, max(0.0, (waited - w0) / dt))
        slots = capacity - c0
        return Snapshot(
            t=t,
            executors=self.pool.count,
            trainer_wait=wait,
            executor_busy=min(1.0, (busy - b0) / slots) if slots > 0 else 0.0,
            queue_depth=self.pool.clock.waiting,
            rows_per_s=(rows - r0) / dt,
            executor_threads=self.pool.threads,
            executors_starting=self.pool.starting,
            cpu={"trainer": 1.0 - wait, "ps": 1.0 - wait},
            executor_memory=self.pool.memory_usage(),
            executor_cpu=(cpu - u0) / (cpu_wall - uw0) if cpu_wall > uw0 else None,
        )

    def apply(self, decision: Decision) -> str | None:
        if decision.knob == "executors":
            self.pool.resize(int(decision.new))
            return None
        if decision.knob == "executor_threads":
            self.pool.set_threads(int(decision.new))
            return None
        if decision.knob == "executor_memory":
            self.pool.set_memory(int(decision.new))
            return None
        return f"knob {decision.knob!r} is not the executor pool's"

    def wrap(self, steps: Iterator[_T], rows_of: Callable[[_T], int]) -> Iterator[_T]:
        """``steps``, timed; the manager runs while they last."""
        self._last = (*self.wait.read(), *self.pool.clock.read())  # the first interval's start
        self._last_cpu = self.pool.clock.cpu()
        self.controller.start()
        try:
            for step in self.wait.wrap(steps):
                self.wait.add_rows(rows_of(step))
                yield step
        finally:
            self.controller.close()


def scaled_steps(
    job: JobSpec, pool: object, steps: Iterator[_T], rows_of: Callable[[_T], int]
) -> Iterator[_T]:
    """``steps`` under the scaling manager when ``runtime.scaling.enabled`` and
    ``pool`` resizes (Ray data executors); else ``steps`` as they are. Executor
    bounds: ``runtime.roles.data_executor.min``/``max``, memory ask at least
    ``memory_mb``; reads in flight: the
    driver's ``data.dataset.executor.workers``; the timeline goes to the run
    folder."""
    spec = job.runtime.scaling
    if not spec.enabled or not isinstance(pool, ResizablePool):
        return steps
    role = job.runtime.resolved_roles()["data_executor"]
    dataset = job.data.dataset
    bounds = Bounds(
        min_executors=max(1, role.min),
        max_executors=max(1, role.max),
        max_threads=spec.max_executor_threads,
        max_reads=dataset.executor.workers if dataset is not None else None,
        # A raised memory ask is lowered again, never below the job's own.
        min_executor_memory_mb=job.runtime.ray.data_executor.memory_mb,
    )
    out = job.resolve(job.output.dir) if spec.timeline else None
    return PoolScaling(pool, spec, bounds, out=out).wrap(steps, rows_of)
