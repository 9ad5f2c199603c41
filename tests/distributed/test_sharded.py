"""Tables split across several parameter servers (``runtime.ps_shards``): the
same rows, steps and checkpoints as one server, states that load across any
server or shard count, every step on every server."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from estuary.config.spec import AdmissionSpec, EvictionSpec
from estuary.embedding import EmbeddingTable
from estuary.embedding.delta import EVICTED_IDS, is_full
from estuary.embedding.hashing import SERVER_SALT, shard_of
from estuary.ps import HostedTable, PSClient, ServerConfig, serving
from estuary.ps.sharded import ShardedPSClient, ShardedTable, server_share

from .conftest import DIM, SPEC

SEED = 5


def hosted(**spec_changes: Any) -> dict[str, HostedTable]:
    return {
        "t": HostedTable(replace(SPEC, **spec_changes), SEED),
        "u": HostedTable(replace(SPEC, shards=2, **spec_changes), SEED + 1),
    }


@contextlib.contextmanager
def servers(n: int, world_size: int = 1, **spec_changes: Any) -> Iterator[ShardedPSClient]:
    """n in-process servers, each hosting its share of every table."""
    tables = {name: server_share(t, n) for name, t in hosted(**spec_changes).items()}
    config = ServerConfig(tables, world_size=world_size, staleness=0, wait_timeout_s=10.0)
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(serving(config)) for _ in range(n)]
        client = ShardedPSClient([PSClient(s.address, s.authkey, timeout_s=30) for s in started])
        stack.callback(client.close)
        yield client


@contextlib.contextmanager
def one_server(world_size: int = 1, **spec_changes: Any) -> Iterator[PSClient]:
    config = ServerConfig(hosted(**spec_changes), world_size=world_size, staleness=0)
    with serving(config) as server:
        client = PSClient(server.address, server.authkey, timeout_s=30)
        yield client
        client.close()


def batches(steps: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Repeats within a batch and across steps; negative ids too.
    return [rng.integers(-40, 200, size=64).astype(np.int64) for _ in range(steps)]


def train(tables: dict[str, Any], multi: Any, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Lookup -> a gradient that depends on the rows -> push, for every step;
    returns each step's looked-up rows of table 't' and 'u'."""
    seen = []
    for ids in batches(steps, seed):
        t, u = tables["t"], tables["u"]
        rows_t, rows_u = multi.lookup_many([t, u], [ids, ids[::-1].copy()], train=True)
        seen += [rows_t.copy(), rows_u.copy()]
        multi.apply_gradients_many(
            [t, u], [ids, ids[::-1].copy()], [rows_t * 0.5 + 0.1, rows_u - 0.2], [1.0, 0.5]
        )
    for table in tables.values():
        table.wait_applied()
    return seen


