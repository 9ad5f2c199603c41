"""Which parameter server owns an id: a versioned slot map.

::

    slot   = splitmix64(id ^ SERVER_SALT) mod S        S: owners' size
    server = owners[slot]                              owners: int64 (S,)

The even map of P servers has ``S = P x SLOTS_PER_SERVER`` and ``owners[s] =
s mod P``; as P divides S, ``slot mod P == splitmix64(id ^ SERVER_SALT) mod P``,
so it routes every id exactly as plain ``hash mod P`` did (version 0: what a run
without migrations uses). A migration (``estuary.ps.migration``) hands some
slots to another server and bumps ``version``; every client and server holds
the same map between steps.

A map may be refined (``refined``, ``estuary.ps.migration``): S grows F-fold
and slot s splits into s, s + S, ..., s + (F - 1) S, all owned by s's owner.
As ``(h mod FS) mod S == h mod S``, every id keeps its server: no row moves,
but a hot slot's ids spread over F slots that can then move apart (the
hot-shard rebalance). S stays at most ``MAX_SLOTS_PER_SERVER`` x P.

A non-even map is recorded in table states under ``routing.owners`` and
``routing.version``, ``routing.servers`` so a resumed run with as many servers
routes as the saved one; the rows themselves load under any map (a load routes
them by id), and a run with another server count starts from its even map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from estuary.embedding.delta import ROUTING_PREFIX
from estuary.embedding.hashing import SERVER_SALT, as_ids, route_owned, shard_of
from estuary.embedding.types import Int64Array

__all__ = [
    "MAX_SLOTS_PER_SERVER",
    "OWNERS_KEY",
    "ROUTING_PREFIX",
    "SERVERS_KEY",
    "SLOTS_PER_SERVER",
    "VERSION_KEY",
    "SlotMap",
]

SLOTS_PER_SERVER = 1024
MAX_SLOTS_PER_SERVER = 16 * SLOTS_PER_SERVER  # refined maps stop here (owners: 128 KiB a server)
OWNERS_KEY = "routing.owners"
VERSION_KEY = "routing.version"
SERVERS_KEY = "routing.servers"


class SlotMap:
    """A versioned slot -> server map over ``servers`` servers.

    Args:
        owners: int64 (S,), each in ``[0, servers)``.
        servers: P (a server may own no slot: one being retired or just added).
        version: 0 for the even map; each migration adds 1.
    """

    def __init__(self, owners: Sequence[int] | Int64Array, servers: int, version: int = 0) -> None:
        self.owners = np.ascontiguousarray(owners, dtype=np.int64)
        self.owners.setflags(write=False)
        if self.owners.ndim != 1 or self.owners.size == 0:
            raise ValueError(f"slot map: owners must be a non-empty 1-D array, got {owners!r}")
        if servers < 1 or int(self.owners.min()) < 0 or int(self.owners.max()) >= servers:
            raise ValueError(
                f"slot map: owners must lie in [0, {servers}), got "
                f"[{int(self.owners.min())}, {int(self.owners.max())}]"
            )
        self.servers = servers
        self.version = version

    @classmethod
    def even(cls, servers: int, slots_per_server: int = SLOTS_PER_SERVER) -> SlotMap:
        """Version 0: slot s on server ``s mod servers`` (= ``hash mod servers``)."""
        return cls(np.arange(servers * slots_per_server, dtype=np.int64) % servers, servers)

    def __repr__(self) -> str:
        return f"SlotMap(slots={self.slots}, servers={self.servers}, version={self.version})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SlotMap)
            and self.servers == other.servers
            and self.version == other.version
            and np.array_equal(self.owners, other.owners)
        )

    @property
    def slots(self) -> int:
        """S."""
        return int(self.owners.size)

    def slot_of(self, ids: Int64Array) -> Int64Array:
        """The slot of each id, int64 (N,)."""
        return shard_of(as_ids(ids), self.slots, salt=SERVER_SALT)

    def server_of(self, ids: Int64Array) -> Int64Array:
        """The server of each id, int64 (N,)."""
        return self.owners[self.slot_of(ids)]

    def route(self, ids: Int64Array) -> tuple[Int64Array, Int64Array]:
        """Ids grouped by server: ``order`` int64 (N,), ``offsets`` int64 (P + 1,)
        (as ``estuary.embedding.hashing.route``)."""
        return route_owned(as_ids(ids), self.owners, self.servers, salt=SERVER_SALT)

    def owned(self, server: int) -> Int64Array:
        """The slots ``server`` owns, int64 ascending."""
        return np.flatnonzero(self.owners == server).astype(np.int64)

    def counts(self) -> Int64Array:
        """Slots per server, int64 (P,)."""
        return np.bincount(self.owners, minlength=self.servers).astype(np.int64)

    def moved(
        self, slots: Sequence[int] | Int64Array, to: int, *, servers: int | None = None
    ) -> SlotMap:
        """The next version: ``slots`` owned by server ``to`` (``servers``: a new
        server count, e.g. one more for a split)."""
        picked = np.asarray(slots, np.int64)
        if picked.size and (int(picked.min()) < 0 or int(picked.max()) >= self.slots):
            raise ValueError(f"slot map: slots must lie in [0, {self.slots})")
        owners = self.owners.copy()
        owners[picked] = to
        return SlotMap(owners, self.servers if servers is None else servers, self.version + 1)

    def refined(self, factor: int) -> SlotMap:
        """The next version over ``factor`` x S slots: slot s becomes s, s + S, ...,
        s + (factor - 1) S, each with s's owner, so every id stays on its server
        (see the module docstring)."""
        if factor < 2:
            raise ValueError(f"slot map: a refinement needs a factor >= 2, got {factor}")
        if self.slots * factor > MAX_SLOTS_PER_SERVER * self.servers:
            raise ValueError(
                f"slot map: {self.slots} x {factor} slots passes the most a map of "
                f"{self.servers} server(s) may have ({MAX_SLOTS_PER_SERVER} a server)"
            )
        return SlotMap(np.tile(self.owners, factor), self.servers, self.version + 1)

    def retired(self, server: int) -> SlotMap:
        """The same version without ``server`` (which must own no slot): the
        servers after it move down one place."""
        if not 0 <= server < self.servers or self.servers == 1:
            raise ValueError(f"slot map: cannot retire server {server} of {self.servers}")
        if (self.owners == server).any():
            raise ValueError(f"slot map: server {server} still owns slots; move them first")
        owners = np.where(self.owners > server, self.owners - 1, self.owners)
        return SlotMap(owners, self.servers - 1, self.version)

    def state(self) -> dict[str, np.ndarray]:
        """The map as state keys (``routing.owners``, ``.version``, ``.servers``)."""
        return {
            OWNERS_KEY: self.owners.copy(),
            VERSION_KEY: np.array([self.version], np.int64),
            SERVERS_KEY: np.array([self.servers], np.int64),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], servers: int) -> SlotMap | None:
        """The map saved in ``state`` if it was for ``servers`` servers; ``None``
        when there is none or it was for another count (a run resumed with
        another server count routes by its even map)."""
        if OWNERS_KEY not in state or SERVERS_KEY not in state:
            return None
        if int(np.asarray(state[SERVERS_KEY])[0]) != servers:
            return None
        version = int(np.asarray(state[VERSION_KEY])[0]) if VERSION_KEY in state else 1
        return cls(np.asarray(state[OWNERS_KEY], np.int64), servers, version)
