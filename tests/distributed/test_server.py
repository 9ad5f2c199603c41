"""The parameter server over its real protocol: round trips, exactly-once
aggregation from two ranks, staleness, errors that name their cause."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Client
from typing import Any

import numpy as np
import pytest

from estuary.config.spec import AdmissionSpec
from estuary.embedding import EmbeddingTable
from estuary.ps import (
    HostedTable,
    ParameterServer,
    PSClient,
    PSConnectionError,
    PSError,
    PSTimeoutError,
    ServerConfig,
    ServerProcess,
    serving,
)
from estuary.ps.protocol import recv_message

from .conftest import DIM, SPEC

SEED = 11


def config(**changes: Any) -> ServerConfig:
    base = ServerConfig(
        {"t": HostedTable(SPEC, SEED), "u": HostedTable(replace(SPEC, shards=3), SEED + 1)},
        world_size=2,
        staleness=0,
        wait_timeout_s=5.0,
    )
    return replace(base, **changes)


@pytest.fixture
def server() -> Iterator[ParameterServer]:
    with serving(config()) as srv:
        yield srv


@pytest.fixture
def client(server: ParameterServer) -> Iterator[PSClient]:
    c = PSClient(server.address, server.authkey, timeout_s=30)
    yield c
    c.close()


def rng_grads(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)


def test_hello_lists_tables_and_settings(client: PSClient) -> None:
    hello = client.hello()
    assert hello["tables"] == {"t": DIM, "u": DIM}
    assert (hello["world_size"], hello["staleness"]) == (2, 0)


def test_a_server_of_another_protocol_version_is_refused(
    client: PSClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from estuary.ps import client as client_module
    from estuary.ps.protocol import PROTOCOL_VERSION

    monkeypatch.setattr(client_module, "PROTOCOL_VERSION", 1)
    with pytest.raises(PSError, match=rf"speaks protocol {PROTOCOL_VERSION}, this client 1"):
        client.hello()


@pytest.mark.parametrize("table", ["t", "u"])  # one shard, three shards
def test_two_ranks_overlapping_ids_equal_one_step_of_the_summed_gradients(
    client: PSClient, table: str
) -> None:
    #   rank 0 pushes ids 0..59, rank 1 pushes ids 30..89 (30 shared), 3 steps.
    #   Reference: a local table, per step ONE apply_gradients of the per-id sum.
    hosted = config().tables[table]
    local = EmbeddingTable(hosted.spec, seed=hosted.seed, name=table)
    ranks = [client.table(table, rank=r) for r in range(2)]
    ids = [np.arange(0, 60, dtype=np.int64), np.arange(30, 90, dtype=np.int64)]
    for step in range(1, 4):
        rows = [t.lookup(i, train=True) for t, i in zip(ranks, ids, strict=True)]
        local_rows = [local.lookup(i, train=True) for i in ids]
        for got, want in zip(rows, local_rows, strict=True):
            np.testing.assert_array_equal(got, want)
        g = [rng_grads(60, 10 * step + r) for r in range(2)]
        for t, i, gr in zip(ranks, ids, g, strict=True):
            t.apply_gradients(i, gr)
        summed = np.zeros((90, DIM), np.float32)
        summed[0:60] += g[0]
        summed[30:90] += g[1]
        local.apply_gradients(np.arange(90, dtype=np.int64), summed)
    probe = np.arange(-5, 95, dtype=np.int64)
    np.testing.assert_allclose(
        ranks[0].lookup(probe, train=False), local.lookup(probe, train=False), rtol=1e-6
    )
    state, want = ranks[1].state_dict(), local.state_dict()
    order, want_order = np.argsort(state["ids"]), np.argsort(want["ids"])
    for key in ("ids", "weights", "opt.accum"):
        np.testing.assert_allclose(state[key][order], want[key][want_order], rtol=1e-6)
    assert client.server_stats()[table] == {
        "applied": 3,
        "duplicates": 0,
        "pending_steps": 0,
        "waits": 0,
        "max_behind": 0,  # each step's lookups came after the previous step landed
    }


def test_duplicate_push_changes_nothing(client: PSClient) -> None:
    t0, t1 = client.table("t", rank=0), client.table("t", rank=1)
    ids = np.arange(5, dtype=np.int64)
    t0.lookup(ids, train=True)
    t1.lookup(ids, train=True)
    assert t0.push(1, ids, rng_grads(5, 0))
    assert not t0.push(1, ids, rng_grads(5, 99))  # a retry of (step 1, rank 0)
    assert t1.push(1, ids, rng_grads(5, 1))
    after = t0.lookup(ids, train=False)
    assert not t1.push(1, ids, rng_grads(5, 1))  # after the step was applied
    np.testing.assert_array_equal(t0.lookup(ids, train=False), after)
    assert client.server_stats()["t"]["duplicates"] == 2


def test_state_dict_round_trip_and_stats(client: PSClient) -> None:
    tables = client.tables(rank=0)
    ids = np.array([3, -7, 2**60], np.int64)
    tables["u"].lookup(ids, train=True)
    before = tables["u"].state_dict()
    assert len(tables["u"]) == 3 and tables["u"].stats().admissions == 3
    tables["t"].load_state_dict(before)  # any shard count loads into any other
    np.testing.assert_array_equal(
        tables["t"].lookup(ids, train=False), tables["u"].lookup(ids, train=False)
    )
    assert tables["t"].remove(ids[:1]) == 1 and len(tables["t"]) == 2


def test_train_lookup_waits_for_the_staleness_bound() -> None:
    # staleness 1: the lookup of step 3 needs step 1 applied, step 2 may be missing.
    with serving(config(world_size=1, staleness=1)) as srv:
        client = PSClient(srv.address, srv.authkey, timeout_s=30)
        table = client.table("t")
        ids = np.arange(4, dtype=np.int64)
        table.lookup(ids, train=True, step=1)
        table.lookup(ids, train=True, step=2)  # needs step 0: no wait
        done = threading.Event()

        def lookup_step_3() -> None:
            table.lookup(ids, train=True, step=3)
            done.set()

        waiter = threading.Thread(target=lookup_step_3)
        waiter.start()
        deadline = time.monotonic() + 10
        while client.server_stats()["t"]["waits"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not done.wait(0.2)  # blocked at the server: step 1 not applied
        table.push(1, ids, rng_grads(4, 0))
        assert done.wait(5)
        waiter.join()
        client.close()


def test_a_step_that_never_completes_fails_with_the_missing_rank() -> None:
    with serving(config(wait_timeout_s=0.2)) as srv:
        c = PSClient(srv.address, srv.authkey, timeout_s=30)
        t0 = c.table("t", rank=0)
        ids = np.arange(3, dtype=np.int64)
        t0.lookup(ids, train=True)
        t0.apply_gradients(ids, rng_grads(3, 0))  # rank 1 never pushes step 1
        start = time.monotonic()
        with pytest.raises(PSTimeoutError, match=r"needs pushes from ranks \[1\]"):
            t0.lookup(ids, train=True)  # step 2 needs step 1
        assert time.monotonic() - start < 5
        c.close()


def test_errors_name_their_cause_and_keep_the_connection_usable(client: PSClient) -> None:
    with pytest.raises(PSError, match=r"unknown table 'nope'; this server hosts \['t', 'u'\]"):
        client.call("lookup", {"table": "nope", "train": False}, {"ids": np.zeros(1, np.int64)})
    with pytest.raises(PSError, match="unknown op 'launch'"):
        client.call("launch")
    with pytest.raises(PSError, match="'ids' must be int64"):
        client.call("lookup", {"table": "t", "train": False}, {"ids": np.zeros(1, np.float32)})
    with pytest.raises(PSError, match=r"grads must have shape \(2, 4\)"):
        client.call(
            "push",
            {"table": "t", "step": 1, "rank": 0},
            {"ids": np.arange(2, dtype=np.int64), "grads": np.zeros((2, 5), np.float32)},
        )
    assert client.hello()["world_size"] == 2  # still serving


def test_a_wrong_authkey_is_refused(server: ParameterServer) -> None:
    with pytest.raises(PSConnectionError, match="cannot reach"):
        PSClient(server.address, b"wrong key").hello()


def test_a_malformed_message_gets_an_error_reply_and_a_hangup(server: ParameterServer) -> None:
    conn = Client(server.address, authkey=server.authkey)
    conn.send_bytes(b"{not json")
    header, _ = recv_message(conn)
    assert header["ok"] is False and header["kind"] == "protocol"
    assert conn.poll(5)
    with pytest.raises(EOFError):
        conn.recv_bytes()
    conn.close()


def test_many_threads_share_one_client(client: PSClient) -> None:
    tables = [client.table("u", rank=r % 2) for r in range(8)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                ids = np.arange(i * 100, i * 100 + 50, dtype=np.int64)
                assert tables[i].lookup(ids, train=False).shape == (50, DIM)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.distributed
def test_server_process_serves_and_a_dead_server_fails_fast() -> None:
    ps = ServerProcess(config(world_size=1))
    client = PSClient(ps.address, ps.authkey, timeout_s=30)
    try:
        table = client.table("u")
        ids = np.arange(10, dtype=np.int64)
        table.lookup(ids, train=True)
        table.apply_gradients(ids, rng_grads(10, 0))
        assert table.wait_applied() == 1
    finally:
        ps.stop()
    assert not ps.is_alive()
    start = time.monotonic()
    with pytest.raises(PSConnectionError):
        table.lookup(ids, train=False)
    assert time.monotonic() - start < 5
    client.close()


def test_admission_counting_can_be_switched_off_at_the_server() -> None:
    """Later epochs re-read rows already counted: the trainer switches counting
    off on remote tables too, so a second sighting there admits nothing."""
    spec = replace(SPEC, admission=AdmissionSpec(min_count=2))
    with serving(ServerConfig({"t": HostedTable(spec, SEED)}, world_size=1, staleness=None)) as srv:
        client = PSClient(srv.address, srv.authkey, timeout_s=30)
        table = client.table("t")
        ids = np.array([5, 6], np.int64)
        table.lookup(ids, train=True)  # first sighting: counted, not admitted
        table.set_admission_counting(False)
        table.lookup(ids, train=True)  # not counted: still not admitted
        assert table.stats().admissions == 0
        table.set_admission_counting(True)
        table.lookup(ids, train=True)  # second counted sighting: admitted
        assert table.stats().admissions == 2
        client.close()
