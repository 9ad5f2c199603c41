"""The scaling manager's PS memory knob on Ray: the driver looks at every PS
shard (``ServerActor.table_stats``) each interval and caps a shard's rows
(``ServerActor.cap_rows``) before its memory crosses ``runtime.roles.ps.memory_mb``.

::

    driver (RayRuntime, while it watches the roles)
      thread "estuary-scaling": every interval_s
        ShardMetrics per shard <- ray.get(server.table_stats())
        EstuaryPolicy memory rule -> server.cap_rows(n)   (timeline: scaling_ps.json)

On only with ``runtime.scaling.enabled`` and a PS memory budget; the tables need
``eviction.capacity_rows`` (their recency is kept only then).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from estuary.config import JobSpec
from estuary.runtime.scaling.controller import Controller
from estuary.runtime.scaling.metrics import ShardMetrics, Snapshot
from estuary.runtime.scaling.policy import Bounds, Decision, EstuaryPolicy

__all__ = ["RayShards", "ps_memory_manager"]

STATS_TIMEOUT_S = 30.0


class RayShards:
    """The PS shards' metrics and memory knob (``shard_rows:P``)."""

    def __init__(self, servers: Sequence[Any], budget_bytes: int) -> None:
        self.servers = list(servers)
        self.budget_bytes = budget_bytes
        self._lookups = [0] * len(self.servers)
        self._t = 0.0

    def sample(self, t: float) -> Snapshot:
        stats = ray.get([s.table_stats.remote() for s in self.servers], timeout=STATS_TIMEOUT_S)
        dt, shards = t - self._t, []
        for p, tables in enumerate(stats):
            lookups = sum(v[2] for v in tables.values())
            caps = [v[3] for v in tables.values()]
            shards.append(
                ShardMetrics(
                    shard=p,
                    load=(lookups - self._lookups[p]) / dt if dt > 0 else 0.0,
                    rows=sum(v[0] for v in tables.values()),
                    memory_bytes=sum(v[1] for v in tables.values()),
                    budget_bytes=self.budget_bytes,
                    capacity_rows=None if None in caps else sum(c or 0 for c in caps),
                )
            )
            self._lookups[p] = lookups
        self._t = t
        # Only the shards are the driver's to see; the data side is rank 0's.
        return Snapshot(t, 0, None, 1.0, 0, 0.0, shards=tuple(shards))

    def apply(self, decision: Decision) -> str | None:
        kind, _, shard = decision.knob.partition(":")
        if kind == "shard_rows":
            ray.get(self.servers[int(shard)].cap_rows.remote(int(decision.new)))
            return None
        if kind == "hot_shard":
            return "reported only: moving id ranges between shards is not implemented"
        return f"knob {decision.knob!r} is not the PS shards'"


def ps_memory_manager(job: JobSpec, servers: Sequence[Any]) -> Controller | None:
    """A started controller over ``servers`` when ``runtime.scaling.enabled`` and
    the PS role has a memory budget; else ``None``."""
    spec, budget = job.runtime.scaling, job.runtime.ray.ps.memory_mb
    if not spec.enabled or budget is None:
        return None
    shards = RayShards(servers, budget * 2**20)
    return Controller(
        EstuaryPolicy(spec, Bounds()),
        shards.sample,
        shards,
        interval_s=spec.interval_s,
        hold_intervals=spec.hold_intervals,
        out=job.resolve(job.output.dir) if spec.timeline else None,
        name="scaling_ps",
    ).start()
