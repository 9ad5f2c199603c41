"""``RemoteTable`` and ``ShardedTable`` pass the ``EmbeddingStore`` conformance
suite (``estuary.testing.stores``) against real in-process servers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from estuary.config.spec import TableSpec
from estuary.ps import (
    HostedTable,
    PSClient,
    RemoteTable,
    ServerConfig,
    ShardedPSClient,
    ShardedTable,
    server_share,
    serving,
)
from estuary.testing.stores import StoreConformance


class TestRemoteTable(StoreConformance):
    @pytest.fixture(params=[1, 4], ids=["remote1", "remote4"])
    def make(self, request: pytest.FixtureRequest) -> Iterator[Callable[[TableSpec], RemoteTable]]:
        """Each call: a fresh server hosting one table ``t`` of 1 or 4 shards (world
        1, no staleness bound: the suite looks up several times between updates)."""
        with contextlib.ExitStack() as stack:

            def factory(spec: TableSpec) -> RemoteTable:
                hosted = HostedTable(replace(spec, shards=request.param), seed=5)
                config = ServerConfig({"t": hosted}, world_size=1, staleness=None)
                server = stack.enter_context(serving(config))
                client = PSClient(server.address, server.authkey, timeout_s=30)
                stack.callback(client.close)
                return client.table("t")

            yield factory


@contextlib.contextmanager
def sharded_tables(
    servers: int, **changes: object
) -> Iterator[Callable[[TableSpec], ShardedTable]]:
    """Each call: ``servers`` fresh servers splitting one table ``t`` by id (its
    spec with ``changes``)."""
    with contextlib.ExitStack() as stack:

        def factory(spec: TableSpec) -> ShardedTable:
            spec = replace(spec, shards=2, **changes)  # type: ignore[arg-type]
            hosted = server_share(HostedTable(spec, seed=5), servers)
            config = ServerConfig({"t": hosted}, world_size=1, staleness=None)
            started = [stack.enter_context(serving(config)) for _ in range(servers)]
            client = ShardedPSClient(
                [PSClient(s.address, s.authkey, timeout_s=30) for s in started]
            )
            stack.callback(client.close)
            return client.table("t")

        yield factory


class TestShardedTable(StoreConformance):
    @pytest.fixture(params=[2, 3], ids=["servers2", "servers3"])
    def make(self, request: pytest.FixtureRequest) -> Iterator[Callable[[TableSpec], ShardedTable]]:
        with sharded_tables(request.param) as factory:
            yield factory


class TestBf16ShardedTable(StoreConformance):
    """bf16 rows served by 2 servers: states, deltas and lookups cross the wire
    in the stored dtype."""

    weight_atol = 2.0**-7  # one bf16 step at |w| < 2

    @pytest.fixture
    def make(self) -> Iterator[Callable[[TableSpec], ShardedTable]]:
        with sharded_tables(2, dtype="bf16") as factory:
            yield factory
