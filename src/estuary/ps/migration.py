"""Moving slots (id ranges of the slot map, ``estuary.ps.slots``) between
parameter servers between two steps, while the trainers run.

::

    coordinator (any ShardedPSClient of the servers)         every server
      1 fence: each server fences its tables at the highest   train lookups of later
        step looked up there; the maximum goes to all          steps (and eval reads)
      2 wait until every server applied the fence step         wait at the gate
        then lock_moves on each server in order (waits for checkpoint captures
        holding the map to end; new ones wait for the lift)
      3 per table, per source server:
          export_slots (rows of the slots with everything the table keeps for
          them: weights, optimizer slots, eviction stamps/freq/time, exact
          pending admission counts) -> import_rows on the destination
      4 set_routing (map version v + 1) on every server
      5 drop_ids on the sources (rows logged as evicted for the delta chain);
        a table shard the drop left mostly empty is compacted there, its
        arrays cut to the rows left (``ServerConfig.compact_below``)
      6 lift: waiting lookups see version v + 1, are refused as stale, and
        their clients fetch the map and route the same step again

Steps up to the fence are applied by the old owners, steps after it by the new
ones, and a row is on exactly one server at every step: nothing trained is
lost or applied twice. The pause the trainers see is at most the time from the
fence to the lift (``Migration.pause_ms``), most of it spent waiting for the
fence step's last pushes (``wait_ms``) and copying the rows (``move_ms``).

Should the copy fail, the rows imported so far are dropped from the
destination, the map stays as it was and the fence is lifted: the run goes on
unchanged and the error is raised.

Checkpoints: a capture that spans the servers (``ShardedTable.state_dict``,
``delta_state_dict``, the registration of an asynchronous ``ServerSnapshot``)
holds the map (``ShardedPSClient.holding``): ``lock_moves`` waits for it and it
waits for the lift; it is never fenced, so a trainer may checkpoint while the
fence step's last pushes are still to come. Snapshots registered for the
fence step are captured before any row moves (each migration op runs them
first); later ones after the lift.

A split (``joining``, ``ShardedPSClient.add_server``) fences and waits on the
job's servers only; after ``lock_moves`` the new server gets ``join`` (its
tables start after the fence step, on server 0's checkpoint chain) and takes
the slots. A merge (``retire``, ``ShardedPSClient.retire_server``) moves all of
a server's slots and switches to the map without it (``SlotMap.retired``).
Either way ``set_routing`` carries the map's ``members`` (every server's
address and key, in order) to every server, the retired one included; each
client adopts them when its next lookup is refused as stale
(``ShardedPSClient.adopt``).

A refinement (``refine``, ``ShardedPSClient.refine_slots``) moves no slot: the
same fence, then ``set_routing`` with the map over F x S slots
(``SlotMap.refined``; every id keeps its server), so a hot slot's ids can move
apart in a later migration.

Not covered: a sketch admission counter keeps counting moved ids on the old
server (a sketch cannot forget single ids), so they start pending afresh on
the new one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from estuary.embedding.delta import IDS, PENDING_IDS
from estuary.embedding.hashing import SERVER_SALT, as_ids, shard_of
from estuary.embedding.types import Int64Array
from estuary.ps.slots import SlotMap
from estuary.ps.types import PSError

if TYPE_CHECKING:
    from estuary.ps.client import PSClient
    from estuary.ps.sharded import ShardedPSClient

__all__ = ["Migration", "member", "migrate", "slot_filter"]

State = dict[str, np.ndarray]


@dataclass(frozen=True)
class Migration:
    """What one migration did and cost.

    ``slots`` moved from ``sources`` to ``to``; ``rows`` and ``pending`` (exact
    pending admission ids) moved over all tables, ``bytes`` of arrays;
    ``version`` the slot map's new version; ``fence`` the step of each table
    after which the new map applies. Times (ms): ``pause_ms`` fence to lift
    (the most any trainer waited), ``wait_ms`` for the fence step to be applied
    everywhere, ``move_ms`` export, import, switch and drop. ``servers``: the
    job's server count after it (one more after a split); ``retired``: the
    server that left (a merge; the caller stops it, see ``ShardedPSClient.retire_server``);
    ``freed_bytes``: table memory the sources gave back by compacting after the
    drop (``ServerConfig.compact_below``), ``compact_ms`` the time they spent
    on it (part of ``move_ms``). ``slot_count``: S of the map after it (a
    refinement multiplies it)."""

    slots: int
    sources: tuple[int, ...]
    to: int
    version: int
    rows: int
    pending: int
    bytes: int
    fence: dict[str, int]
    pause_ms: float
    wait_ms: float
    move_ms: float
    servers: int = 0
    retired: int | None = None
    freed_bytes: int = 0
    compact_ms: float = 0.0
    slot_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sources"] = list(self.sources)
        return out


def slot_filter(slots: Int64Array, slot_count: int) -> Callable[[Int64Array], np.ndarray]:
    """ids int64 (N,) -> bool (N,): whether an id's slot (of a ``slot_count``-slot
    map) is one of ``slots``."""
    wanted = np.zeros(slot_count, np.bool_)
    wanted[np.asarray(slots, np.int64)] = True

    def select(ids: Int64Array) -> np.ndarray:
        return wanted[shard_of(as_ids(ids), slot_count, salt=SERVER_SALT)]

    return select


def migrate(
    client: ShardedPSClient,
    slots: Sequence[int] | Int64Array,
    to: int,
    *,
    joining: PSClient | None = None,
    retire: int | None = None,
    refine: int = 1,
) -> Migration:
    """Move ``slots`` (of ``client.slot_map``) to server ``to`` between two steps
    (see the module docstring). Trainers keep running; their requests wait at
    most the pause. Returns what it did; ``client`` routes by the new map.

    ``joining``: a server started for this job (same tables and world size) that
    joins it as server ``to`` (== ``client.servers``): a split. ``retire``: a
    server that owns no slot once these moved, and leaves the job: a merge.
    Either way the new map names the job's servers (``members``) and every
    client adopts them when it fetches the map. ``refine`` F >= 2: no slot
    moves (``slots`` empty, ``to`` unused); the new map has F x S slots, every
    id on its server (``SlotMap.refined``)."""
    client.refresh_routing()
    old = client.slot_map
    conns = list(client.clients)
    running = len(conns)
    if joining is not None:
        if to != running or retire is not None:
            raise PSError(f"migrate: a joining server becomes server {running}, not {to}")
        conns.append(joining)
    if not 0 <= to < len(conns) or old.servers > running:
        raise PSError(f"migrate: server {to} is not one of the client's {running}")
    if retire is not None and not (0 <= retire < running and retire != to):
        raise PSError(f"migrate: cannot retire server {retire} into server {to} of {running}")
    picked = np.unique(np.asarray(slots, np.int64))
    if refine > 1:
        if picked.size or joining is not None or retire is not None:
            raise PSError("migrate: a refinement moves no slot and changes no server")
        try:
            new = old.refined(refine)
        except ValueError as exc:
            raise PSError(f"migrate: {exc}") from exc
    else:
        picked = picked[old.owners[picked] != to]
        new = old.moved(picked, to, servers=len(conns) if joining is not None else running)
    if retire is not None:
        try:
            new = new.retired(retire)
        except ValueError as exc:
            raise PSError(f"migrate: {exc}") from exc
    members = None
    if joining is not None or retire is not None:
        members = [member(c) for p, c in enumerate(conns) if p != retire]
    sources = tuple(int(p) for p in np.unique(old.owners[picked]))
    facts = client.hello()
    tables = list(facts["tables"])
    if joining is not None:
        _check_joining(facts, joining.hello())
    before = range(running)  # the job's servers now (a joining one is not fenced)
    everyone = range(len(conns))
    dropped: list[PSClient] = []
    freed, compact_ms = 0, 0.0
    t0 = time.perf_counter()
    try:
        first = client.each(lambda p: conns[p].call("fence")[0]["fence"], before)
        at = {t: max(int(f.get(t, 0)) for f in first) for t in tables}
        client.each(lambda p: conns[p].call("fence", {"at": at}), before)
        for table, step in at.items():
            if step > 0:
                wait = {"table": table, "step": step}
                client.each(lambda p, wait=wait: conns[p].call("wait", wait), before)  # type: ignore[misc]
        # In server order, one after another: captures hold the map in that order.
        for p in before:
            conns[p].call("lock_moves")
        if joining is not None:
            # The new server starts after the fence step, on the others' checkpoint chain.
            chain = conns[0].call("chain")[0]["chain"]
            joining.call("join", {"applied": at, "chain": chain})
        t1 = time.perf_counter()
        moved, rows, pending, nbytes = _copy(conns, old, picked, sources, to, tables)
        header: dict[str, Any] = {"version": new.version, "servers": new.servers}
        if members is not None:
            header["members"] = members
        client.each(
            lambda p: conns[p].call("set_routing", header, {"owners": new.owners}), everyone
        )
        dropped = client.adopt(new, members, conns)
        for (source, table), (ids, pend) in moved.items():
            header = {"table": table, "compact": source != retire}  # a leaving server: no
            reply, _ = conns[source].call("drop_ids", header, {"ids": ids, "pending": pend})
            freed += int(reply.get("freed_bytes", 0))
            compact_ms += float(reply.get("compact_ms", 0.0))
    finally:
        client.each(lambda p: conns[p].call("lift"), everyone)
    for retired in dropped:
        retired.close()
    t2 = time.perf_counter()
    return Migration(
        slots=int(picked.size),
        sources=sources,
        to=to,
        version=new.version,
        rows=rows,
        pending=pending,
        bytes=nbytes,
        fence=at,
        pause_ms=(t2 - t0) * 1e3,
        wait_ms=(t1 - t0) * 1e3,
        move_ms=(t2 - t1) * 1e3,
        servers=new.servers,
        retired=retire,
        freed_bytes=freed,
        compact_ms=compact_ms,
        slot_count=new.slots,
    )


def _check_joining(job: dict[str, Any], new: dict[str, Any]) -> None:
    # A joining server must host the same tables (names, dims, hash shards) for
    # the same world size and staleness.
    for key in ("tables", "shards", "world_size", "staleness"):
        if new.get(key) != job.get(key):
            raise PSError(
                f"split: the joining server's {key} is {new.get(key)!r}, the job's "
                f"{job.get(key)!r}; start it with the job's tables and world size"
            )


def member(client: PSClient) -> dict[str, Any]:
    """A server as the map's ``members`` name it (``PSClient.member``: address
    and key hex; over Ray actor calls its actor's name too), so any client of
    the job can reach it. Raises ``PSError`` for a client that cannot say."""
    return client.member()


def _copy(
    conns: Sequence[PSClient],
    old: SlotMap,
    picked: Int64Array,
    sources: tuple[int, ...],
    to: int,
    tables: list[str],
) -> tuple[dict[tuple[int, str], tuple[Int64Array, Int64Array]], int, int, int]:
    # Export from each source, import at ``to``; on failure drop what was imported.
    moved: dict[tuple[int, str], tuple[Int64Array, Int64Array]] = {}
    rows = pending = nbytes = 0
    try:
        for table in tables:
            for source in sources:
                part = picked[old.owners[picked] == source]
                _, state = conns[source].call(
                    "export_slots", {"table": table, "slot_count": old.slots}, {"slots": part}
                )
                ids = as_ids(state[IDS])
                pend = as_ids(state.get(PENDING_IDS, np.empty(0, np.int64)))
                moved[(source, table)] = (ids, pend)
                conns[to].call("import_rows", {"table": table}, state)
                rows += ids.size
                pending += pend.size
                nbytes += sum(int(v.nbytes) for v in state.values())
    except BaseException:
        for (_, table), (ids, pend) in moved.items():
            conns[to].call("drop_ids", {"table": table}, {"ids": ids, "pending": pend})
        raise
    return moved, rows, pending, nbytes