def lookup_all(table: Any, ids: np.ndarray) -> np.ndarray:
    return np.asarray(table.lookup(ids, train=False))


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_training_equals_one_server_row_for_row(n: int) -> None:
    probe = np.arange(-40, 200, dtype=np.int64)
    with one_server() as single:
        tables = single.tables()
        want = train(tables, single, steps=12)
        want_rows = [lookup_all(tables[k], probe) for k in ("t", "u")]
        want_stats = tables["t"].stats()
    with servers(n) as sharded:
        tables = sharded.tables()
        assert isinstance(tables["t"], ShardedTable)
        got = train(tables, sharded, steps=12)
        got_rows = [lookup_all(tables[k], probe) for k in ("t", "u")]
        got_stats = tables["t"].stats()
        per_server_rows = [part.stats().rows for part in tables["t"].parts]
        assert sharded.server_stats()["t"]["applied"] == 12
    for a, b in zip(want + want_rows, got + got_rows, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (got_stats.rows, got_stats.lookups, got_stats.admissions) == (
        want_stats.rows,
        want_stats.lookups,
        want_stats.admissions,
    )
    # The ids really are spread: every server holds some, and only its own.
    assert all(rows > 0 for rows in per_server_rows)
    assert sum(per_server_rows) == want_stats.rows


def test_each_server_holds_exactly_the_ids_it_owns() -> None:
    with servers(3) as sharded:
        tables = sharded.tables()
        train(tables, sharded, steps=3)
        for p, part in enumerate(tables["t"].parts):
            ids = part.state_dict()["ids"]
            assert ids.size > 0
            assert set(shard_of(ids, 3, salt=SERVER_SALT).tolist()) == {p}


def test_two_ranks_push_every_step_once_on_every_server() -> None:
    with servers(2, world_size=2) as sharded, one_server(world_size=2) as single:
        rank_tables = [sharded.tables(rank=r, grad_scale=0.5) for r in (0, 1)]
        single_tables = [single.tables(rank=r, grad_scale=0.5) for r in (0, 1)]
        ids = [np.array([1, 2, 3, 99], np.int64), np.array([3, 4, 5], np.int64)]

        def rank_step(tables: dict[str, Any], multi: Any, r: int) -> None:
            rows = multi.lookup_many([tables["t"]], [ids[r]], train=True)[0]
            multi.apply_gradients_many([tables["t"]], [ids[r]], [rows + 1.0])

        for tables, multi in ((rank_tables, sharded), (single_tables, single)):
            threads = [
                threading.Thread(target=rank_step, args=(tables[r], multi, r)) for r in (0, 1)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            tables[0]["t"].wait_applied()
        # A retried push of step 1 is a duplicate on every server.
        grads = np.zeros((ids[0].size, DIM), np.float32)
        assert rank_tables[0]["t"].push(1, ids[0], grads) is False
        probe = np.arange(0, 100, dtype=np.int64)
        np.testing.assert_array_equal(
            lookup_all(rank_tables[0]["t"], probe), lookup_all(single_tables[0]["t"], probe)
        )
        stats = sharded.server_stats()["t"]
        assert stats["applied"] == 1
        assert stats["duplicates"] == 2  # one per server


def test_a_sharded_state_loads_into_one_table_and_back() -> None:
    probe = np.arange(-40, 200, dtype=np.int64)
    with servers(2) as sharded:
        tables = sharded.tables()
        train(tables, sharded, steps=6)
        state = tables["u"].state_dict()
        want = lookup_all(tables["u"], probe)
    # 2 servers x 2 shards: the unknown rows stack to 4.
    assert state["unknown.weights"].shape[0] == 4
    for shards in (1, 4, 3):
        local = EmbeddingTable(replace(SPEC, shards=shards), SEED + 1, "u")
        local.load_state_dict(state)
        if shards == 4:  # the same shard count: every unknown row comes back
            np.testing.assert_array_equal(lookup_all(local, probe), want)
        else:  # unknown ids read an averaged unknown row; known ids are exact
            known = np.isin(probe, state["ids"])
            np.testing.assert_array_equal(lookup_all(local, probe)[known], want[known])
        # ... and back onto three servers.
        with servers(3) as other:
            table = other.tables()["u"]
            table.load_state_dict(local.state_dict())
            known = np.isin(probe, state["ids"])
            np.testing.assert_array_equal(lookup_all(table, probe)[known], want[known])
            assert len(table) == state["ids"].size


def test_deltas_from_servers_replay_onto_another_server_count() -> None:
    probe = np.arange(-40, 200, dtype=np.int64)
    with servers(2, eviction=EvictionSpec(capacity_rows=120)) as sharded:
        tables = sharded.tables()
        train(tables, sharded, steps=4, seed=1)
        base = tables["t"].state_dict()
        train(tables, sharded, steps=4, seed=2)
        delta = tables["t"].delta_state_dict()
        want = lookup_all(tables["t"], probe)
        version = int(delta["delta.version"][0])
    assert not is_full(delta) and EVICTED_IDS in delta
    for n in (1, 3):
        with servers(n, eviction=EvictionSpec(capacity_rows=120)) as other:
            table = other.tables()["t"]
            table.load_state_dict(base)
            table.apply_delta(delta)
            state = table.state_dict()
            # Every server adopted the chain: this state continues it.
            assert int(state["delta.version"][0]) == version + 1
            known = np.isin(probe, state["ids"])
            assert known.sum() > 100
            np.testing.assert_array_equal(lookup_all(table, probe)[known], want[known])
    local = EmbeddingTable(replace(SPEC, eviction=EvictionSpec(capacity_rows=120)), SEED, "t")
    local.load_state_dict(base)
    local.apply_delta(delta)
    known = np.isin(probe, local.state_dict()["ids"])
    np.testing.assert_array_equal(lookup_all(local, probe)[known], want[known])


def test_capacity_is_split_between_servers() -> None:
    table = HostedTable(replace(SPEC, eviction=EvictionSpec(capacity_rows=101)), SEED)
    assert server_share(table, 4).spec.eviction.capacity_rows == 26
    assert server_share(table, 1) is table
    with servers(2, eviction=EvictionSpec(capacity_rows=40)) as sharded:
        tables = sharded.tables()
        train(tables, sharded, steps=6)
        assert len(tables["t"]) <= 40
        assert all(part.stats().rows <= 20 for part in tables["t"].parts)


def test_admission_counts_live_where_the_id_lives() -> None:
    probe = np.arange(-40, 200, dtype=np.int64)
    # Exact counts: a sketch's collisions (false admissions) differ with the server count.
    spec = {"admission": AdmissionSpec(min_count=2, counter="exact")}
    with one_server(**spec) as single:
        tables = single.tables()
        train(tables, single, steps=5)
        want = (lookup_all(tables["t"], probe), tables["t"].stats())
        admitted = np.isin(probe, tables["t"].state_dict()["ids"])
    with servers(2, **spec) as sharded:
        tables = sharded.tables()
        train(tables, sharded, steps=5)
        got = (lookup_all(tables["t"], probe), tables["t"].stats())
    # Admitted ids have their own rows, the same; the others read their
    # server's unknown row (one per shard, as with a table's own shards).
    assert 0 < admitted.sum() < probe.size
    np.testing.assert_array_equal(want[0][admitted], got[0][admitted])
    assert (want[1].rows, want[1].pending_ids) == (got[1].rows, got[1].pending_ids)
