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


class TestShardedTable(StoreConformance):
    @pytest.fixture(params=[2, 3], ids=["servers2", "servers3"])
    def make(self, request: pytest.FixtureRequest) -> Iterator[Callable[[TableSpec], ShardedTable]]:
        """Each call: 2 or 3 fresh servers splitting one table ``t`` by id."""
        with contextlib.ExitStack() as stack:

            def factory(spec: TableSpec) -> ShardedTable:
                hosted = server_share(HostedTable(replace(spec, shards=2), seed=5), request.param)
                config = ServerConfig({"t": hosted}, world_size=1, staleness=None)
                started = [stack.enter_context(serving(config)) for _ in range(request.param)]
                client = ShardedPSClient(
                    [PSClient(s.address, s.authkey, timeout_s=30) for s in started]
                )
                stack.callback(client.close)
                return client.table("t")

            yield factory
