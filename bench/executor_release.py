"""Benchmark: the reservation a data executor gives back when the scaling
manager replaces it (a memory change) or retires it (a shrink).

    python bench/executor_release.py [--executors 3] [--cpus 1] [--memory-mb 512]

On a fresh local Ray instance (8 logical CPUs): ``cluster.place`` reserves a PS
shard and a trainer (0.25 CPU each, one group) and ``--executors`` data
executors (one group each); the pool starts them. Then ``set_memory`` halves
their ask (every executor replaced beside the groups) and ``resize(1)`` retires
all but one. After each step it prints the cluster's free CPU and memory
(``ray.available_resources``, read 2 s after the step: the resource view
follows asynchronously). A released group shows as its CPU and memory back.
"""

from __future__ import annotations

import argparse
import logging
import time

import ray

from estuary.config.spec import RoleResources
from estuary.runtime.ray.cluster import RoleAsk, place
from estuary.runtime.ray.executors import RayExecutorPool, RayExecutors

SETTLE_S = 2.0


def free(step: str) -> None:
    time.sleep(SETTLE_S)  # the cluster's resource view follows asynchronously
    have = ray.available_resources()
    cpu, memory = have.get("CPU", 0.0), have.get("memory", 0.0) / 2**20
    print(f"{step:<44} free CPU {cpu:5.2f}  free memory {memory:8,.0f} MiB")


def wait_until(pool: RayExecutorPool, done: str) -> None:
    checks = {
        "swapped": lambda: pool.starting == 0 and len(pool.released) >= pool.spec.count,
        "one": lambda: pool.running == 1,
    }
    while not checks[done]():
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", type=int, default=3)
    parser.add_argument("--cpus", type=float, default=1.0)
    parser.add_argument("--memory-mb", type=int, default=512)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    try:
        free("empty cluster")
        small = RoleResources(cpus=0.25, gpus=0.0, memory_mb=None)
        executor = RoleResources(cpus=args.cpus, gpus=0.0, memory_mb=args.memory_mb)
        asks = [
            RoleAsk("ps", 1, small),
            RoleAsk("trainer", 1, small),
            RoleAsk("data_executor", args.executors, executor),
        ]
        placement = place(asks, timeout_s=60.0)
        spec = RayExecutors(
            count=args.executors,
            resources=executor,
            groups=placement.live_executor_groups(),
            max_restarts=0,
            name="estuary-bench-release",
            direct=False,
        )
        pool = spec()
        ray.get([h.pid.remote() for h in pool.actors.values()])  # Blocking wait: all up
        free(f"placed, {args.executors} executors up")
        pool.set_memory(args.memory_mb // 2)
        wait_until(pool, "swapped")
        free(f"set_memory({args.memory_mb // 2}), replacements up")
        pool.resize(1)
        wait_until(pool, "one")
        free("resize(1), retired executors stopped")
        pool.close()
        placement.remove()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
