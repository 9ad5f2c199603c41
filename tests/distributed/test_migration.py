"""Slot-map routing and migrations between parameter servers
(``estuary.ps.slots``, ``estuary.ps.migration``): moving slots mid-run loses
and doubles nothing, and carries everything a table keeps for a row."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from estuary.config.spec import AdmissionSpec, EvictionSpec
from estuary.embedding import EmbeddingTable
from estuary.embedding.delta import PENDING_COUNTS, PENDING_IDS
from estuary.embedding.hashing import SERVER_SALT, shard_of
from estuary.ps import HostedTable, PSClient, ServerConfig, serving
from estuary.ps.migration import migrate
from estuary.ps.routing import RoutingGate, StaleRoutingError
from estuary.ps.sharded import ShardedPSClient, server_share
from estuary.ps.slots import OWNERS_KEY, SlotMap
from estuary.ps.types import PSError

from .conftest import DIM, SPEC

SEED = 11
STEPS = 10


def hosted(**spec_changes: Any) -> dict[str, HostedTable]:
    return {
        "t": HostedTable(replace(SPEC, **spec_changes), SEED),
        "u": HostedTable(replace(SPEC, shards=2, **spec_changes), SEED + 1),
    }


@contextlib.contextmanager
def cluster(
    n: int, clients: int = 1, world_size: int = 1, **spec_changes: Any
) -> Iterator[list[ShardedPSClient]]:
    """n in-process servers and ``clients`` independent clients of them (one per
    trainer, as separate processes would hold)."""
    tables = {name: server_share(t, n) for name, t in hosted(**spec_changes).items()}
    config = ServerConfig(tables, world_size=world_size, staleness=0, wait_timeout_s=20.0)
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(serving(config)) for _ in range(n)]
        out = []
        for _ in range(clients):
            client = ShardedPSClient(
                [PSClient(s.address, s.authkey, timeout_s=60) for s in started]
            )
            stack.callback(client.close)
            out.append(client)
        yield out


def rank_batches(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [rng.integers(-50, 400, size=48).astype(np.int64) for _ in range(STEPS)]


def run(
    migrate_after: int | None, world_size: int = 2, refine: int = 1
) -> tuple[dict[str, Any], list[Any]]:
    """``world_size`` ranks (threads, each its own client) train STEPS sync steps on
    2 servers; a coordinator client moves half of server 0's slots to server 1
    once rank 0 has pushed step ``migrate_after``, while the ranks go on
    (``refine`` F >= 2: it first splits every slot into F, ``refine_slots``).
    Returns the final states (ids sorted) and the migrations."""
    with cluster(2, clients=world_size + 1, world_size=world_size) as clients:
        coordinator, ranks = clients[0], clients[1:]
        reached, switched = threading.Event(), threading.Event()
        migrations: list[Any] = []
        errors: list[BaseException] = []

        def rank_loop(r: int) -> None:
            try:
                multi = ranks[r]
                tables = multi.tables(rank=r)
                t, u = tables["t"], tables["u"]
                for step, ids in enumerate(rank_batches(r), start=1):
                    if r == 0 and migrate_after is not None and step == migrate_after + 2:
                        hold_for_the_fence(multi, switched)
                    train_step(multi, t, u, ids)
                    if r == 0 and step == migrate_after:
                        reached.set()
                t.wait_applied()
                u.wait_applied()
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        def migrate() -> None:
            try:
                reached.wait(60)
                if refine > 1:
                    migrations.append(coordinator.refine_slots(refine))
                slots = coordinator.slot_map.owned(0)[::2]
                migrations.append(coordinator.migrate(slots, to=1))
                switched.set()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world_size)]
        if migrate_after is not None:
            threads.append(threading.Thread(target=migrate))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        coordinator.refresh_routing()
        tables = coordinator.tables()
        states = {name: sorted_state(t.state_dict(mark_clean=False)) for name, t in tables.items()}
        states["owners"] = [
            {name: t.parts[p].state_dict(mark_clean=False)["ids"] for name, t in tables.items()}
            for p in range(2)
        ]
        states["map"] = coordinator.slot_map
        return states, migrations


def train_step(multi: ShardedPSClient, t: Any, u: Any, ids: np.ndarray) -> None:
    """One sync step of one rank on both tables (``u`` sees the ids reversed)."""
    rev = ids[::-1].copy()
    rows_t, rows_u = multi.lookup_many([t, u], [ids, rev], train=True)
    multi.apply_gradients_many([t, u], [ids, rev], [rows_t * 0.5 + 0.1, rows_u - 0.2])


def hold_for_the_fence(client: ShardedPSClient, switched: threading.Event) -> None:
    """Rank 0 goes on to its next step only once the change fenced the servers
    (or is done), so the change lands mid-run whatever the threads' timing."""
    deadline = time.monotonic() + 60
    while not switched.is_set():
        if any(c.call("routing")[0]["fenced"] for c in client.clients):
            return
        assert time.monotonic() < deadline, "the change never fenced the servers"
        time.sleep(0.001)


