"""Interfaces of the simulator: what a scaling policy sees and what it returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Action", "Decision", "JobMetrics", "Policy", "Role"]


class Role(enum.Enum):
    """The roles a policy may resize."""

    TRAINER = "trainer"
    PS = "ps"
    EXECUTOR = "executor"


class Action(enum.Enum):
    """What a decision does to its role."""

    SET_COUNT = "set_count"  # horizontal: processes of the role
    SET_MEMORY = "set_memory"  # vertical: memory of each PS shard
    REBALANCE = "rebalance"  # move id ranges off a hot shard
    REPLACE_STRAGGLER = "replace_straggler"  # restart the slow trainer elsewhere


@dataclass(frozen=True)
class Decision:
    """One change to one job, and the metric that triggered it.

    Args:
        job: the job's id.
        role: the role it changes.
        action: what it does.
        value: the new count (``SET_COUNT``) or bytes per shard (``SET_MEMORY``).
        reason: the metric and threshold that triggered it, for the timeline.
    """

    job: int
    role: Role
    action: Action
    value: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class JobMetrics:
    """What a running job reports over the last interval (the live metrics a
    controller scrapes: Prometheus gauges in a real run).

    Args:
        job: the job's id.
        time_s: simulated time of the report.
        rows_per_s: training rows per second.
        trainers, ps_shards, executors: current counts.
        trainer_wait_frac: fraction of trainer time spent waiting for data.
        executor_queue: batches waiting between executors and trainers (0..capacity).
        executor_rows_per_s: rows/s one executor delivers when not blocked.
        cpu_busy: role name -> fraction of the role's cores in use.
        ps_load_max_over_mean: the busiest shard's load over the mean shard's.
        ps_memory_bytes: bytes of the fullest shard.
        ps_memory_budget_bytes: memory of each shard.
        ps_memory_growth_bytes_per_s: the fullest shard's growth over the interval.
        trainer_step_max_over_median: the slowest trainer's step time over the median.
        oom_count: PS shards killed for memory so far.
        free_cores: cores free in the cluster.
        free_memory_bytes: memory free in the cluster.
    """

    job: int
    time_s: float
    rows_per_s: float
    trainers: int
    ps_shards: int
    executors: int
    trainer_wait_frac: float
    executor_queue: float
    executor_rows_per_s: float
    cpu_busy: dict[str, float]
    ps_load_max_over_mean: float
    ps_memory_bytes: float
    ps_memory_budget_bytes: float
    ps_memory_growth_bytes_per_s: float
    trainer_step_max_over_median: float
    oom_count: int
    free_cores: float
    free_memory_bytes: float
    extra: dict[str, float] = field(default_factory=dict)


class Policy(Protocol):
    """Decides; the simulator (one controller) acts.

    ``interval_s``: seconds between ``decide`` calls for a running job.
    ``on_oom``: the shard memory (bytes) a job restarts with after an OOM kill.
    """

    name: str
    interval_s: float

    def decide(self, metrics: JobMetrics) -> list[Decision]:
        """Decisions for one job from its latest metrics (may be empty)."""
        ...

    def on_oom(self, metrics: JobMetrics) -> list[Decision]:
        """Decisions applied with the restart that follows an OOM kill."""
        ...
