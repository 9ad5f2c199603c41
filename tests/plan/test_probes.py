from __future__ import annotations

import math

import numpy as np
import pytest

from estuary.config.tables import TableSpec
from estuary.plan.probes import LayoutTiming, ps_layout
from estuary.ps.types import HostedTable


def _batches(tables: list[str], n: int, ids: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[np.unique(rng.integers(0, 1000, ids)) for _ in tables] for _ in range(n)]


@pytest.mark.parametrize(("trainers", "shards"), [(2, 2)])
def test_ps_layout_runs_every_clients_steps_through_the_real_servers(
    trainers: int, shards: int
) -> None:
    """W client processes against S servers finish the sync steps (the servers'
    staleness barrier would hang or time out on a lost push) and report finite,
    non-negative per-step figures; no timing decides the result."""
    names = ["a", "b"]
    tables = {f: HostedTable(TableSpec(dim=4), seed=i) for i, f in enumerate(names)}
    got = ps_layout(tables, _batches(names, 3, 50), names, trainers, shards, steps=4, warmup=1)
    assert isinstance(got, LayoutTiming)
    assert (got.trainers, got.shards, got.steps) == (trainers, shards, 4)
    for value in (got.wall_s, got.client_cpu_s, got.server_cpu_s):
        assert math.isfinite(value) and value >= 0
    assert got.wall_s > 0


def test_ps_layout_refuses_a_layout_without_a_server() -> None:
    with pytest.raises(ValueError, match="1x0"):
        ps_layout({}, [], [], 1, 0, steps=1, warmup=0)