def sorted_state(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {
        k: np.asarray(v)[order]
        for k, v in state.items()
        if k in ("ids", "weights") or k.startswith("opt.")
    }


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_the_even_map_routes_as_hash_mod_servers(servers: int) -> None:
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, size=5000).astype(np.int64)
    slot_map = SlotMap.even(servers)
    np.testing.assert_array_equal(slot_map.server_of(ids), shard_of(ids, servers, salt=SERVER_SALT))
    order, offsets = slot_map.route(ids)
    owner = slot_map.server_of(ids)
    for p in range(servers):
        assert (owner[order[offsets[p] : offsets[p + 1]]] == p).all()


def test_a_migration_mid_run_ends_with_the_same_tables_bit_for_bit() -> None:
    plain, none = run(migrate_after=None)
    moved, migrations = run(migrate_after=4)
    assert not none
    (migration,) = migrations
    assert migration.rows > 0 and migration.version == 1 and migration.sources == (0,)
    assert 4 <= migration.fence["t"] < STEPS
    for name in ("t", "u"):
        assert plain[name].keys() == moved[name].keys()
        for key in plain[name]:
            np.testing.assert_array_equal(plain[name][key], moved[name][key], err_msg=key)
    # Every row lives on the server the new map names, and on one server only.
    slot_map = moved["map"]
    assert slot_map.version == 1 and slot_map.counts()[1] > slot_map.counts()[0]
    for p, held in enumerate(moved["owners"]):
        for ids in held.values():
            assert (slot_map.server_of(ids) == p).all()


def test_a_refined_map_keeps_every_id_on_its_server_and_its_slots_move_mid_run() -> None:
    """``refine_slots`` mid-run: slot s of S becomes s, s + S, s + 2S, s + 3S
    with s's owner (no row moves), then half of server 0's finer slots move;
    the tables end bit for bit as without either."""
    ids = np.random.default_rng(1).integers(-(2**62), 2**62, size=5000).astype(np.int64)
    even = SlotMap.even(2)
    fine = even.refined(4)
    assert fine.slots == 4 * even.slots and fine.version == 1
    np.testing.assert_array_equal(fine.slot_of(ids) % even.slots, even.slot_of(ids))
    np.testing.assert_array_equal(fine.server_of(ids), even.server_of(ids))
    with pytest.raises(ValueError, match="factor >= 2"):
        even.refined(1)
    assert even.refined(16).slots == 16 * even.slots  # the finest: 16 x 1,024 a server
    with pytest.raises(ValueError, match="passes the most a map of 2 server"):
        even.refined(32)
    with pytest.raises(ValueError, match="passes the most"):
        even.refined(16).refined(2)

    plain, _ = run(migrate_after=None)
    moved, (refinement, migration) = run(migrate_after=4, refine=4)
    assert refinement.slots == 0 and refinement.rows == 0 and refinement.sources == ()
    assert refinement.slot_count == 4 * even.slots and refinement.version == 1
    assert 4 <= refinement.fence["t"] < STEPS
    assert migration.rows > 0 and migration.version == 2
    assert migration.slot_count == 4 * even.slots
    for name in ("t", "u"):
        for key in plain[name]:
            np.testing.assert_array_equal(plain[name][key], moved[name][key], err_msg=key)
    slot_map = moved["map"]
    assert slot_map.slots == 4 * even.slots and slot_map.version == 2
    for p, held in enumerate(moved["owners"]):
        for held_ids in held.values():
            assert (slot_map.server_of(held_ids) == p).all()


