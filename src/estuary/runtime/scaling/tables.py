"""PS shards held as in-process tables: their metrics (load, rows, memory
against a budget) and the memory knob (``shard_rows:P``: cap a shard's rows).

A shard here is one ``EmbeddingTable`` (what one PS process holds of a table).
Hot shards are reported, not moved: these tables share one process and have no
slot map; the Ray runtime's PS shards move a hot shard's slots
(``estuary.runtime.ray.scaling``).
"""

from __future__ import annotations

from collections.abc import Sequence

from estuary.embedding.table import EmbeddingTable
from estuary.runtime.scaling.metrics import ShardMetrics
from estuary.runtime.scaling.policy import Decision

__all__ = ["TableShards"]


class TableShards:
    """Shard p = ``tables[p]``, each with ``budget_bytes`` of memory (``None``: none)."""

    def __init__(self, tables: Sequence[EmbeddingTable], budget_bytes: int | None) -> None:
        self.tables = list(tables)
        self.budget_bytes = budget_bytes
        self._lookups = [0] * len(self.tables)
        self._t = 0.0

    def metrics(self, t: float) -> tuple[ShardMetrics, ...]:
        """Every shard now; loads are ids looked up per second since the last call."""
        dt = t - self._t
        out = []
        for p, table in enumerate(self.tables):
            stats = table.stats()
            load = (stats.lookups - self._lookups[p]) / dt if dt > 0 else 0.0
            self._lookups[p] = stats.lookups
            out.append(
                ShardMetrics(
                    shard=p,
                    load=load,
                    rows=stats.rows,
                    memory_bytes=stats.bytes,
                    budget_bytes=self.budget_bytes,
                    capacity_rows=table.capacity_rows,
                )
            )
        self._t = t
        return tuple(out)

    def apply(self, decision: Decision) -> str | None:
        kind, _, shard = decision.knob.partition(":")
        if kind == "shard_rows":
            self.tables[int(shard)].cap_rows(int(decision.new))
            return None
        if kind == "hot_shard":
            return "reported only: in-process tables have no servers to move slots between"
        return f"knob {decision.knob!r} is not a table's"
