"""Splitting and merging parameter-server shards mid-run
(``ShardedPSClient.add_server`` / ``retire_server``, ``estuary.ps.migration``):
a server joins or leaves between two steps while W ranks train, and the run
ends with the same tables, bit for bit, as one without."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from estuary.embedding import EmbeddingTable
from estuary.ps import ParameterServer, PSClient, PSError, ServerConfig, serving
from estuary.ps.migration import member
from estuary.ps.sharded import ShardedPSClient, server_share
from estuary.ps.snapshots import ServerSnapshot

from .conftest import SPEC
from .test_migration import (
    SEED,
    STEPS,
    hold_for_the_fence,
    hosted,
    rank_batches,
    sorted_state,
    train_step,
)

WORLD = 2


def config(servers: int, world_size: int = WORLD, staleness: int = 0) -> ServerConfig:
    tables = {name: server_share(t, servers) for name, t in hosted().items()}
    return ServerConfig(tables, world_size=world_size, staleness=staleness, wait_timeout_s=20.0)


def connect(server: ParameterServer) -> PSClient:
    return PSClient(server.address, server.authkey, timeout_s=60)


@contextlib.contextmanager
def servers(
    n: int, spare: int = 0, world_size: int = WORLD, staleness: int = 0
) -> Iterator[list[ParameterServer]]:
    """n + spare in-process servers (the spare ones for joining later)."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(serving(config(n + 1, world_size, staleness)))
            for _ in range(n + spare)
        ]


def train(
    start: int, change: str | None, change_after: int = 4, staleness: int = 0
) -> tuple[dict[str, Any], list[Any], list[int]]:
    """WORLD ranks (threads, each its own client) train STEPS sync steps on
    ``start`` servers; once rank 0 pushed step ``change_after`` a coordinator
    client adds a server (``"split"``) or retires server 0 (``"merge"``, then
    stops it once the ranks moved on). Returns the final states, the
    migrations and each rank's server count at the end."""
    with servers(start, spare=int(change == "split"), staleness=staleness) as started:
        running, spare = started[:start], started[start:]
        with contextlib.ExitStack() as stack:
            clients = []
            for _ in range(WORLD + 1):
                client = ShardedPSClient([connect(s) for s in running])
                stack.callback(client.close)
                clients.append(client)
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
                        if r == 0 and change is not None and step == change_after + 2:
                            hold_for_the_fence(multi, switched)
                        train_step(multi, t, u, ids)
                        if r == 0 and step == change_after:
                            reached.set()
                    t.wait_applied()
                    u.wait_applied()
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            def resize() -> None:
                try:
                    reached.wait(60)
                    if change == "split":
                        migrations.append(coordinator.add_server(connect(spare[0])))
                        switched.set()
                    else:
                        migration = coordinator.retire_server(0)
                        migrations.append(migration)
                        switched.set()
                        coordinator.wait_moved_on(migration)
                        running[0].close()  # no rank may send it anything now
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(WORLD)]
            if change is not None:
                threads.append(threading.Thread(target=resize))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert not errors, errors
            coordinator.refresh_routing()
            tables = coordinator.tables()
            states: dict[str, Any] = {
                name: sorted_state(t.state_dict(mark_clean=False)) for name, t in tables.items()
            }
            slot_map = coordinator.slot_map
            states["map"] = slot_map
            states["held"] = [
                {name: t.parts[p].state_dict(mark_clean=False)["ids"] for name, t in tables.items()}
                for p in range(coordinator.servers)
            ]
            return states, migrations, [r.servers for r in ranks]


def assert_same_tables(want: dict[str, Any], got: dict[str, Any]) -> None:
    for name in ("t", "u"):
        assert want[name].keys() == got[name].keys()
        for key in want[name]:
            np.testing.assert_array_equal(want[name][key], got[name][key], err_msg=f"{name} {key}")


def assert_rows_where_the_map_says(states: dict[str, Any]) -> None:
    slot_map = states["map"]
    assert len(states["held"]) == slot_map.servers
    for p, held in enumerate(states["held"]):
        for ids in held.values():
            assert (slot_map.server_of(ids) == p).all()