def test_slot_loads_being_counted_follow_a_new_slot_count() -> None:
    """A restored or refined map changes S: the counters restart over it (the
    hot-shard rebalance reads loads of the map's own size); not counting stays
    off."""
    gate = RoutingGate()
    gate.set_map(SlotMap.even(2).refined(16).owners, 2, 1)
    assert gate.take_loads() is None
    gate.count_slots(2048)
    gate.note(np.arange(100, dtype=np.int64))
    gate.set_map(SlotMap.even(2).refined(16).owners, 2, 2)
    loads = gate.take_loads()
    assert loads is not None and loads.size == 16 * 2048 and loads.sum() == 0
    gate.note(np.arange(100, dtype=np.int64))
    assert gate.take_loads().sum() == 100  # type: ignore[union-attr]


def test_a_refinement_moves_no_slot() -> None:
    with cluster(2) as (client,), pytest.raises(PSError, match="a refinement moves no slot"):
        migrate(client, [0], 1, refine=2)


def test_a_migration_carries_every_field_a_row_keeps() -> None:
    changes = {
        "eviction": EvictionSpec(policy="lfu", capacity_rows=4000),
        "admission": AdmissionSpec(min_count=2, counter="exact"),
    }
    with cluster(2, **changes) as (client,):
        tables = client.tables()
        rng = np.random.default_rng(3)
        for _ in range(6):
            ids = rng.integers(0, 300, size=64).astype(np.int64)
            rows = client.lookup_many([tables["t"], tables["u"]], [ids, ids], train=True)
            client.apply_gradients_many([tables["t"], tables["u"]], [ids, ids], rows)
        before = {n: t.state_dict(mark_clean=False) for n, t in tables.items()}
        migration = client.migrate(client.slot_map.owned(1), to=0)  # merge: all of server 1
        after = {n: t.state_dict(mark_clean=False) for n, t in tables.items()}
        assert migration.pending > 0 and migration.rows > 0
        for name in tables:
            b, a = before[name], after[name]
            ob, oa = np.argsort(b["ids"]), np.argsort(a["ids"])
            for key in b:
                if key in ("ids", "weights", "evict.stamp", "evict.freq") or key.startswith("opt."):
                    np.testing.assert_array_equal(b[key][ob], a[key][oa], err_msg=key)
            pb, pa = np.argsort(b[PENDING_IDS]), np.argsort(a[PENDING_IDS])
            np.testing.assert_array_equal(b[PENDING_IDS][pb], a[PENDING_IDS][pa])
            np.testing.assert_array_equal(b[PENDING_COUNTS][pb], a[PENDING_COUNTS][pa])
            assert tables[name].parts[1].state_dict(mark_clean=False)["ids"].size == 0


@pytest.mark.parametrize("evicting", [False, True])
def test_a_delta_across_a_migration_restores_the_table(evicting: bool) -> None:
    changes = {"eviction": EvictionSpec(policy="lru", capacity_rows=4000)} if evicting else {}
    with cluster(2, **changes) as (client,):
        table = client.table("u")
        rng = np.random.default_rng(4)

        def steps(n: int) -> None:
            for _ in range(n):
                ids = rng.integers(0, 200, size=32).astype(np.int64)
                table.apply_gradients(ids, table.lookup(ids, train=True) + 0.3)

        steps(3)
        base = table.state_dict()  # marks: the delta holds what changes after
        steps(2)
        client.migrate(client.slot_map.owned(0)[1::2], to=1)
        steps(2)
        delta = table.delta_state_dict()
        want = sorted_state(table.state_dict(mark_clean=False))
    local = EmbeddingTable(replace(SPEC, shards=3, **changes), seed=SEED + 1, name="u")
    local.load_state_dict(base)
    local.apply_delta(delta)  # the routing keys are no part of a table's rows
    got = sorted_state(local.state_dict())
    for key in want:
        np.testing.assert_array_equal(want[key], got[key], err_msg=key)


