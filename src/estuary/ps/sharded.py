"""Tables split across N parameter-server processes: ``ShardedPSClient`` and
``ShardedTable`` (``runtime.ps_shards``).

Shapes: ``N`` ids in a call, ``D`` a table's dim, ``P`` servers, ``S`` slots.

::

    trainer                                   server p (of P), every table
      ShardedTable.lookup(ids, step s)          hosts the ids whose slot it owns:
        slot_map.route(ids)                     slot = splitmix64(id ^ SERVER_SALT) mod S
        server p: lookup_many(part p, step s,   owners[slot] == p   (estuary.ps.slots)
                  map version v)                (each its own staleness barrier,
        ... all P at once (threads) ...          step aggregation and delta chain)
        rows scattered back in call order

The slot map starts even (version 0: exactly ``hash mod P``); a migration
(``estuary.ps.migration``, ``ShardedPSClient.migrate``) moves slots between
servers between two steps and bumps the version; ``add_server`` and
``retire_server`` also add a server to the job or take one out (split, merge).
Every request carries the client's map version; a lookup refused as stale
fetches the servers' map (and, after a split or merge, connects to or drops
servers: ``adopt``) and is routed again (same step).

Every step goes to every server, with no ids where a server owns none of the
batch, so each server's step counters, staleness barrier and exactly-once
aggregation are those of one server: a step is applied once per server when all
W ranks have pushed it there. Rows, optimizer state, admission and eviction of
an id live on one server, so results are those of one server holding the table
(capacity is split evenly: each server keeps ``ceil(capacity_rows / P)``).

State dicts merge the servers' parts (``merge_states``: a table of ``P x
shards`` shards); they load into any server or shard count, and any state loads
here (``split_for_servers``, routed by the client's map). A migrated map is
saved with the state (``routing.*`` keys) and adopted by a load with as many
servers. The servers advance their delta chains together (every mark goes to
all of them); a merged state carries server 0's chain keys and a load hands
them to every server.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from estuary.config.spec import TableSpec
from estuary.embedding.delta import FULL, is_full, merge_server_parts, split_for_servers
from estuary.embedding.hashing import as_ids
from estuary.embedding.storage import rows_out
from estuary.embedding.types import EmbeddingStore, Float32Array, Int64Array, TableStats
from estuary.ps.client import (
    PSClient,
    RemoteTable,
    checked_grads,
    connect_member,
    member_identity,
    owned_tables,
    push_next_steps,
)
from estuary.ps.routing import StaleRoutingError
from estuary.ps.slots import ROUTING_PREFIX, SlotMap
from estuary.ps.types import Address, HostedTable, PSConnectionError, PSError

if TYPE_CHECKING:
    from estuary.ps.migration import Migration

__all__ = [
    "ROUTING_METADATA",
    "ShardedPSClient",
    "ShardedTable",
    "connect_servers",
    "restore_routing",
    "routing_metadata",
    "server_share",
]

T = TypeVar("T")
State = dict[str, np.ndarray]


def server_share(table: HostedTable, servers: int) -> HostedTable:
    """What one of ``servers`` processes hosts of ``table``: the same spec with the
    capacity bounds split evenly (``ceil(rows / servers)`` each)."""
    if servers == 1:
        return table
    spec: TableSpec = table.spec
    capacity = spec.eviction.capacity_rows
    share = replace(
        spec,
        initial_capacity_rows=math.ceil(spec.initial_capacity_rows / servers),
        eviction=replace(
            spec.eviction,
            capacity_rows=None if capacity is None else math.ceil(capacity / servers),
        ),
    )
    return replace(table, spec=share)


def connect_servers(
    addresses: Sequence[Address],
    authkeys: Sequence[bytes],
    *,
    sharded: bool = False,
    **client_args: Any,
) -> PSClient | ShardedPSClient:
    """A client of the servers at ``addresses``: a ``PSClient`` for one server, a
    ``ShardedPSClient`` for several or when ``sharded`` (one server whose job may
    add more: the client follows a split; ``client_args``: as ``PSClient``'s)."""
    if len(addresses) != len(authkeys) or not addresses:
        raise ValueError(f"need one key per server address, got {len(addresses)} addresses")
    clients = [PSClient(a, k, **client_args) for a, k in zip(addresses, authkeys, strict=True)]
    return clients[0] if len(clients) == 1 and not sharded else ShardedPSClient(clients)


STALE_RETRIES = 8  # a lookup refused as stale fetches the map and goes again


class _Routed:
    """One table's ids of a call split by server: ``parts[p]`` int64 (N_p,) and the
    positions ``order[offsets[p]:offsets[p + 1]]`` they came from."""

    def __init__(self, ids: Int64Array, slot_map: SlotMap, servers: int) -> None:
        self.size = ids.size
        self.order, offsets = slot_map.route(ids)
        # A map over fewer servers than the client's (a server just added): none for the rest.
        self.offsets = np.concatenate(
            [offsets, np.full(servers + 1 - offsets.size, offsets[-1], np.int64)]
        )
        self.parts = [ids[self.positions(p)] for p in range(servers)]

    def positions(self, server: int) -> Int64Array:
        return self.order[self.offsets[server] : self.offsets[server + 1]]


class ShardedPSClient:
    """Clients of P parameter servers that together host every table; a
    ``MultiTableStore`` whose calls go to all P servers at once.

    Args:
        clients: one ``PSClient`` per server, in server order.
        slot_map: which server owns an id (``estuary.ps.slots``; default the
            even map: server p hosts the ids with ``splitmix64(id ^ SERVER_SALT)
            mod P == p``). Every request carries the map's version; a lookup the
            servers refuse as stale (a migration moved slots,
            ``estuary.ps.migration``) fetches their map and goes again.
        connect: how to reach a server that joined the job (a split), from its
            entry in the map's ``members`` and the timeout: ``connect_member``
            (a socket client) unless given (the Ray actor data plane:
            ``estuary.runtime.ray.plane.connect_actor``).

    Closing it closes the clients.
    """

    def __init__(
        self,
        clients: Sequence[PSClient],
        slot_map: SlotMap | None = None,
        *,
        connect: Callable[[Mapping[str, Any], float], PSClient] = connect_member,
    ) -> None:
        if not clients:
            raise ValueError("ShardedPSClient needs at least one server client")
        self.clients = list(clients)
        self.connect = connect
        self.slot_map = SlotMap.even(len(self.clients)) if slot_map is None else slot_map
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="estuary-ps-shard")
        self._workers = len(self.clients)
        self._adopt_lock = threading.Lock()
        # The tables handed out, to be given a part on a server that joins.
        self._tables: weakref.WeakSet[ShardedTable] = weakref.WeakSet()

    @property
    def servers(self) -> int:
        """P."""
        return len(self.clients)

    def each(self, fn: Callable[[int], T], servers: Sequence[int] | None = None) -> list[T]:
        """``fn(p)`` for every server p (or those of ``servers``), concurrently;
        results in that order. Every call finishes before the first error (if
        any) is raised."""
        indices = range(self.servers) if servers is None else servers
        futures = [self._pool.submit(fn, p) for p in indices]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def each_live(self, fn: Callable[[int], T]) -> list[T]:
        """``each`` over the job's servers as they are now: should a server be
        gone because a merge retired it while this client was idle (a trainer
        whose embedding worker looks up, an evaluator), the client fetches the
        map, which drops it, and ``fn`` runs again (it must be safe to repeat).
        A server gone without a new map (a crash) raises as ``each`` does."""
        for attempt in range(STALE_RETRIES + 1):
            try:
                return self.each(fn)
            except PSConnectionError:
                before = self.slot_map.version
                if attempt == STALE_RETRIES or self.refresh_routing().version == before:
                    raise
        raise AssertionError("unreachable")

    def refresh_routing(self) -> SlotMap:
        """Fetch the servers' slot map (the first that answers: they hold the
        same one between steps; a retired server answers too until stopped)
        and route by it from now on."""
        header, arrays = self._routing()
        version = int(header["version"])
        if version != self.slot_map.version:
            if "owners" in arrays:
                slot_map = SlotMap(arrays["owners"], int(header["servers"]), version)
            else:
                slot_map = SlotMap.even(self.servers)
            for dropped in self.adopt(slot_map, header.get("members")):
                dropped.close()
        return self.slot_map

    def _routing(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        for p, client in enumerate(self.clients):
            try:
                return client.call("routing")
            except PSConnectionError:  # stopped (retired): ask the next
                if p == self.servers - 1:
                    raise
        raise AssertionError("unreachable")

    def adopt(
        self,
        slot_map: SlotMap,
        members: Sequence[Mapping[str, Any]] | None,
        known: Sequence[PSClient] = (),
    ) -> list[PSClient]:
        """Route by ``slot_map`` from now on; ``members`` (``address``, ``authkey``
        hex, on the actor plane ``actor`` and ``namespace`` too, in server order;
        ``None``: unchanged): the job's servers after a split or merge
        (``estuary.ps.migration``). A server that joined is connected
        (``known``: clients of it at hand; else ``connect``) and every table handed out
        gets its part there, at the table's step; a retired one is dropped from
        every request. Returns the clients dropped (the caller closes them)."""
        with self._adopt_lock:
            dropped = [] if members is None else self._set_members(members, known)
            if slot_map.servers > self.servers:
                raise PSError(
                    f"slot map of {slot_map.servers} servers, this client has {self.servers}"
                )
            self.slot_map = slot_map
            return dropped

    def _set_members(
        self, members: Sequence[Mapping[str, Any]], known: Sequence[PSClient]
    ) -> list[PSClient]:
        by_identity = {c.identity: c for c in [*known, *self.clients]}
        timeout_s = self.clients[0].timeout_s
        new: list[PSClient] = []
        for m in members:
            found = by_identity.get(member_identity(m))
            new.append(found or self.connect(m, timeout_s))
        if [id(c) for c in new] == [id(c) for c in self.clients]:
            return []
        index = {id(c): p for p, c in enumerate(self.clients)}
        for table in list(self._tables):
            pushed = table.pushed
            parts = []
            for c in new:
                p = index.get(id(c))
                if p is None:  # joined: it starts where the others are
                    old = table.parts[0]
                    part = RemoteTable(c, table.name, table.dim, rank=table.rank)
                    part.grad_scale = old.grad_scale
                    part.pushed = pushed
                    parts.append(part)
                else:
                    parts.append(table.parts[p])
            table.parts = parts
        kept = {id(c) for c in new}
        dropped = [c for c in self.clients if id(c) not in kept]
        self.clients = new
        if len(new) > self._workers:
            old_pool = self._pool
            self._pool = ThreadPoolExecutor(len(new), thread_name_prefix="estuary-ps-shard")
            self._workers = len(new)
            old_pool.shutdown(wait=False)
        return dropped

    def set_routing(self, slot_map: SlotMap) -> None:
        """Make ``slot_map`` every server's and this client's (between steps, no
        trainer running: a load; migrations use ``estuary.ps.migration``)."""
        if slot_map.servers > self.servers:
            raise PSError(f"slot map of {slot_map.servers} servers, this client has {self.servers}")
        self.each(
            lambda p: self.clients[p].call(
                "set_routing",
                {"version": slot_map.version, "servers": slot_map.servers},
                {"owners": slot_map.owners},
            )
        )
        self.slot_map = slot_map

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the slot map from changing for the block (no migration starts or
        is under way meanwhile): for a capture that must see every server at
        one map. Taken on the servers in order (migrations fence in that order
        too), so the two never wait on each other in a circle. Should the
        servers' map be newer than this client's (a migration, split or merge
        since its last request), it is adopted first: the block sees every
        server that holds rows."""
        for attempt in range(STALE_RETRIES + 1):
            clients = list(self.clients)
            held: list[PSClient] = []
            gone: PSConnectionError | None = None
            try:
                try:
                    for client in clients:
                        client.call("hold_routing")
                        held.append(client)
                    # A map changed since this client last routed (a split added a
                    # server that holds rows now): adopt it and hold again.
                    current = self._routing()[0]["version"] == self.slot_map.version
                except PSConnectionError as exc:  # a server gone: a merge's, or a crash
                    gone, current = exc, False
                if current:
                    yield
                    return
            finally:
                for client in held:
                    with contextlib.suppress(PSError):
                        client.call("release_routing")
            if attempt == STALE_RETRIES:
                raise gone or PSError("the slot map kept changing while a capture waited")
            before = self.slot_map.version
            self.refresh_routing()
            if gone is not None and self.slot_map.version == before:
                raise gone  # not retired by a merge this client missed: a failure

    def migrate(self, slots: Sequence[int] | Int64Array, to: int) -> Migration:
        """Move ``slots`` to server ``to`` between two steps while trainers run
        (``estuary.ps.migration.migrate``); returns what it did and cost."""
        from estuary.ps.migration import migrate  # it drives this class

        return migrate(self, slots, to)

    def refine_slots(self, factor: int = 2) -> Migration:
        """Split every slot into ``factor`` (``SlotMap.refined``) between two
        steps while trainers run: no row moves, every id keeps its server, and
        a hot slot's ids can move apart later (``migrate``)."""
        from estuary.ps.migration import migrate

        return migrate(self, np.empty(0, np.int64), 0, refine=factor)

    def add_server(
        self, client: PSClient, slots: Sequence[int] | Int64Array | None = None
    ) -> Migration:
        """Split: ``client``'s server (started for this job: the same tables,
        ``server_share`` of the new count, the same world size) joins as server
        P, between two steps while trainers run, and takes ``slots`` (default:
        every other slot of the server owning most). It starts after the fence
        step on the others' checkpoint chain; every client of the job connects
        to it when it next fetches the map."""
        from estuary.ps.migration import migrate

        self.refresh_routing()
        if slots is None:
            fullest = int(np.argmax(self.slot_map.counts()))
            slots = self.slot_map.owned(fullest)[::2]
        return migrate(self, slots, self.servers, joining=client)

    def retire_server(self, server: int, into: int | None = None) -> Migration:
        """Merge: move every slot of ``server`` to ``into`` (default: the server
        owning fewest of the others) and take it out of the job, between two
        steps while trainers run; the servers after it move down one place.
        Its client here is closed; every other client drops it when it next
        fetches the map (its next train lookup). Stop the server once every
        rank moved on: ``wait_moved_on(migration)``, then shut it down."""
        from estuary.ps.migration import migrate

        slot_map = self.refresh_routing()
        if into is None:
            counts = slot_map.counts().astype(np.float64)
            counts[server] = np.inf
            into = int(np.argmin(counts))
        return migrate(self, slot_map.owned(server), into, retire=server)

    def wait_moved_on(self, migration: Migration) -> None:
        """Block until every server of the job applied the step after the
        migration's fence for every table that trained: every rank has routed
        by the new map since (a retired server gets no more requests)."""
        for table, step in migration.fence.items():
            if step > 0:
                wait = {"table": table, "step": step + 1}
                self.each(lambda p, wait=wait: self.clients[p].call("wait", wait))  # type: ignore[misc]

    def hello(self) -> dict[str, Any]:
        """Server 0's facts; raises ``PSError`` unless every server hosts the same tables."""
        headers = self.each(lambda p: self.clients[p].hello())
        for p, header in enumerate(headers[1:], start=1):
            if header["tables"] != headers[0]["tables"]:
                raise PSError(
                    f"parameter servers disagree: server 0 hosts {headers[0]['tables']}, "
                    f"server {p} {header['tables']}"
                )
        return headers[0]

    def tables(self, *, rank: int = 0, grad_scale: float = 1.0) -> dict[str, ShardedTable]:
        """Every hosted table as a ``ShardedTable``, by name."""
        shards = self.hello().get("shards", {})
        per_server = self.each(lambda p: self.clients[p].tables(rank=rank, grad_scale=grad_scale))
        names = list(per_server[0])
        for p, tables in enumerate(per_server):
            if list(tables) != names:
                raise PSError(f"parameter server {p} hosts {sorted(tables)}, server 0 {names}")
        out = {
            name: ShardedTable(self, [t[name] for t in per_server], shards=int(shards.get(name, 1)))
            for name in names
        }
        self._tables.update(out.values())
        return out

    def table(self, name: str, *, rank: int = 0, grad_scale: float = 1.0) -> ShardedTable:
        """A ``ShardedTable`` for ``name``."""
        tables = self.tables(rank=rank, grad_scale=grad_scale)
        if name not in tables:
            raise PSError(f"unknown table {name!r}; the servers host {sorted(tables)}")
        return tables[name]

    def _own(self, stores: Sequence[EmbeddingStore], op: str) -> list[ShardedTable]:
        return owned_tables(self, stores, op, ShardedTable)

    def lookup_many(
        self,
        stores: Sequence[EmbeddingStore],
        ids: Sequence[Int64Array],
        *,
        train: bool,
        out: Sequence[Float32Array] | None = None,
    ) -> list[Float32Array]:
        """Every table's ``lookup`` in one request per server, all servers at once ->
        per table float32 (N_i, D_i) (``out[i]`` when given)."""
        tables = self._own(stores, "lookup_many")
        id_arrays = [as_ids(i) for i in ids]
        if len(id_arrays) != len(tables) or (out is not None and len(out) != len(tables)):
            raise ValueError(
                f"lookup_many: need ids (and out) for each of the {len(tables)} tables"
            )
        if not tables:
            return []
        dest = [
            rows_out(None if out is None else out[i], a.size, t.dim)
            for i, (t, a) in enumerate(zip(tables, id_arrays, strict=True))
        ]
        steps = [t._next_lookup_step() for t in tables] if train else None
        for attempt in range(STALE_RETRIES + 1):
            slot_map = self.slot_map
            routed = [_Routed(a, slot_map, self.servers) for a in id_arrays]

            def one(
                p: int, routed: list[_Routed] = routed, version: int = slot_map.version
            ) -> None:
                rows = self.clients[p].lookup_many(
                    [t.parts[p] for t in tables],
                    [r.parts[p] for r in routed],
                    train=train,
                    steps=steps,
                    routing=version,
                )
                for into, r, got in zip(dest, routed, rows, strict=True):
                    into[r.positions(p)] = got

            try:
                self.each(one)
                return dest
            except (StaleRoutingError, PSConnectionError):
                # Every server refused (a train lookup past a migration's fence
                # waits there and sees the new map), or one is gone (retired and
                # stopped while this client was idle): route the same step again
                # by the servers' map, if it changed.
                if attempt == STALE_RETRIES:
                    raise
                before = self.slot_map.version
                if self.refresh_routing().version == before:
                    raise
        raise AssertionError("unreachable")

    def apply_gradients_many(
        self,
        stores: Sequence[EmbeddingStore],
        ids: Sequence[Int64Array],
        grads: Sequence[Float32Array],
        lr_scales: Sequence[float] | None = None,
    ) -> None:
        """Every table's ``apply_gradients`` (its next push) in one request per
        server, all servers at once."""
        tables = self._own(stores, "apply_gradients_many")
        push_next_steps(tables, lambda steps: self.push_many(tables, steps, ids, grads, lr_scales))

    def push_many(
        self,
        stores: Sequence[EmbeddingStore],
        steps: Sequence[int],
        ids: Sequence[Int64Array],
        grads: Sequence[Float32Array],
        lr_scales: Sequence[float] | None = None,
    ) -> list[bool]:
        """Each table's ``push(steps[i], ids[i], grads[i])`` on every server (the
        ids it owns; none where it owns none); per table ``False`` where every
        server already had that (step, rank) (a retry)."""
        tables = self._own(stores, "push_many")
        id_arrays = [as_ids(i) for i in ids]
        if not len(id_arrays) == len(grads) == len(steps) == len(tables):
            raise ValueError(
                f"push_many: need steps, ids and grads for each of {len(tables)} tables"
            )
        grad_arrays = [
            checked_grads(table, ids_t, grads_t)
            for table, ids_t, grads_t in zip(tables, id_arrays, grads, strict=True)
        ]
        slot_map = self.slot_map
        routed = [_Routed(a, slot_map, self.servers) for a in id_arrays]

        def one(p: int) -> list[bool]:
            return self.clients[p].push_many(
                [t.parts[p] for t in tables],
                steps,
                [r.parts[p] for r in routed],
                [g[r.positions(p)] for g, r in zip(grad_arrays, routed, strict=True)],
                lr_scales,
                routing=slot_map.version,
            )

        fresh = self.each(one)
        return [any(per_server) for per_server in zip(*fresh, strict=True)]

    def stats_many(self, stores: Sequence[EmbeddingStore]) -> list[TableStats]:
        """Every table's ``stats()`` (the servers' counters summed) in one request
        per server, all servers at once."""
        tables = self._own(stores, "stats_many")
        if not tables:
            return []
        per_server = self.each_live(
            lambda p: self.clients[p].stats_many([t.parts[p] for t in tables])
        )
        return [sum(stats, TableStats()) for stats in zip(*per_server, strict=True)]

    def server_stats(self) -> dict[str, dict[str, int]]:
        """Per table, the servers' step figures combined: ``applied`` (the minimum),
        ``duplicates`` and ``waits`` (sums), ``pending_steps`` and ``max_behind``
        (maxima)."""
        per_server = self.each_live(lambda p: self.clients[p].server_stats())
        out: dict[str, dict[str, int]] = {}
        for name in per_server[0]:
            figures = [s[name] for s in per_server]
            out[name] = {
                "applied": min(f["applied"] for f in figures),
                "duplicates": sum(f["duplicates"] for f in figures),
                "waits": sum(f["waits"] for f in figures),
                "pending_steps": max(f["pending_steps"] for f in figures),
                "max_behind": max(f["max_behind"] for f in figures),
            }
        return out

    def shutdown(self) -> None:
        """Ask every server to stop."""
        self.each(lambda p: self.clients[p].shutdown())

    def close(self) -> None:
        """Close every client's connections."""
        for client in self.clients:
            client.close()
        self._pool.shutdown(wait=False)


class ShardedTable:
    """A table split across the servers of a ``ShardedPSClient``: one
    ``RemoteTable`` per server (``parts``). Implements ``EmbeddingStore`` and the
    ``state_dict`` API of ``EmbeddingTable``; thread-safe.

    Args:
        client: the sharded client.
        parts: the table on each server, in server order.
        shards: the hash shards each server splits its part into (``spec.shards``).

    Its own step counters number train lookups and pushes 1, 2, 3, ...; each
    step goes to every part with the same number.
    """

    def __init__(
        self, client: ShardedPSClient, parts: Sequence[RemoteTable], *, shards: int = 1
    ) -> None:
        self.client = client
        self.shards_per_server = shards
        self.parts = list(parts)
        self.name = self.parts[0].name
        self.rank = self.parts[0].rank
        self._dim = self.parts[0].dim
        self._lookup_lock = threading.Lock()
        self._push_lock = threading.Lock()
        self._lookup_step = 0
        self._push_step = 0

    def __repr__(self) -> str:
        return f"ShardedTable({self.name!r}, dim={self._dim}, servers={len(self.parts)})"

    @property
    def dim(self) -> int:
        """Embedding width D."""
        return self._dim

    @property
    def pushed(self) -> int:
        """The last step every server acknowledged."""
        return min(part.pushed for part in self.parts)

    def note_pushed(self, step: int) -> None:
        """Another client pushed this rank's ``step`` to every server (see
        ``RemoteTable.note_pushed``)."""
        for part in self.parts:
            part.note_pushed(step)

    @property
    def multi_store(self) -> ShardedPSClient:
        """The ``MultiTableStore`` batching this table's calls with the others'."""
        return self.client

    def __len__(self) -> int:
        """Ids holding their own row, over all servers."""
        return self.stats().rows

    def _next_lookup_step(self) -> int:
        with self._lookup_lock:
            self._lookup_step += 1
            return self._lookup_step

    def lookup(
        self,
        ids: Int64Array,
        *,
        train: bool,
        out: Float32Array | None = None,
    ) -> Float32Array:
        """Rows of ``ids`` int64 (N,) -> float32 (N, D), as ``RemoteTable.lookup``."""
        out_list = None if out is None else [out]
        return self.client.lookup_many([self], [ids], train=train, out=out_list)[0]

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        """Push ``grads`` float32 (N, D) for ``ids`` int64 (N,) as this table's next step."""
        self.client.apply_gradients_many([self], [ids], [grads], [lr_scale])

    def push(
        self, step: int, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> bool:
        """Push this rank's gradients of ``step`` to every server (``RemoteTable.push``);
        ``False`` if every server already had it."""
        return self.client.push_many([self], [step], [ids], [grads], [lr_scale])[0]

    def wait_applied(self, step: int | None = None) -> int:
        """Block until ``step`` (default: the last pushed) is applied on every server;
        returns the smallest last-applied step."""
        target = self.pushed if step is None else step
        return min(self.client.each_live(lambda p: self.parts[p].wait_applied(target)))

    def stats(self) -> TableStats:
        """The servers' counters, summed."""
        return self.client.stats_many([self])[0]

    def state_dict(self, *, mark_clean: bool = True) -> State:
        """All rows and state, the servers' parts merged (a table of P x shards
        shards; loads into any count)."""
        with self.client.holding():  # every part at one slot map
            parts = self.client.each(lambda p: self.parts[p].state_dict(mark_clean=mark_clean))
        return self._with_map(_merge(parts, self.name))

    def _with_map(self, state: State) -> State:
        # A migrated map (version > 0) is saved with the rows: a resume routes as this run.
        slot_map = self.client.slot_map
        return {**state, **slot_map.state()} if slot_map.version > 0 else state

    def _split(self, state: Mapping[str, np.ndarray]) -> list[State]:
        self.client.refresh_routing()  # every server that holds rows now
        saved = SlotMap.from_state(state, len(self.parts))
        # A newer map than the servers' (a fresh job): route as the saved run did.
        # An older one (a delta chain's base, its run's map set from the newest
        # checkpoint first: ``restore_routing``) is not gone back to.
        if saved is not None and saved.version > self.client.slot_map.version:
            self.client.set_routing(saved)
        rows = {k: v for k, v in state.items() if not k.startswith(ROUTING_PREFIX)}
        return split_for_servers(
            rows, len(self.parts), self.shards_per_server, router=self.client.slot_map.route
        )

    def delta_state_dict(self) -> State:
        """Rows changed and ids evicted since the last mark, on every server.

        Should some servers have to send a full state (``delta.full``: more ids
        evicted than they hold rows) and others not, the others' full states are
        taken too (unmarked: the delta already marked them), so the merged delta
        is full and loads like one."""
        with self.client.holding():  # every part at one slot map
            parts = self.client.each(lambda p: self.parts[p].delta_state_dict())
            fulls = [is_full(part) for part in parts]
            if any(fulls) and not all(fulls):
                for p, full in enumerate(fulls):
                    if not full:
                        chain = {k: v for k, v in parts[p].items() if k.startswith("delta.")}
                        parts[p] = {**self.parts[p].state_dict(mark_clean=False), **chain}
                        parts[p][FULL] = np.array([1], np.int64)
        return self._with_map(_merge(parts, self.name))

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the table's state on every server (a state of any shard or
        server count). Call it while no trainer is training."""
        parts = self._split(state)
        self.client.each(lambda p: self.parts[p].load_state_dict(parts[p]))

    def apply_delta(self, delta: Mapping[str, np.ndarray]) -> None:
        """Apply a delta (of any shard or server count) on every server; a wrong
        base raises ``PSError``. Call it while no trainer is training."""
        parts = self._split(delta)
        self.client.each(lambda p: self.parts[p].apply_delta(parts[p]))

    def remove(self, ids: Int64Array) -> int:
        """Drop the rows of ``ids`` int64 (N,); returns how many existed."""
        self.client.refresh_routing()
        routed = _Routed(as_ids(ids), self.client.slot_map, len(self.parts))
        return sum(self.client.each(lambda p: self.parts[p].remove(routed.parts[p])))

    def set_admission_counting(self, enabled: bool) -> None:
        """As ``RemoteTable.set_admission_counting``, on every server."""
        self.client.each_live(lambda p: self.parts[p].set_admission_counting(enabled))


ROUTING_METADATA = "ps_routing"
"""The checkpoint manifest's metadata key of the servers' slot map."""


def routing_metadata(tables: Iterable[object]) -> dict[str, Any] | None:
    """The slot map of the servers holding ``tables`` (the first ``ShardedTable``'s
    client), for a checkpoint's manifest (``ROUTING_METADATA``): ``servers``,
    ``version`` and, once slots moved (version > 0), ``owners`` (S ints). A
    resume reads the server count from it (a split or merge changed it) and
    routes as the run did (``restore_routing``). ``None``: no sharded table."""
    for table in tables:
        if isinstance(table, ShardedTable):
            slot_map = table.client.slot_map
            out: dict[str, Any] = {"servers": slot_map.servers, "version": slot_map.version}
            if slot_map.version > 0:
                out["owners"] = slot_map.owners.tolist()
            return out
    return None


def restore_routing(tables: Iterable[object], saved: Mapping[str, Any] | None) -> bool:
    """Before a load: make the map ``routing_metadata`` saved the servers' (the
    first ``ShardedTable``'s client) when they are as many, so every row lands
    where the checkpointed run held it; returns whether it did. Other counts
    route by the client's own map (rows are split by it: none lost)."""
    if not saved or "owners" not in saved:
        return False
    for table in tables:
        if isinstance(table, ShardedTable):
            client = table.client
            client.refresh_routing()
            servers = int(saved["servers"])
            if client.servers != servers:
                return False
            slot_map = SlotMap(
                np.asarray(saved["owners"], np.int64), servers, int(saved["version"])
            )
            if slot_map != client.slot_map:
                client.set_routing(slot_map)
            return True
    return False


def _merge(parts: list[State], name: str) -> State:
    try:
        return merge_server_parts(parts, name)
    except ValueError as exc:
        raise PSError(str(exc)) from exc