def test_a_split_mid_run_ends_with_the_same_tables_bit_for_bit() -> None:
    plain, _, _ = train(2, None)
    split, (migration,), rank_servers = train(2, "split")
    assert migration.servers == 3 and migration.to == 2 and migration.rows > 0
    assert 4 <= migration.fence["t"] < STEPS
    assert rank_servers == [3, 3]  # every rank connected to the new server
    assert_same_tables(plain, split)
    assert_rows_where_the_map_says(split)
    assert split["map"].counts()[2] > 0 and all(ids.size for ids in split["held"][2].values())


def test_a_merge_mid_run_ends_with_the_same_tables_bit_for_bit() -> None:
    plain, _, _ = train(2, None)
    merged, (migration,), rank_servers = train(3, "merge")
    assert migration.servers == 2 and migration.retired == 0 and migration.rows > 0
    assert rank_servers == [2, 2]  # every rank dropped the retired server
    assert_same_tables(plain, merged)
    assert_rows_where_the_map_says(merged)


def test_a_split_and_a_merge_in_hybrid_mode_lose_no_row() -> None:
    # Staleness 1: a lookup may run a step ahead of the last applied one; the
    # tables then depend on timing, but every id trained is there once, where
    # the map says, and the ranks end at the new count.
    want = np.unique(np.concatenate([b for r in range(WORLD) for b in rank_batches(r)]))
    for start, change, count in ((2, "split", 3), (3, "merge", 2)):
        states, (migration,), rank_servers = train(start, change, staleness=1)
        assert migration.servers == count and rank_servers == [count] * WORLD
        assert_rows_where_the_map_says(states)
        np.testing.assert_array_equal(states["t"]["ids"], want)


def test_checkpoints_across_a_split_and_a_merge_load_into_any_server_count() -> None:
    with servers(2, spare=1, world_size=1) as (a, b, c):
        client = ShardedPSClient([connect(a), connect(b)])
        try:
            table = client.table("u")
            rng = np.random.default_rng(4)

            def steps(n: int) -> None:
                for _ in range(n):
                    ids = rng.integers(0, 200, size=32).astype(np.int64)
                    table.apply_gradients(ids, table.lookup(ids, train=True) + 0.3)

            steps(3)
            base = table.state_dict()  # marks: the deltas hold what changes after
            steps(2)
            client.add_server(connect(c))
            assert len(table.parts) == 3  # the table handed out got its part there
            steps(2)
            split_delta = table.delta_state_dict()
            assert np.isin(
                table.parts[2].state_dict(mark_clean=False)["ids"], split_delta["ids"]
            ).all()
            client.retire_server(1)
            assert len(table.parts) == 2 and client.servers == 2
            steps(2)
            merge_delta = table.delta_state_dict()
            want = sorted_state(table.state_dict(mark_clean=False))
        finally:
            client.close()
    local = EmbeddingTable(replace(SPEC, shards=2), seed=SEED + 1, name="u")
    local.load_state_dict(base)
    local.apply_delta(split_delta)
    local.apply_delta(merge_delta)
    got = sorted_state(local.state_dict())
    for key in want:
        np.testing.assert_array_equal(want[key], got[key], err_msg=key)
    for count in (1, 3):  # the merged state loads into another server count
        with servers(count, world_size=1) as fresh:
            other = ShardedPSClient([connect(s) for s in fresh])
            try:
                loaded = other.table("u")
                loaded.load_state_dict(local.state_dict())
                ids = want["ids"]
                np.testing.assert_array_equal(loaded.lookup(ids, train=False), want["weights"])
            finally:
                other.close()


def test_an_idle_client_finds_its_way_after_server_0_retired_and_stopped() -> None:
    with servers(3, world_size=1) as started:
        mover = ShardedPSClient([connect(s) for s in started])
        idle = ShardedPSClient([connect(s) for s in started])
        try:
            ids = np.arange(0, 150, dtype=np.int64)
            table = idle.table("t")
            want = table.lookup(ids, train=True)
            table.apply_gradients(ids, np.zeros_like(want))
            mover.retire_server(0)
            started[0].close()
            # Its first server is gone: it asks the next for the map, drops server 0.
            np.testing.assert_array_equal(table.lookup(ids, train=False), want)
            assert idle.servers == 2 and len(table.parts) == 2
        finally:
            mover.close()
            idle.close()


def test_a_client_without_a_socket_key_cannot_name_a_member() -> None:
    # An actor-plane client (ActorPSClient) has no key the socket clients could use.
    with pytest.raises(PSError, match="no socket address and key"):
        member(PSClient("ray actor X", b""))


