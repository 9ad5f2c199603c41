from __future__ import annotations

from dataclasses import replace

import pytest

from estuary.plan.costs import Costs


def simple_costs(**changes: float) -> Costs:
    """Round numbers that make rates hand-computable: a 1024-row step costs
    10 ms of dense work and, for its 1024 unique ids (unique_exp 1, coef 1 per
    feature / F), 1 ms of table work (in-process, or on the PS shards); no fixed
    parts, no RPC or all-reduce CPU; free network."""
    base = Costs(
        parse_s_per_row=1e-5,
        hash_s_per_id=0.0,
        lookup_s_per_id=5e-7,
        lookup_s_per_call=0.0,
        update_s_per_id=5e-7,
        update_s_per_call=0.0,
        dense_s_per_row=10e-3 / 1024,
        dense_s_per_step=0.0,
        dense_speedup_2=1.0,
        bytes_per_row=100.0,
        row_bytes=100.0,
        embedding_dim=16,
        sparse_features=1,
        ids_per_row=1.0,
        unique_coef=1.0,
        unique_exp=1.0,
        rpc_s_per_request=0.0,
        rpc_s_per_id=0.0,
        rpc_sharded_s_per_request=0.0,
        rpc_sharded_s_per_id=0.0,
        ps_s_per_request=0.0,
        ps_s_per_id=1e-6,
        allreduce_s_per_step=0.0,
        collection_s_per_row=0.0,
        parallel_efficiency=1.0,
        chain_utilisation=1.0,
        net_latency_s=0.0,
        net_bytes_per_s=1e15,
        net_cpu_s_per_byte=0.0,
        cores=2,
    )
    return replace(base, **changes)


@pytest.fixture
def costs() -> Costs:
    return simple_costs()
