"""``PoolScaling`` binds the policy to a resizable pool (here a stand-in with the
pool's interface; the Ray pool itself is tested in tests/cluster)."""

from __future__ import annotations

from estuary.config import job_from_dict
from estuary.config.scaling import ScalingSpec
from estuary.runtime.scaling import Bounds, BusyClock, Decision, ExecutorMemory
from estuary.runtime.scaling.pool import PoolScaling, ResizablePool, scaled_steps

DATA = {"sources": [{"path": "x.tsv"}], "schema": {"sparse": ["C1"], "dense": ["I1"]}}


class StandInPool:
    def __init__(self) -> None:
        self.clock = BusyClock()
        self.threads = 1
        self.sizes = [1]
        self.memory_mb: int | None = None

    @property
    def count(self) -> int:
        return self.sizes[-1]

    @property
    def starting(self) -> int:
        return 0

    def resize(self, count: int) -> None:
        self.sizes.append(count)

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def set_memory(self, memory_mb: int) -> None:
        self.memory_mb = memory_mb

    def memory_usage(self) -> ExecutorMemory | None:
        return ExecutorMemory(1, 2, None if self.memory_mb is None else self.memory_mb * 2**20)


def test_decisions_reach_the_pool_and_foreign_knobs_are_refused() -> None:
    pool = StandInPool()
    assert isinstance(pool, ResizablePool)
    scaling = PoolScaling(pool, ScalingSpec(enabled=True), Bounds(1, 8, 2))
    assert scaling.apply(Decision("executors", 1, 5, "t")) is None
    assert scaling.apply(Decision("executor_threads", 1, 2, "t")) is None
    assert scaling.apply(Decision("executor_memory", 100, 150, "t")) is None
    assert (pool.sizes, pool.threads, pool.memory_mb) == ([1, 5], 2, 150)
    assert scaling.apply(Decision("shard_rows:0", 10, 5, "t")) is not None
    snapshot = scaling.sample(1.0)
    assert (snapshot.executors, snapshot.executor_threads) == (5, 2)
    assert snapshot.executor_memory == ExecutorMemory(1, 2, 150 * 2**20)
    assert 0.0 <= snapshot.trainer_wait <= 1.0  # type: ignore[operator]


def test_steps_pass_through_untouched_when_scaling_is_off() -> None:
    job = job_from_dict({"data": DATA})
    steps = iter([1, 2, 3])
    assert scaled_steps(job, StandInPool(), steps, lambda s: s) is steps
    on = job_from_dict({"data": DATA, "runtime": {"backend": "ray", "scaling": {"enabled": True}}})
    plain = iter([1, 2])
    assert scaled_steps(on, object(), plain, lambda s: s) is plain  # not a resizable pool


def test_a_wait_in_progress_counts_when_read() -> None:
    import threading
    import time
    from collections.abc import Iterator

    from estuary.runtime.scaling import WaitClock

    clock, release = WaitClock(), threading.Event()

    def slow() -> Iterator[int]:
        release.wait()
        yield 1

    steps = clock.wrap(slow())
    worker = threading.Thread(target=lambda: next(steps))
    worker.start()
    time.sleep(0.05)
    _, waiting, _ = clock.read()  # the consumer is still blocked in next()
    release.set()
    worker.join()
    assert 0.0 < waiting <= clock.read()[1]


def test_the_snapshot_carries_the_cpu_per_second_of_the_reads_done_in_its_interval() -> None:
    pool = StandInPool()
    scaling = PoolScaling(pool, ScalingSpec(enabled=True), Bounds(1, 8, 2))
    assert scaling.sample(1.0).executor_cpu is None  # no read done yet
    clock = pool.clock
    for cpu_s in (0.001, None):  # a warm-up read reports no CPU: not counted
        clock.stop(clock.start(), cpu_s)
    cpu, wall = clock.cpu()
    assert cpu == 0.001 and wall > 0
    assert scaling.sample(2.0).executor_cpu == cpu / wall
    assert scaling.sample(3.0).executor_cpu is None  # the next interval: none done
