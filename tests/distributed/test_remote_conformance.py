"""``RemoteTable`` passes the ``EmbeddingStore`` conformance suite
(``estuary.testing.stores``) against a real in-process server."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from estuary.config.spec import TableSpec
from estuary.ps import HostedTable, PSClient, RemoteTable, ServerConfig, serving
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
