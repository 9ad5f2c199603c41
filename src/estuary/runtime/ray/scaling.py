"""The scaling manager's PS knobs on Ray: the driver looks at every PS shard
(``ServerActor.table_stats``) each interval, adds a PS shard (a split) before
a shard's memory crosses ``runtime.roles.ps.memory_mb`` while the shards are
below ``runtime.roles.ps.max``, else caps its rows (``ServerActor.cap_rows``),
merges two shards far under budget and cold (down to ``runtime.roles.ps.min``),
and rebalances a hot shard by moving its hottest slots to the coldest shard
(``estuary.ps.migration``), each between two steps while the trainers run.

::

    driver (RayRuntime, while it watches the roles)
      thread "estuary-scaling": every interval_s
        ShardMetrics per shard <- ray.get(server.table_stats())
        EstuaryPolicy
          memory rule -> ps_shards P -> P+1: ServerSpawner starts a ServerActor
                         (its own resource ask, outside the placement group,
                         a fresh key) -> ShardedPSClient.add_server(new, slots:
                         every shard gives 1/(P+1) of its slots)
                      -> else server.cap_rows(n)
          merge rule  -> ps_shards P -> P-1: ShardedPSClient.retire_server;
                         the retired actor is stopped once every rank moved on
                         (all servers applied the step after the fence)
          hot shard   -> per-slot loads of the hot shard (slot_loads op)
                         -> plan_moves -> ShardedPSClient.migrate(slots, coldest)
                         -> no slot fits (one carries more than half the gap):
                            ShardedPSClient.refine_slots (every slot split in
                            up to 16, no row moves); the next interval moves
        timeline: scaling_ps.json (each migration: slots, rows, pause_ms; a
                  split or merge: the shards' memory after; its effect: the
                  hot shard's load share, the largest shard's memory)

Trainers (and embedding workers) learn of a split or merge from the servers:
the map's ``members`` name every server (its socket address and key; on the
actor data plane its actor's name, ``estuary.runtime.ray.plane``), and each
client adopts them when its next lookup is refused as stale.

On with ``runtime.scaling.enabled`` and either a PS memory budget (the memory
knob; row caps need ``eviction.capacity_rows``) or two or more PS shards (the
hot-shard rebalance).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from estuary.config import JobSpec
from estuary.config.spec import RoleResources
from estuary.ps import PSClient, ServerConfig
from estuary.ps.migration import Migration
from estuary.ps.sharded import ROUTING_METADATA, ShardedPSClient
from estuary.ps.slots import MAX_SLOTS_PER_SERVER, SlotMap
from estuary.ps.types import PSError
from estuary.runtime.ray.actors import ServerActor, kill_all, server_name
from estuary.runtime.ray.plane import ActorPSClient, actor_clients, connect_actor
from estuary.runtime.scaling.controller import Controller
from estuary.runtime.scaling.metrics import ShardMetrics, Snapshot
from estuary.runtime.scaling.policy import Bounds, Decision, EstuaryPolicy
from estuary.runtime.scaling.rebalance import Moves, plan_moves
from estuary.train.checkpoint_chain import CheckpointError, read_manifest, resolve_checkpoint

__all__ = [
    "PSScaling",
    "RayShards",
    "ServerSpawner",
    "elastic_shards",
    "ps_scaling_manager",
    "resumed_shard_count",
    "spare_shard_cpus",
    "split_slots",
]

STATS_TIMEOUT_S = 30.0
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSpawner:
    """Starts one more PS shard for a split: a ``ServerActor`` with ``config``
    (the job's tables and world size), its own resource ask (``resources``:
    ``runtime.ray.ps``; outside the job's placement group), a fresh key and a
    fresh name.

    Returns ``(actor, client of it)``: a socket client, or on the actor data
    plane (``plane``) an ``ActorPSClient``."""

    config: ServerConfig
    resources: RoleResources = field(default_factory=RoleResources)
    timeout_s: float = 60.0
    client_timeout_s: float = 600.0
    plane: str = "socket"

    def __call__(self) -> tuple[Any, PSClient]:
        key = os.urandom(32)
        options: dict[str, Any] = {
            "num_cpus": self.resources.cpus,
            "num_gpus": self.resources.gpus,
            "name": server_name(),
        }
        if self.resources.memory_mb is not None:
            options["memory"] = float(self.resources.memory_mb * 2**20)
        actor = ServerActor.options(**options).remote(self.config, key)  # type: ignore[attr-defined]
        try:
            if self.plane == "actor":
                member = ray.get(actor.member.remote(), timeout=self.timeout_s)
                return actor, ActorPSClient(actor, timeout_s=self.client_timeout_s, member=member)
            address, _ = ray.get(actor.endpoint.remote(), timeout=self.timeout_s)
        except BaseException:
            kill_all([actor])
            raise
        return actor, PSClient(address, key, timeout_s=self.client_timeout_s)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def split_slots(owners: np.ndarray, servers: int) -> np.ndarray:
    """The slots a new server takes from ``servers`` others (``owners`` int64
    (S,)): every ``servers + 1``-th slot of each, so each gives 1/(P+1) of its
    slots and the new one ends with about its even share."""
    picked = [np.flatnonzero(owners == p)[:: servers + 1] for p in range(servers)]
    return np.concatenate(picked).astype(np.int64) if picked else np.empty(0, np.int64)


@dataclass
class _Retiring:
    actor: Any
    migration: Migration


class RayShards:
    """The PS shards' metrics, memory knobs (``shard_rows:P``, ``ps_shards``)
    and hot-shard rebalance (``hot_shard:P``).

    Args:
        servers: the ``ServerActor`` handles, in server order.
        budget_bytes: each shard's memory budget (``None``: none).
        client: a client of the servers for migrations (default: one over the
            actor data plane, ``ActorPSClient``). Splits and merges use it to
            name the job's servers for the trainers: socket clients
            (``PSClient``s) on the socket plane, ``ActorPSClient``s of named
            actors with ``connect_actor`` on the actor plane.
        spawn: starts a server for a split (``ServerSpawner``); ``None``: the
            shard count does not change (``ps_shards`` is not applied).

    ``servers`` follows splits and merges; ``retired`` lists the actors taken
    out of the job (a runtime does not count their end as a failure);
    ``started`` the ones splits added (the runtime stops them with the job).
    """

    def __init__(
        self,
        servers: Sequence[Any],
        budget_bytes: int | None,
        *,
        client: ShardedPSClient | None = None,
        spawn: ServerSpawner | None = None,
    ) -> None:
        self.servers = list(servers)
        self.budget_bytes = budget_bytes
        self.spawn = spawn
        self._lookups = [0] * len(self.servers)
        self._loads = [0.0] * len(self.servers)
        self._t = 0.0
        self.client: ShardedPSClient | None = client
        if self.client is None and len(self.servers) > 1:
            self.client = ShardedPSClient(actor_clients(self.servers), connect=connect_actor)
        if self.client is not None:
            self.client.refresh_routing()
            slots = self.client.slot_map.slots
            self.client.each(lambda p: self._conn(p).call("slot_loads", {"count": slots}))
        self.last_detail: dict[str, Any] | None = None
        self.migrations: list[dict[str, Any]] = []
        self.retired: list[Any] = []
        self.started: list[Any] = []
        self._retiring: list[_Retiring] = []
        self._no_spawn: str | None = None  # why splits stopped (a server did not start)

    def _conn(self, p: int) -> Any:
        assert self.client is not None
        return self.client.clients[p]

    def sample(self, t: float) -> Snapshot:
        self._reap()
        stats = ray.get([s.table_stats.remote() for s in self.servers], timeout=STATS_TIMEOUT_S)
        dt, shards = t - self._t, []
        for p, tables in enumerate(stats):
            lookups = sum(v[2] for v in tables.values())
            caps = [v[3] for v in tables.values()]
            counting = [v[5] for v in tables.values() if v[5] is not None]
            load = (lookups - self._lookups[p]) / dt if dt > 0 else 0.0
            shards.append(
                ShardMetrics(
                    shard=p,
                    load=load,
                    rows=sum(v[0] for v in tables.values()),
                    memory_bytes=sum(v[1] for v in tables.values()),
                    budget_bytes=self.budget_bytes,
                    capacity_rows=None if None in caps else sum(c or 0 for c in caps),
                    allocated_rows=sum(v[4] for v in tables.values()),
                    admission_min_count=min(counting) if counting else None,
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
            try:
                ray.get(self.servers[int(shard)].cap_rows.remote(int(decision.new)))
            except RayTaskError as exc:  # e.g. a table without eviction.capacity_rows
                return f"row cap refused: {_last_line(exc)}"
            return None
        if kind == "shard_admission":
            now = ray.get(
                self.servers[int(shard)].raise_admission.remote(int(decision.new)),
                timeout=STATS_TIMEOUT_S,
            )
            counting = [c for c in now.values() if c is not None]
            if not counting:
                return f"no table of shard {shard} counts admissions: nothing to raise"
            if max(counting) <= decision.old:
                return (
                    f"shard {shard}'s admission counters count no higher: min_count stays "
                    f"{max(counting)} (a sketch counter's bits are fixed by the job's min_count)"
                )
            self.last_detail = {"admission_min_count": now}
            return None
        if kind == "hot_shard":
            return self._rebalance(int(shard))
        if kind == "ps_shards":
            if decision.new > decision.old:
                return self._split()
            return self._merge(int(decision.metrics["retire"]), int(decision.metrics["into"]))
        return f"knob {decision.knob!r} is not the PS shards'"

    def _elastic(self) -> str | None:
        """Why the shard count cannot change here (``None``: it can)."""
        if self.spawn is None:
            return "no server spawner: the shard count is fixed"
        if self._no_spawn is not None:
            return self._no_spawn
        if self.client is None:
            return "no client of the servers to move slots with"
        try:  # every server must be one the trainers can reach (named, keyed)
            for conn in self.client.clients:
                conn.member()
        except PSError as exc:
            return str(exc)
        return None

    def _split(self) -> str | None:
        """A new server joins and takes 1/(P+1) of every shard's slots."""
        why_not = self._elastic()
        if why_not is not None:
            return why_not
        assert self.client is not None and self.spawn is not None
        try:
            actor, conn = self.spawn()
        except (GetTimeoutError, RayError) as exc:
            # No room in the cluster (or the actor failed): splits stop here.
            self._no_spawn = (
                f"a new PS shard did not start within {self.spawn.timeout_s:g} s "
                f"(room in the cluster for runtime.ray.ps?): {type(exc).__name__}"
            )
            return self._no_spawn
        try:
            slot_map = self.client.refresh_routing()
            slots = split_slots(slot_map.owners, self.client.servers)
            migration = self.client.add_server(conn, slots)
        except BaseException as exc:
            conn.close()
            kill_all([actor])
            if isinstance(exc, PSError):
                return f"split failed, nothing changed: {exc}"
            raise
        self.servers.append(actor)
        self.started.append(actor)
        self._lookups.append(0)
        self._loads.append(0.0)
        self._conn(len(self.servers) - 1).call("slot_loads", {"count": slot_map.slots})
        self._record(migration, "split")
        return None

    def _merge(self, retire: int, into: int) -> str | None:
        """Every slot of server ``retire`` moves to ``into``; it leaves the job and
        is stopped once every rank has moved on (``_reap``)."""
        why_not = self._elastic()
        if why_not is not None:
            return why_not
        assert self.client is not None
        if not (0 <= retire < len(self.servers) and 0 <= into < len(self.servers)):
            return f"merge: shard {retire} or {into} is not one of {len(self.servers)}"
        try:
            migration = self.client.retire_server(retire, into=into)
        except PSError as exc:
            return f"merge failed, nothing changed: {exc}"
        actor = self.servers.pop(retire)
        self._lookups.pop(retire)
        self._loads.pop(retire)
        self.retired.append(actor)
        self._retiring.append(_Retiring(actor, migration))
        self._record(migration, "merge")
        return None

    def _record(self, migration: Migration, kind: str) -> None:
        stats = ray.get([s.table_stats.remote() for s in self.servers], timeout=STATS_TIMEOUT_S)
        memory = [sum(v[1] for v in tables.values()) for tables in stats]
        rows = [sum(v[0] for v in tables.values()) for tables in stats]
        self.last_detail = {
            "migration": {
                **migration.as_dict(),
                "kind": kind,
                "memory_bytes_after": memory,
                "rows_after": rows,
            }
        }
        self.migrations.append(self.last_detail["migration"])
        logger.info(
            "scaling: %s: %d slots (%d rows) moved, %d PS shards now; pause %.1f ms",
            kind,
            migration.slots,
            migration.rows,
            migration.servers,
            migration.pause_ms,
        )

    def _reap(self, *, force: bool = False) -> None:
        """Stop the retired servers every rank has moved on from (all servers
        applied the step after the merge's fence); ``force``: all of them."""
        if not self._retiring:
            return
        applied: dict[str, int] = {}
        if not force and self.client is not None:
            applied = {k: v["applied"] for k, v in self.client.server_stats().items()}
        keep = []
        for r in self._retiring:
            moved_on = all(
                applied.get(t, 0) > step for t, step in r.migration.fence.items() if step > 0
            )
            if force or moved_on:
                with contextlib.suppress(Exception):
                    ray.get(r.actor.shutdown.remote(), timeout=STATS_TIMEOUT_S)
                kill_all([r.actor])
            else:
                keep.append(r)
        self._retiring = keep

    def close(self) -> None:
        """Stop the retired servers not stopped yet."""
        self._reap(force=True)

    def _rebalance(self, hot: int) -> str | None:
        """Move the hot shard's hottest slots to the coldest shard."""
        if self.client is None:
            return "one PS shard: nowhere to move slots to"
        cold = min((p for p in range(len(self.servers)) if p != hot), key=self._loads.__getitem__)
        slot_map = self.client.refresh_routing()
        loads = np.zeros(slot_map.slots, np.int64)
        for p in range(len(self.servers)):  # every server's counts since the last move
            _, arrays = self._conn(p).call("slot_loads")
            if "loads" in arrays and arrays["loads"].size == slot_map.slots:
                loads += arrays["loads"]
        moves = plan_moves(loads, slot_map.owners, hot, cold)
        if moves.hot_load <= 0:
            return f"no lookups counted on shard {hot} since the last move: nothing to plan from"
        if moves.slots.size == 0:
            return self._refine(loads, slot_map, hot, cold, moves)
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

    def _refine(
        self, loads: np.ndarray, slot_map: SlotMap, hot: int, cold: int, moves: Moves
    ) -> str | None:
        """No slot of the hot shard fits the move (one slot carries more than
        half the gap): split every slot into up to 16 (``refine_slots``, up to
        ``MAX_SLOTS_PER_SERVER`` a server) so the next interval can move part
        of that slot's ids; with the map at its finest, say why nothing moved."""
        assert self.client is not None
        owned = np.flatnonzero(slot_map.owners == hot)
        top = int(owned[np.argmax(loads[owned])]) if owned.size else -1
        share = float(loads[top]) / moves.hot_load if top >= 0 and moves.hot_load > 0 else 0.0
        room = MAX_SLOTS_PER_SERVER * slot_map.servers // slot_map.slots
        factor = 1 << min(4, max(0, room.bit_length() - 1))  # a power of two, at most 16
        if factor < 2:
            gap = (moves.hot_load - moves.cold_load) / 2
            return (
                f"no slot of shard {hot} fits the move to shard {cold} (half their gap: "
                f"{gap:g} ids): slot {top} carries {share:.0%} of its load, and the slot map "
                f"is at its finest ({slot_map.slots} slots), so its ids cannot be split further"
            )
        migration = self.client.refine_slots(factor)
        slots = migration.slot_count
        self.client.each(lambda p: self._conn(p).call("slot_loads", {"count": slots}))
        self.last_detail = {
            "migration": {
                **migration.as_dict(),
                "kind": "refine",
                "factor": factor,
                "hot_slot": top,
                "hot_slot_share": round(share, 4),
                "hot_load": moves.hot_load,
                "cold_load": moves.cold_load,
            }
        }
        self.migrations.append(self.last_detail["migration"])
        logger.info(
            "scaling: PS shard %d's slot %d carries %.0f%% of its load: slot map refined "
            "%d -> %d slots (no row moved); pause %.1f ms",
            hot,
            top,
            100 * share,
            slot_map.slots,
            slots,
            migration.pause_ms,
        )
        return None


@dataclass
class PSScaling:
    """The driver's PS scaling manager: its controller and the shards it acts on."""

    controller: Controller
    shards: RayShards

    def close(self) -> None:
        """Stop the controller (writes its timeline), then any retired server."""
        self.controller.close()
        self.shards.close()


def elastic_shards(job: JobSpec) -> bool:
    """Whether the manager may add and retire PS shards: ``runtime.scaling.enabled``
    with a PS memory budget and ``runtime.roles.ps.max`` above ``min`` (either
    data plane)."""
    role = job.runtime.resolved_roles()["ps"]
    return (
        job.runtime.scaling.enabled
        and role.max > role.min
        and job.runtime.shard_range_needs() is None
    )


def spare_shard_cpus(job: JobSpec) -> float:
    """CPUs of the PS shards the manager may add beyond the job's count
    (``runtime.roles.ps.max``), for a local Ray instance the runtime starts."""
    if not elastic_shards(job):
        return 0.0
    role = job.runtime.resolved_roles()["ps"]
    return max(0, role.max - job.runtime.ps_shards) * job.runtime.ray.ps.cpus


def resumed_shard_count(job: JobSpec) -> int | None:
    """The PS shards the newest checkpoint in ``output.dir`` was written with
    (its manifest's ``ps_routing.servers``: a split or merge changed them), when
    the job may add and retire shards (``elastic_shards``) and the count lies
    within ``runtime.roles.ps.min`` and ``max``; else ``None`` (the job's count:
    the rows are split by its map, none lost)."""
    if not elastic_shards(job):
        return None
    try:
        folder = resolve_checkpoint(job.resolve(job.output.dir))
        saved = read_manifest(folder)["metadata"].get(ROUTING_METADATA)
    except (CheckpointError, OSError):
        return None
    if not saved:
        return None
    role, servers = job.runtime.resolved_roles()["ps"], int(saved["servers"])
    return servers if role.min <= servers <= role.max else None


def ps_scaling_manager(
    job: JobSpec,
    servers: Sequence[Any],
    *,
    endpoints: Sequence[Any] = (),
    keys: Sequence[bytes] = (),
    config: ServerConfig | None = None,
    timeout_s: float = 600.0,
) -> PSScaling | None:
    """A started manager over ``servers`` when ``runtime.scaling.enabled`` and
    the PS role has a memory budget or there are two or more shards; else
    ``None``. With ``elastic_shards(job)`` it adds shards (up to
    ``runtime.roles.ps.max``) and merges them (down to ``min``), starting new
    servers with ``config``: over socket clients of ``endpoints`` and ``keys``,
    or on the actor data plane over actor calls (the servers must be named:
    ``server_name``)."""
    spec, budget = job.runtime.scaling, job.runtime.ray.ps.memory_mb
    if not spec.enabled:
        return None
    role = job.runtime.resolved_roles()["ps"]
    if role.max > role.min and (missing := job.runtime.shard_range_needs()):
        # Loaded jobs fail at load (RuntimeSpec.validate); this is for jobs built in code.
        logger.warning(
            "scaling: runtime.roles.ps.max > min, but PS shards are added and retired only with "
            "%s; the job keeps its %d shard(s)",
            missing,
            len(servers),
        )
    if budget is None and len(servers) < 2:
        return None
    bounds = Bounds()
    client: ShardedPSClient | None = None
    spawn: ServerSpawner | None = None
    if elastic_shards(job) and config is not None:
        bounds = Bounds(min_shards=max(1, role.min), max_shards=role.max)
        plane = job.runtime.ray.data_plane
        if plane == "actor":
            client = ShardedPSClient(
                actor_clients(servers, timeout_s=timeout_s), connect=connect_actor
            )
        else:
            client = ShardedPSClient(
                [PSClient(e, k, timeout_s=timeout_s) for e, k in zip(endpoints, keys, strict=True)]
            )
        spawn = ServerSpawner(config, job.runtime.ray.ps, client_timeout_s=timeout_s, plane=plane)
    shards = RayShards(
        servers, None if budget is None else budget * 2**20, client=client, spawn=spawn
    )
    controller = Controller(
        EstuaryPolicy(spec, bounds),
        shards.sample,
        shards,
        interval_s=spec.interval_s,
        hold_intervals=spec.hold_intervals,
        out=job.resolve(job.output.dir) if spec.timeline else None,
        name="scaling_ps",
    ).start()
    return PSScaling(controller, shards)
