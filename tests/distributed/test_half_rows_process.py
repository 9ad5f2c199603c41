"""A parameter-server process hosting a bf16 table trains it exactly as the same
table in this process would, and hands back its state in the stored dtype."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from estuary.embedding import EmbeddingTable
from estuary.ps import HostedTable, PSClient, ServerConfig, ServerProcess

from .conftest import SPEC


@pytest.mark.distributed
def test_server_process_trains_bf16_rows_like_an_in_process_table() -> None:
    spec = replace(SPEC, dtype="bf16", shards=2)
    local = EmbeddingTable(spec, seed=11, name="t")
    config = ServerConfig({"t": HostedTable(spec, 11)}, world_size=1, staleness=None)
    ps = ServerProcess(config)
    client = PSClient(ps.address, ps.authkey, timeout_s=30)
    try:
        remote = client.table("t")
        rng = np.random.default_rng(0)
        for _ in range(5):
            ids = np.unique(rng.integers(-100, 100, size=60)).astype(np.int64)
            grads = rng.normal(size=(ids.size, spec.dim)).astype(np.float32)
            np.testing.assert_array_equal(
                remote.lookup(ids, train=True), local.lookup(ids, train=True)
            )
            remote.apply_gradients(ids, grads)
            local.apply_gradients(ids, grads)
        remote.wait_applied()
        probe = np.arange(-100, 100, dtype=np.int64)
        np.testing.assert_array_equal(
            remote.lookup(probe, train=False), local.lookup(probe, train=False)
        )
        state = remote.state_dict()
        assert state["weights"].dtype == np.uint16  # bf16 bits, as stored
        restored = EmbeddingTable(spec, seed=0, name="t")
        restored.load_state_dict(state)
        np.testing.assert_array_equal(
            restored.lookup(probe, train=False), local.lookup(probe, train=False)
        )
    finally:
        client.close()
        ps.stop()
