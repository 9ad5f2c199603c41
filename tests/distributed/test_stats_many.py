"""Every table's stats in one request per parameter server (``stats_many``): the
same counters as per-table ``stats()``, one request per server however many
tables, and the time-series sample reads them that way."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from estuary.embedding.types import stats_of
from estuary.metrics.training import TrainingMetrics
from estuary.ps import PSClient, PSError
from estuary.ps.client import RemoteTable
from estuary.ps.sharded import ShardedPSClient
from estuary.train.observe import RunObserver

from .conftest import DIM
from .test_sharded import one_server, servers, train


def count_requests(client: PSClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ops ``client`` sends from now on (appended as they go out)."""
    ops: list[str] = []
    send = client._send

    def counted(op: str, fields: Any, arrays: Any) -> Any:
        ops.append(op)
        return send(op, fields, arrays)

    monkeypatch.setattr(client, "_send", counted)
    return ops


def clients_of(multi: PSClient | ShardedPSClient) -> list[PSClient]:
    return multi.clients if isinstance(multi, ShardedPSClient) else [multi]


@pytest.mark.parametrize("count", [1, 2])
def test_stats_many_equals_per_table_stats_in_one_request_per_server(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    #   train 3 steps on 't' and 'u' (ids on both servers when count=2), then
    #   stats_many([t, u]) == [t.stats(), u.stats()], each server asked once.
    with one_server() if count == 1 else servers(count) as multi:
        tables = multi.tables()
        train(tables, multi, steps=3)
        tables["t"].lookup(np.arange(500, 520, dtype=np.int64), train=False)  # misses
        single = [tables[name].stats() for name in ("t", "u")]
        assert single[0] != single[1] and single[0].rows > 0 and single[0].hits > 0
        sent = [count_requests(c, monkeypatch) for c in clients_of(multi)]
        assert multi.stats_many([tables["t"], tables["u"]]) == single
        assert sent == [["stats_many"]] * count
        assert multi.stats_many([]) == []


def test_sharded_stats_are_the_servers_counters_summed() -> None:
    with servers(2) as multi:
        tables = multi.tables()
        train(tables, multi, steps=2)
        t = tables["t"]
        on_each = [part.stats() for part in t.parts]
        assert all(s.rows > 0 for s in on_each)  # both servers hold some of the ids
        assert t.stats() == on_each[0] + on_each[1]
        assert t.stats().rows == len(t)


def test_stats_many_names_an_unknown_table() -> None:
    with one_server() as client:
        known = client.table("t")
        with pytest.raises(PSError, match=r"unknown table 'nope'; this server hosts \['t', 'u'\]"):
            client.stats_many([known, RemoteTable(client, "nope", DIM)])
        with pytest.raises(PSError, match="field 'tables' must be a non-empty list"):
            client.call("stats_many", {"tables": []})
        assert client.stats_many([known]) == [known.stats()]  # the server serves on


def test_stats_many_refuses_tables_of_another_client() -> None:
    with (
        one_server() as a,
        one_server() as b,
        pytest.raises(ValueError, match="is not a table of this parameter server client"),
    ):
        a.stats_many([a.table("t"), b.table("t")])


def test_stats_of_reads_tables_of_other_stores_one_by_one() -> None:
    from estuary.embedding import EmbeddingTable

    from .conftest import SPEC

    local = EmbeddingTable(SPEC, seed=0, name="local")
    local.lookup(np.arange(5, dtype=np.int64), train=True)
    with one_server() as client:
        remote = client.table("t")
        got = stats_of({"local": local, "t": remote})
        assert got == {"local": local.stats(), "t": remote.stats()}


@pytest.mark.parametrize("count", [1, 2])
def test_time_series_sample_asks_each_server_once(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with one_server() if count == 1 else servers(count) as multi:
        tables = multi.tables()
        train(tables, multi, steps=1)
        updater = SimpleNamespace(submitted=0, landed=0, log=SimpleNamespace(max_behind=0))
        feed = SimpleNamespace(
            bad_rows=lambda: 0, bad_rows_this_run=lambda: 0, newest_event_s=dict, queue_depths=dict
        )
        engine = SimpleNamespace(times=SimpleNamespace(as_dict=dict))
        observer = RunObserver(
            TrainingMetrics(port=None), engine, feed, tables, updater, folder=None, every_s=None
        )
        sent = [count_requests(c, monkeypatch) for c in clients_of(multi)]
        sample = observer.sample(record=False)
        assert sent == [["stats_many"]] * count
        assert sample.tables == {name: t.stats() for name, t in tables.items()}
        observer.close()
