"""``runtime.scaling``: the scaling manager's settings (``estuary.runtime.scaling``).

Off by default. When on, a controller on rank 0 looks at the job's metrics every
``interval_s`` and resizes what it may while the job runs: the data executors
(between ``runtime.roles.data_executor.min`` and ``max``), an executor's threads
and memory ask, and a PS shard's memory (by tightening its row capacity before
the budget is crossed, or by adding a PS shard when ``runtime.roles.ps.max``
allows one). A decision is never reversed within ``hold_intervals`` intervals.
"""

from __future__ import annotations

from dataclasses import dataclass

from estuary.config.errors import ConfigError

__all__ = ["ScalingSpec"]


@dataclass(frozen=True)
class ScalingSpec:
    """The scaling manager.

    Args:
        enabled: run the manager.
        interval_s: seconds between two looks at the metrics (one interval).
        hold_intervals: a decision is not reversed (the same knob moved back the
            other way) within this many intervals (no flapping).
        wait_high: trainer data wait (fraction of its time) above which the data
            side is the bottleneck: executors are added.
        idle_high: executor idle fraction above which, with the trainers not
            waiting, executors are removed.
        headroom: executors are sized to this multiple of the measured demand.
        memory_horizon_s: act on a PS shard whose memory is forecast to cross its
            budget within this many seconds.
        memory_target: a memory action brings the shard back to this fraction of
            its budget.
        hot_ratio: a PS shard with this multiple of the mean shard load is hot.
        merge_below: with ``runtime.roles.ps.max`` above the shard count (shards
            may be added), two shards whose memory together is forecast below
            this fraction of one shard's budget, the retired one no hotter than
            the mean, are merged (down to ``runtime.roles.ps.min``).
        max_executor_threads: most concurrent reads per data executor (vertical
            scaling: raised before executors are added while the reads wait on
            the source more than they compute, since a read slot costs no
            process start-up; also once the executors are at
            ``runtime.roles.data_executor.max``); 1: off. Never raised past what
            the executors' memory budget holds.
        bridge_reads: most splits one running data executor reads at once, on
            top of its own, in place of executors still starting (the start-up
            bridge: the reads in flight reach a scale-up's count at once, not
            after a process start-up); each is handed back once its executor is
            up. 0: off.
        max_executor_memory_mb: the most the manager may raise each data
            executor's memory ask to (``runtime.roles.data_executor.memory_mb``,
            the budget) when one executor's peak crosses ``memory_target`` of it
            at one read at a time; ``None``: the ask is never raised (the
            manager still lowers an executor's concurrent reads to fit).
        compact_below: after a migration moves rows off a PS shard (a split, a
            hot-shard move), each table shard left holding fewer than this
            fraction of its allocated rows is compacted: rows packed, arrays cut,
            the memory given back (``EmbeddingShard.compact``). 0: never.
        timeline: write ``scaling.json`` (every decision, its trigger and its
            measured effect) and ``scaling.png`` to the run folder.
    """

    enabled: bool = False
    interval_s: float = 5.0
    hold_intervals: int = 2
    wait_high: float = 0.2
    idle_high: float = 0.4
    headroom: float = 1.15
    memory_horizon_s: float = 30.0
    memory_target: float = 0.8
    hot_ratio: float = 2.0
    merge_below: float = 0.3
    max_executor_threads: int = 1
    bridge_reads: int = 4
    max_executor_memory_mb: int | None = None
    compact_below: float = 0.75  # estuary.embedding.compaction.COMPACT_BELOW (tested equal)
    timeline: bool = True

    def validate(self, path: str) -> None:
        if self.interval_s <= 0:
            raise ConfigError(f"{path}.interval_s", "must be > 0")
        if self.hold_intervals < 0:
            raise ConfigError(f"{path}.hold_intervals", "must be >= 0")
        for name in ("wait_high", "idle_high", "memory_target", "merge_below"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ConfigError(f"{path}.{name}", f"must be in (0, 1), got {value}")
        if self.headroom < 1.0:
            raise ConfigError(f"{path}.headroom", f"must be >= 1, got {self.headroom}")
        if self.memory_horizon_s <= 0:
            raise ConfigError(f"{path}.memory_horizon_s", "must be > 0")
        if self.max_executor_threads < 1:
            raise ConfigError(f"{path}.max_executor_threads", "must be >= 1")
        if self.bridge_reads < 0:
            raise ConfigError(f"{path}.bridge_reads", f"must be >= 0, got {self.bridge_reads}")
        if self.max_executor_memory_mb is not None and self.max_executor_memory_mb < 1:
            raise ConfigError(f"{path}.max_executor_memory_mb", "must be >= 1")
        if not 0.0 <= self.compact_below <= 1.0:
            raise ConfigError(
                f"{path}.compact_below", f"must be in [0, 1] (0: never), got {self.compact_below}"
            )
        if self.hot_ratio <= 1.0:
            raise ConfigError(f"{path}.hot_ratio", f"must be > 1, got {self.hot_ratio}")
