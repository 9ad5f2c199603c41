"""Batched parameter-server requests: ``lookup_many`` / ``push_many`` carry every
table of a step in one request and must leave exactly what per-table requests
leave (rows, tables, step counters); an error in one table names it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from estuary.data.types import JaggedIds
from estuary.embedding import EmbeddingTable
from estuary.nn.embedding_collection import EmbeddingCollection
from estuary.ps import PSClient, PSError, PSTimeoutError, serving, sum_by_id
from estuary.train.sparse_updates import LockedStore, SparseUpdater

from .conftest import DIM
from .test_server import SEED, SPEC, config, rng_grads

NAMES = ["t", "u"]  # one shard, three shards


@pytest.fixture
def client() -> Iterator[PSClient]:
    with serving(config()) as server:
        c = PSClient(server.address, server.authkey, timeout_s=30)
        yield c
        c.close()


def step_ids(step: int, rank: int, table: int) -> np.ndarray:
    # Overlapping ids across ranks and steps, some new each step.
    rng = np.random.default_rng([step, rank, table])
    return np.unique(rng.integers(-20, 40 + 10 * step, size=25)).astype(np.int64)


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {k: state[k][order] for k in ("ids", "weights", "opt.accum")}


def test_batched_requests_equal_per_table_requests() -> None:
    #   server A: each step, each rank ONE lookup_many + ONE apply_gradients_many
    #   server B: the same ids and gradients, one lookup / push per table
    #   -> identical rows at every lookup, identical tables and step counters.
    with serving(config()) as srv_a, serving(config()) as srv_b:
        batched = PSClient(srv_a.address, srv_a.authkey, timeout_s=30)
        single = PSClient(srv_b.address, srv_b.authkey, timeout_s=30)
        a = [batched.tables(rank=r, grad_scale=0.5) for r in range(2)]
        b = [single.tables(rank=r, grad_scale=0.5) for r in range(2)]
        for step in range(1, 5):
            ids = [[step_ids(step, r, i) for i in range(len(NAMES))] for r in range(2)]
            for r in range(2):
                got = batched.lookup_many([a[r][n] for n in NAMES], ids[r], train=True)
                for name, ids_t, rows in zip(NAMES, ids[r], got, strict=True):
                    np.testing.assert_array_equal(rows, b[r][name].lookup(ids_t, train=True))
            for r in range(2):
                grads = [rng_grads(i.size, 100 * step + r) for i in ids[r]]
                batched.apply_gradients_many([a[r][n] for n in NAMES], ids[r], grads)
                for name, ids_t, g in zip(NAMES, ids[r], grads, strict=True):
                    b[r][name].apply_gradients(ids_t, g)
        probe = [np.arange(-30, 90, dtype=np.int64)] * len(NAMES)
        # Eval lookups, into caller buffers: consecutive slices of one block.
        block = np.full((2 * probe[0].size, DIM), np.nan, np.float32)
        out = [block[: probe[0].size], block[probe[0].size :]]
        got = batched.lookup_many([a[0][n] for n in NAMES], probe, train=False, out=out)
        assert all(g is o for g, o in zip(got, out, strict=True))
        for name, ids_t, rows in zip(NAMES, probe, got, strict=True):
            np.testing.assert_array_equal(rows, b[0][name].lookup(ids_t, train=False))
            want, have = by_id(b[1][name].state_dict()), by_id(a[1][name].state_dict())
            for key in want:
                np.testing.assert_array_equal(have[key], want[key])
        assert batched.server_stats() == single.server_stats()
        assert {s["applied"] for s in batched.server_stats().values()} == {4}
        batched.close()
        single.close()


def test_batched_and_per_table_calls_share_each_tables_step_counter(client: PSClient) -> None:
    r0, r1 = client.tables(rank=0), client.tables(rank=1)
    both = [r0[n] for n in NAMES]
    ids = [np.arange(3, dtype=np.int64)] * 2
    # Step 1: rank 0 batched, rank 1 per table.
    client.lookup_many(both, ids, train=True)
    client.apply_gradients_many(both, ids, [rng_grads(3, 0)] * 2)
    for name in NAMES:
        r1[name].lookup(ids[0], train=True)
        r1[name].apply_gradients(ids[0], rng_grads(3, 1))
    # Step 2 of "t" alone, per table on rank 0: its counters continue from the batch.
    r0["t"].lookup(ids[0], train=True)  # needs step 1 applied: it is
    r0["t"].apply_gradients(ids[0], rng_grads(3, 2))
    assert [t.pushed for t in both] == [2, 1]
    assert client.push_many(both, [1, 1], ids, [rng_grads(3, 9)] * 2) == [False, False]  # retries
    stats = client.server_stats()
    assert [stats[n]["duplicates"] for n in NAMES] == [1, 1]
    assert [stats[n]["applied"] for n in NAMES] == [1, 1]  # step 2 of "t" awaits rank 1


def test_an_unknown_table_fails_the_whole_request_before_any_table_changes(
    client: PSClient,
) -> None:
    ids = np.arange(4, dtype=np.int64)
    fields: dict[str, Any] = {"tables": ["t", "nope"], "train": True, "counts": [4, 4]}
    fields["steps"] = [1, 1]
    with pytest.raises(PSError, match=r"unknown table 'nope'"):
        client.call("lookup_many", fields, {"ids": np.concatenate([ids, ids])})
    assert len(client.table("t")) == 0  # nothing inserted into "t"
    with pytest.raises(PSError, match=r"'counts' \[4, 3\] does not split the 8 ids"):
        client.call(
            "lookup_many",
            {**fields, "tables": ["t", "u"], "counts": [4, 3]},
            {"ids": np.concatenate([ids, ids])},
        )
    assert client.hello()["world_size"] == 2  # the connection is still usable


def test_a_failing_table_in_a_push_is_named_and_a_retry_is_safe(client: PSClient) -> None:
    tables = client.tables(rank=0)
    both = [tables[n] for n in NAMES]
    ids = [np.arange(5, dtype=np.int64)] * 2
    grads = [rng_grads(5, 0), rng_grads(5, 1)]
    with pytest.raises(ValueError, match=r"table 'u': grads must have shape \(5, 4\)"):
        client.push_many(both, [1, 1], ids, [grads[0], grads[1][:, :3]])
    # Step 100 of "u" is too far ahead: "t" (pushed first) is in, "u" is refused.
    with pytest.raises(PSError, match=r"table 'u': push of step 100 is more than 64 steps"):
        client.push_many(both, [1, 100], ids, grads)
    assert client.push_many(both, [1, 1], ids, grads) == [False, True]  # the retry
    assert client.server_stats()["t"]["duplicates"] == 1
    with pytest.raises(PSError, match=r"table 'u': step 0 \(must be >= 1\)"):
        client.push_many(both, [2, 0], ids, grads)
    assert client.server_stats()["t"]["pending_steps"] == 1  # step 1 (rank 1 missing) only


def test_a_staleness_timeout_in_a_batched_lookup_names_the_table_and_the_rank() -> None:
    with serving(config(wait_timeout_s=0.2)) as srv:
        c = PSClient(srv.address, srv.authkey, timeout_s=30)
        r0, r1 = c.tables(rank=0), c.tables(rank=1)
        ids = [np.arange(3, dtype=np.int64)] * 2
        grads = [rng_grads(3, 0)] * 2
        c.apply_gradients_many([r0[n] for n in NAMES], ids, grads)
        r1["t"].apply_gradients(ids[0], grads[0])  # rank 1 never pushes step 1 of "u"
        c.lookup_many([r0[n] for n in NAMES], ids, train=True)  # step 1: no wait
        start = time.monotonic()
        with pytest.raises(PSTimeoutError, match=r"table 'u'.*needs pushes from ranks \[1\]"):
            c.lookup_many([r0[n] for n in NAMES], ids, train=True)  # step 2
        assert time.monotonic() - start < 5
        c.close()


def test_stores_of_another_client_or_listed_twice_are_refused(client: PSClient) -> None:
    table = client.table("t")
    other = PSClient(client.address, b"unused")
    ids = [np.zeros(1, np.int64)] * 2
    with pytest.raises(ValueError, match="listed twice"):
        client.lookup_many([table, table], ids, train=False)
    with pytest.raises(ValueError, match="not a table of this parameter server client"):
        other.lookup_many([table, client.table("u")], ids, train=False)
    assert client.lookup_many([], [], train=True) == []  # no tables: no request
    assert client.push_many([], [], [], []) == []


def test_remote_lookup_into_a_caller_buffer_equals_a_fresh_lookup(client: PSClient) -> None:
    table = client.table("u")
    ids = np.array([7, -1, 2**40, 7], np.int64)
    fresh = table.lookup(ids, train=False)
    out = np.full((4, DIM), np.nan, np.float32)
    assert table.lookup(ids, train=False, out=out) is out
    np.testing.assert_array_equal(out, fresh)
    with pytest.raises(ValueError):
        table.lookup(ids, train=False, out=np.empty((3, DIM), np.float32))


def test_a_training_step_sends_one_lookup_and_one_push_for_all_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    #   A: the collection and updater on RemoteTables -> batched requests
    #   B: the same through LockedStore (no ``multi_store``) -> one request per table
    features, feature_tables = ["a", "b", "c"], {"a": "t", "b": "u", "c": "u"}
    bags = {
        f: JaggedIds(np.array([1, 2, 3, 2 * i], np.int64), np.array([0, 1, 4], np.int64))
        for i, f in enumerate(features)
    }
    with serving(config(world_size=1)) as srv_a, serving(config(world_size=1)) as srv_b:
        results = []
        for server, wrap in ((srv_a, lambda t: t), (srv_b, LockedStore)):
            client = PSClient(server.address, server.authkey, timeout_s=30)
            tables = client.tables()
            stores = {name: wrap(table) for name, table in tables.items()}
            collection = EmbeddingCollection(features, stores, feature_tables)
            updater = SparseUpdater(stores, "sync", 0)
            ops: list[str] = []
            monkeypatch.setattr(client, "call", _counting(client.call, ops))
            for step in range(2):
                looked_up = collection.lookup(bags, train=True)
                (collection(looked_up) * (step + 1)).sum().backward()
                updater.submit(collection.gradients())
            sent = list(ops)  # before state_dict's requests
            results.append((sent, looked_up.pooled, {n: t.state_dict() for n, t in tables.items()}))
            client.close()
    (ops_a, pooled_a, state_a), (ops_b, pooled_b, state_b) = results
    assert ops_a == ["lookup_many", "push_many"] * 2
    assert ops_b == ["lookup", "lookup", "push", "push"] * 2
    np.testing.assert_array_equal(pooled_a, pooled_b)
    for name in NAMES:
        want, have = by_id(state_b[name]), by_id(state_a[name])
        for key in want:
            np.testing.assert_array_equal(have[key], want[key])


def _counting(call: Any, ops: list[str]) -> Any:
    def counting_call(op: str, *args: Any, **kwargs: Any) -> Any:
        ops.append(op)
        return call(op, *args, **kwargs)

    return counting_call


def test_lr_scales_travel_per_table_and_the_ranks_of_a_step_must_agree(client: PSClient) -> None:
    # Step 1: rank 0 pushes both tables in one request, rank 1 table by table, both
    # at t: 0.5, u: 2.0 -> each server table equals a local one stepped at that scale.
    r0, r1 = client.tables(rank=0), client.tables(rank=1)
    local = {
        "t": EmbeddingTable(SPEC, SEED, name="t"),
        "u": EmbeddingTable(replace(SPEC, shards=3), SEED + 1, name="u"),
    }
    scales = {"t": 0.5, "u": 2.0}
    ids = {r: [step_ids(1, r, i) for i in range(len(NAMES))] for r in range(2)}
    grads = {r: [rng_grads(i.size, r) for i in ids[r]] for r in range(2)}
    client.lookup_many([r0[n] for n in NAMES], ids[0], train=True)
    for name, ids_t in zip(NAMES, ids[1], strict=True):
        r1[name].lookup(ids_t, train=True)
    client.apply_gradients_many(
        [r0[n] for n in NAMES], ids[0], grads[0], [scales[n] for n in NAMES]
    )
    for name, ids_t, g in zip(NAMES, ids[1], grads[1], strict=True):
        r1[name].apply_gradients(ids_t, g, lr_scale=scales[name])
    probe = np.arange(-30, 60, dtype=np.int64)
    for i, name in enumerate(NAMES):
        both = [(ids[r][i], grads[r][i]) for r in range(2)]
        local[name].lookup(np.concatenate([p[0] for p in both]), train=True)
        local[name].apply_gradients(*sum_by_id(both, DIM), lr_scale=scales[name])
        np.testing.assert_array_equal(
            r0[name].lookup(probe, train=False), local[name].lookup(probe, train=False)
        )
    # Step 2: rank 1 pushes "t" at another scale than rank 0 did: "t" fails, naming it.
    client.push_many([r0[n] for n in NAMES], [2, 2], ids[0], grads[0], [1.0, 1.0])
    msg = r"table 't': the ranks pushed step 2 with different lr scales \{0: 1.0, 1: 0.25\}"
    with pytest.raises(PSError, match=msg):
        r1["t"].push(2, ids[1][0], grads[1][0], lr_scale=0.25)
    assert client.server_stats()["t"]["applied"] == 1
    assert r1["u"].push(2, ids[1][1], grads[1][1])  # other tables go on
    assert client.server_stats()["u"]["applied"] == 2
