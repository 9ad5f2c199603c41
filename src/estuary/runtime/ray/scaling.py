"""The scaling manager's PS knobs on Ray: the driver looks at every PS shard
(``ServerActor.table_stats``) each interval, caps a shard's rows
(``ServerActor.cap_rows``) before its memory crosses
``runtime.roles.ps.memory_mb``, and rebalances a hot shard by moving its
hottest slots to the coldest shard (``estuary.ps.migration``) between two steps
while the trainers run.

::

    driver (RayRuntime, while it watches the roles)
      thread "estuary-scaling": every interval_s
        ShardMetrics per shard <- ray.get(server.table_stats())
        EstuaryPolicy
          memory rule -> server.cap_rows(n)
          hot shard   -> per-slot loads of the hot shard (slot_loads op)
                         -> plan_moves -> ShardedPSClient.migrate(slots, coldest)
        timeline: scaling_ps.json (each migration: slots, rows, pause_ms; its
                  effect: the hot shard's load share before and after)

On with ``runtime.scaling.enabled`` and either a PS memory budget (the memory
knob; tables need ``eviction.capacity_rows``) or two or more PS shards (the
hot-shard rebalance).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from estuary.config import JobSpec
from estuary.ps.sharded import ShardedPSClient
from estuary.runtime.ray.plane import ActorPSClient
from estuary.runtime.scaling.controller import Controller
from estuary.runtime.scaling.metrics import ShardMetrics, Snapshot
from estuary.runtime.scaling.policy import Bounds, Decision, EstuaryPolicy
from estuary.runtime.scaling.rebalance import plan_moves

__all__ = ["RayShards", "ps_scaling_manager"]

STATS_TIMEOUT_S = 30.0
logger = logging.getLogger(__name__)


class RayShards:
    """The PS shards' metrics, memory knob (``shard_rows:P``) and hot-shard
    rebalance (``hot_shard:P``).

    Args:
        servers: the ``ServerActor`` handles, in server order.
        budget_bytes: each shard's memory budget (``None``: none).
        client: a client of the servers for migrations (default: one over the
            actor data plane, ``ActorPSClient``).
    """

    def __init__(
        self,
        servers: Sequence[Any],
        budget_bytes: int | None,
        *,
        client: ShardedPSClient | None = None,
    ) -> None:
        self.servers = list(servers)
        self.budget_bytes = budget_bytes
        self._lookups = [0] * len(self.servers)
        self._loads = [0.0] * len(self.servers)
        self._t = 0.0
        self.client: ShardedPSClient | None = client
        if self.client is None and len(self.servers) > 1:
            self.client = ShardedPSClient([ActorPSClient(s) for s in self.servers])
        if self.client is not None:
            self.client.refresh_routing()
            slots = self.client.slot_map.slots
            self.client.each(lambda p: self._conn(p).call("slot_loads", {"count": slots}))
        self.last_detail: dict[str, Any] | None = None
        self.migrations: list[dict[str, Any]] = []

    def _conn(self, p: int) -> Any:
        assert self.client is not None
        return self.client.clients[p]

    def sample(self, t: float) -> Snapshot:
        stats = ray.get([s.table_stats.remote() for s in self.servers], timeout=STATS_TIMEOUT_S)
        dt, shards = t - self._t, []
        for p, tables in enumerate(stats):
            lookups = sum(v[2] for v in tables.values())
            caps = [v[3] for v in tables.values()]
            load = (lookups - self._lookups[p]) / dt if dt > 0 else 0.0
            shards.append(
                ShardMetrics(
                    shard=p,
                    load=load,
                    rows=sum(v[0] for v in tables.values()),
                    memory_bytes=sum(v[1] for v in tables.values()),
                    budget_bytes=self.budget_bytes,
                    capacity_rows=None if None in caps else sum(c or 0 for c in caps),
                )
            )
            self._lookups[p] = lookups
            self._loads[p] = load
        self._t = t
        # Only the shards are the driver's to see; the data side is rank 0's.
        return Snapshot(t, 0, None, 1.0, 0, 0.0, shards=tuple(shards))

    def apply(self, decision: Decision) -> str | None:
        self.last_detail = None
        kind, _, shard = decision.knob.partition(":")
        if kind == "shard_rows":
            ray.get(self.servers[int(shard)].cap_rows.remote(int(decision.new)))
            return None
        if kind == "hot_shard":
            return self._rebalance(int(shard))
        return f"knob {decision.knob!r} is not the PS shards'"

    def _rebalance(self, hot: int) -> str | None:
        """Move the hot shard's hottest slots to the coldest shard."""
        if self.client is None:
            return "one PS shard: nowhere to move slots to"
        cold = min((p for p in range(len(self.servers)) if p != hot), key=self._loads.__getitem__)
        slot_map = self.client.refresh_routing()
        loads = np.zeros(slot_map.slots, np.int64)
        for p in range(len(self.servers)):  # every server's counts since the last move
            _, arrays = self._conn(p).call("slot_loads")
            if "loads" in arrays:
                loads += arrays["loads"]
        moves = plan_moves(loads, slot_map.owners, hot, cold)
        if moves.slots.size == 0:
            return (
                f"no slot of shard {hot} fits the move to shard {cold}: one slot carries "
                "more than the move that evens them (a single hot id)"
            )
        migration = self.client.migrate(moves.slots, cold)
        self.last_detail = {
            "migration": {
                **migration.as_dict(),
                "planned_share": round(moves.share, 4),
                "hot_load": moves.hot_load,
                "cold_load": moves.cold_load,
            }
        }
        self.migrations.append(self.last_detail["migration"])
        logger.info(
            "scaling: moved %d slots (%d rows) from PS shard %d to %d; pause %.1f ms",
            migration.slots,
            migration.rows,
            hot,
            cold,
            migration.pause_ms,
        )
        return None


def ps_scaling_manager(job: JobSpec, servers: Sequence[Any]) -> Controller | None:
    """A started controller over ``servers`` when ``runtime.scaling.enabled`` and
    the PS role has a memory budget or there are two or more shards; else ``None``."""
    spec, budget = job.runtime.scaling, job.runtime.ray.ps.memory_mb
    if not spec.enabled or (budget is None and len(servers) < 2):
        return None
    shards = RayShards(servers, None if budget is None else budget * 2**20)
    return Controller(
        EstuaryPolicy(spec, Bounds()),
        shards.sample,
        shards,
        interval_s=spec.interval_s,
        hold_intervals=spec.hold_intervals,
        out=job.resolve(job.output.dir) if spec.timeline else None,
        name="scaling_ps",
    ).start()