def test_a_state_saved_after_a_migration_resumes_with_its_map() -> None:
    with cluster(2) as (client,):
        table = client.table("t")
        ids = np.arange(0, 120, dtype=np.int64)
        table.apply_gradients(ids, table.lookup(ids, train=True) + 1.0)
        client.migrate(client.slot_map.owned(0)[:300], to=1)
        state = table.state_dict()
        saved_map = client.slot_map
    assert OWNERS_KEY in state
    with cluster(2) as (fresh,):
        table = fresh.table("t")
        table.load_state_dict(state)
        assert fresh.slot_map == saved_map
        for p in range(2):
            held = table.parts[p].state_dict(mark_clean=False)["ids"]
            assert (saved_map.server_of(held) == p).all()
        np.testing.assert_array_equal(table.lookup(ids, train=False), sorted_lookup(state, ids))
    with cluster(3) as (other,):  # another server count: the even map, same rows
        table = other.table("t")
        table.load_state_dict(state)
        assert other.slot_map.version == 0
        np.testing.assert_array_equal(table.lookup(ids, train=False), sorted_lookup(state, ids))


def sorted_lookup(state: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    order = np.argsort(state["ids"])
    at = np.searchsorted(state["ids"][order], ids)
    return np.asarray(state["weights"])[order][at]


def test_a_lookup_routed_with_an_old_map_is_refused_then_routed_again() -> None:
    with cluster(2, clients=2) as (mover, stale):
        table = stale.table("t")
        ids = np.arange(0, 64, dtype=np.int64)
        want = table.lookup(ids, train=True)
        table.apply_gradients(ids, np.zeros((ids.size, DIM), np.float32))
        mover.migrate(mover.slot_map.owned(1), to=0)
        assert stale.slot_map.version == 0
        with pytest.raises(StaleRoutingError):  # the raw call names the stale version
            stale.clients[0].lookup_many([table.parts[0]], [ids], train=False, routing=0)
        got = table.lookup(ids, train=False)  # fetches map 1 and goes again
        assert stale.slot_map.version == 1
        np.testing.assert_array_equal(got, want)


def test_a_raised_fence_lets_a_waiting_lookup_through() -> None:
    # Server B is fenced at step 18 before a lookup of step 19 reaches it; server
    # A had served 19 already, so the coordinator raises B's fence to 19: the
    # waiting lookup must go on (else step 19 is never pushed: a deadlock).
    gate = RoutingGate()
    gate.admit(["t"], [18], 0, 1.0)
    assert gate.fence(["t"], None) == {"t": 18}
    passed = threading.Event()

    def lookup() -> None:
        gate.admit(["t"], [19], 0, 30.0)
        passed.set()

    thread = threading.Thread(target=lookup)
    thread.start()
    assert not passed.wait(0.2)  # held at the fence
    assert gate.fence(["t"], {"t": 19}) == {"t": 19}
    assert passed.wait(30)
    thread.join()
    gate.lift()
    with pytest.raises(StaleRoutingError):
        gate.set_map(np.zeros(4, np.int64), 1, 1)
        gate.admit(["t"], [20], 0, 1.0)


def test_a_capture_holding_the_map_never_straddles_a_migration() -> None:
    with cluster(2, clients=2) as (mover, trainer):
        table = trainer.table("u")
        ids = np.arange(0, 300, dtype=np.int64)
        table.apply_gradients(ids, table.lookup(ids, train=True) + 1.0)
        moved = threading.Event()

        def migrate() -> None:
            mover.migrate(mover.slot_map.owned(0), to=1)
            moved.set()

        with trainer.holding():  # as a checkpoint capture does
            thread = threading.Thread(target=migrate)
            thread.start()
            assert not moved.wait(0.3)  # the rows wait for the capture to end
            parts = [p.state_dict(mark_clean=False)["ids"] for p in table.parts]
        assert moved.wait(30)
        thread.join()
        # Every id once, all on their old servers: the capture saw no move.
        held = np.concatenate(parts)
        assert held.size == np.unique(held).size == ids.size
        assert (SlotMap.even(2).server_of(parts[0]) == 0).all() and parts[0].size > 0
        after = [p.state_dict(mark_clean=False)["ids"] for p in table.parts]
        assert after[0].size == 0 and np.sort(after[1]).tolist() == ids.tolist()
        # A merged state taken after the move has every row once.
        assert np.sort(table.state_dict()["ids"]).tolist() == ids.tolist()
