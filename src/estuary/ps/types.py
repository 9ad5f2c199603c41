"""Settings and errors of the parameter server.

Shapes: ``N`` ids in a call, ``D`` a table's dim, ``W`` trainers (ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from estuary.config.spec import TableSpec
from estuary.embedding.compaction import COMPACT_BELOW, check_below

# Where a server listens: an AF_UNIX socket path or a TCP (host, port).
Address = str | tuple[str, int]


@dataclass(frozen=True)
class HostedTable:
    """One table a server hosts.

    Args:
        spec: table settings (dim, optimizer, shards, ...).
        seed: the table's seed; an id's initial row depends only on (seed, name, id),
            so the same (spec, seed) gives the same rows in any process.
    """

    spec: TableSpec
    seed: int


@dataclass(frozen=True)
class ServerConfig:
    """What a ``ParameterServer`` hosts and how it aggregates.

    Args:
        tables: table name -> its spec and seed.
        world_size: W, the trainers that push every step. Step t is applied (once)
            when all W ranks have pushed it.
        staleness: a train lookup tagged with step s waits until step
            ``s - 1 - staleness`` has been applied; 0 = sync (every lookup sees
            every earlier step), ``None`` = no bound (async).
        wait_timeout_s: longest a request waits for a step to be applied before it
            fails with a ``PSTimeoutError`` naming the ranks that have not pushed.
        max_pending_steps: pushes may run at most this many steps ahead of the last
            applied step (bounds the memory of buffered gradients).
        compact_below: after ``drop_ids`` (the rows a migration moved away), a
            table shard with fewer than this share of its allocated rows in use
            is compacted: its arrays shrink to the rows left
            (``estuary.embedding.compaction``). In [0, 1]; 0 = never.
    """

    tables: dict[str, HostedTable] = field(default_factory=dict)
    world_size: int = 1
    staleness: int | None = 0
    wait_timeout_s: float = 300.0
    max_pending_steps: int = 64
    compact_below: float = COMPACT_BELOW

    def validate(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.staleness is not None and self.staleness < 0:
            raise ValueError(f"staleness must be >= 0 or None, got {self.staleness}")
        if self.wait_timeout_s <= 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s}")
        if self.max_pending_steps < 1:
            raise ValueError(f"max_pending_steps must be >= 1, got {self.max_pending_steps}")
        check_below(self.compact_below, "compact_below")


class PSError(RuntimeError):
    """The parameter server refused or failed a request; the message names the
    operation and the table."""


class PSTimeoutError(PSError):
    """A wait at the server (a step not applied in time), or a reply from it, took
    longer than its timeout."""


class PSConnectionError(PSError):
    """The parameter server cannot be reached or closed the connection."""


class ProtocolError(PSError):
    """A message broke the wire format (bad header, dtype, shape or size)."""
