"""Every in-process store (a shard, a table of 1 and of 4 shards) passes the
``EmbeddingStore`` conformance suite (``estuary.testing.stores``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from estuary.embedding import EmbeddingShard, EmbeddingTable
from estuary.testing.stores import Factory, InProcessStoreConformance

STORES: dict[str, Factory] = {
    "shard": lambda spec: EmbeddingShard(spec, seed=5, name="t"),
    "table1": lambda spec: EmbeddingTable(spec, seed=5, name="t"),
    "table4": lambda spec: EmbeddingTable(replace(spec, shards=4), seed=5, name="t"),
}


class TestInProcessStores(InProcessStoreConformance):
    @pytest.fixture(params=sorted(STORES))
    def make(self, request: pytest.FixtureRequest) -> Factory:
        return STORES[request.param]
