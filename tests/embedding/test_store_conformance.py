"""Every in-process store (a shard, a table of 1 and of 4 shards, and with 16-bit
weights) passes the ``EmbeddingStore`` conformance suite (``estuary.testing.stores``)."""

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


HALF_STORES: dict[str, Factory] = {
    "shard_fp16": lambda spec: EmbeddingShard(replace(spec, dtype="fp16"), seed=5, name="t"),
    "table4_bf16": lambda spec: EmbeddingTable(
        replace(spec, shards=4, dtype="bf16"), seed=5, name="t"
    ),
}


class TestHalfPrecisionStores(InProcessStoreConformance):
    weight_atol = 2.0**-7  # one bf16 step at |w| < 2; fp16's is 8x finer

    @pytest.fixture(params=sorted(HALF_STORES))
    def make(self, request: pytest.FixtureRequest) -> Factory:
        return HALF_STORES[request.param]