def test_a_server_of_another_world_size_is_refused_and_nothing_changes() -> None:
    with servers(2, world_size=1) as started, serving(config(3, world_size=2)) as other:
        client = ShardedPSClient([connect(s) for s in started])
        try:
            table = client.table("t")
            ids = np.arange(0, 80, dtype=np.int64)
            want = table.lookup(ids, train=True)
            table.apply_gradients(ids, np.zeros_like(want))
            with pytest.raises(PSError, match="world_size is 2, the job's 1"):
                client.add_server(connect(other))
            assert client.servers == 2 and client.slot_map.version == 0
            np.testing.assert_array_equal(table.lookup(ids, train=True), want)  # not fenced
        finally:
            client.close()


def test_a_client_that_missed_a_split_checkpoints_the_new_servers_rows_too() -> None:
    # A trainer checkpoints after a split but before its next lookup: its
    # capture must take in the server that joined (it holds moved rows).
    with servers(2, spare=1, world_size=1) as (a, b, c):
        mover = ShardedPSClient([connect(a), connect(b)])
        trainer = ShardedPSClient([connect(a), connect(b)])
        loader = ShardedPSClient([connect(a), connect(b)])
        try:
            stale = loader.table("t")
            table = trainer.table("t")
            ids = np.arange(0, 300, dtype=np.int64)
            table.apply_gradients(ids, table.lookup(ids, train=True) + 1.0)
            want = sorted_state(table.state_dict(mark_clean=False))
            migration = mover.add_server(connect(c))
            assert migration.rows > 0 and trainer.servers == 2
            snap = ServerSnapshot({"t": table}, delta=False)  # asynchronous: registers
            assert trainer.servers == 3 and snap.parts == {"t": 3}
            snap.drop()
            got = sorted_state(table.state_dict())
            assert trainer.servers == 3 and len(table.parts) == 3
            for key in want:
                np.testing.assert_array_equal(want[key], got[key], err_msg=key)
            # A load by another client that missed it routes by the servers' map.
            stale.load_state_dict(table.state_dict(mark_clean=False))
            slot_map = trainer.slot_map
            for p, part in enumerate(stale.parts):
                held = part.state_dict(mark_clean=False)["ids"]
                assert held.size and (slot_map.server_of(held) == p).all()
        finally:
            mover.close()
            trainer.close()
            loader.close()


@pytest.mark.parametrize("compact_below", [0.75, 0.0])
def test_a_splits_source_gives_its_table_memory_back(compact_below: float) -> None:
    ids = np.arange(-2000, 6000, dtype=np.int64)
    setting = replace(config(2, world_size=1), compact_below=compact_below)
    with serving(setting) as a, serving(setting) as b:
        client = ShardedPSClient([connect(a)])
        try:
            tables = client.tables()
            for table in tables.values():
                table.apply_gradients(ids, table.lookup(ids, train=True) + 0.5)
            want = {n: t.lookup(ids, train=False) for n, t in tables.items()}
            held = {n: a.tables[n].stats().bytes for n in tables}
            allocated = {n: a.tables[n].allocated_rows for n in tables}
            migration = client.add_server(connect(b))  # half of server 0's slots
            for name, table in tables.items():
                np.testing.assert_array_equal(table.lookup(ids, train=False), want[name])
                source = a.tables[name]
                if compact_below:  # about half the rows left: the arrays follow
                    # (the bytes count the log of the ids dropped, 8 B each, too)
                    assert source.stats().bytes < 0.75 * held[name]
                    assert source.allocated_rows < 0.65 * allocated[name]
                else:
                    assert source.allocated_rows == allocated[name]
            assert (migration.freed_bytes > 0) == (compact_below > 0)
            table = tables["u"]  # trains on as before, on both servers
            table.apply_gradients(ids, table.lookup(ids, train=True) - 0.25)
            assert len(a.tables["u"]) + len(b.tables["u"]) == ids.size
            kept = b.tables["u"].allocated_rows
            client.retire_server(1)  # a merge: the leaving server drops all, keeps its arrays
            assert len(b.tables["u"]) == 0 and b.tables["u"].allocated_rows == kept
            np.testing.assert_array_equal(tables["t"].lookup(ids, train=False), want["t"])
        finally:
            client.close()
