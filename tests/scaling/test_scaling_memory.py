"""The memory knob: a PS shard whose table grows every step (new ids each
step). With the manager on, the forecast crosses the budget before the shard
does, the manager caps its rows, and no sample of its memory is ever over the
budget; with it off, the same run crosses the budget."""

from __future__ import annotations

import numpy as np
import pytest

from estuary.config.scaling import ScalingSpec
from estuary.config.tables import EvictionSpec, TableSpec
from estuary.embedding.table import EmbeddingTable
from estuary.runtime.scaling import Bounds, Controller, EstuaryPolicy, Snapshot
from estuary.runtime.scaling.tables import TableShards

BUDGET = 6 * 2**20  # bytes of the one PS shard
STEPS = 120
NEW_IDS = 1500  # new ids per step: ~4 MiB of rows at D=16 by the end, x slack


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(manager: bool) -> tuple[list[int], Controller | None, EmbeddingTable]:
    """Train a growing table one step per simulated second; the manager (if on)
    looks every 5 steps. Returns the shard's memory after every step."""
    spec = TableSpec(dim=16, initial_capacity_rows=1024, eviction=EvictionSpec(capacity_rows=10**7))
    table = EmbeddingTable(spec, seed=0, name="grow")
    shards = TableShards([table], BUDGET)
    clock = SimClock()
    scaling = ScalingSpec(enabled=True, interval_s=5.0, memory_horizon_s=20.0)

    def sample(t: float) -> Snapshot:
        return Snapshot(t, 1, None, 1.0, 0, 0.0, shards=shards.metrics(t))

    controller = (
        Controller(EstuaryPolicy(scaling, Bounds()), sample, shards, interval_s=5.0, clock=clock)
        if manager
        else None
    )
    rng = np.random.default_rng(0)
    memory = []
    for step in range(STEPS):
        hot = rng.integers(0, 2000, 500)  # a steady set of old ids
        new = np.arange(step * NEW_IDS, (step + 1) * NEW_IDS, dtype=np.int64) + 10**6
        ids = np.concatenate([hot, new]).astype(np.int64)
        rows = table.lookup(ids, train=True)
        table.apply_gradients(ids, np.full_like(rows, 0.01))
        memory.append(table.stats().bytes)
        clock.now = float(step + 1)
        if controller is not None and (step + 1) % 5 == 0:
            controller.step()
    return memory, controller, table


def test_without_the_manager_a_growing_table_crosses_its_budget() -> None:
    memory, _, table = run(manager=False)
    assert max(memory) > BUDGET
    assert table.stats().evictions == 0


def test_with_the_manager_a_growing_table_stays_under_its_budget() -> None:
    memory, controller, table = run(manager=True)
    assert controller is not None
    assert max(memory) <= BUDGET, f"peak {max(memory)} over budget {BUDGET}"
    decisions = controller.timeline.as_dict()["decisions"]
    caps = [d for d in decisions if d["knob"] == "shard_rows:0" and d["applied"]]
    assert caps, decisions
    first = caps[0]
    # It acted before the crossing, on the forecast: memory then was under budget.
    assert first["metrics"]["memory_bytes"] < BUDGET <= first["metrics"]["forecast_bytes"]
    assert table.stats().evictions > 0  # the cap made room by evicting cold rows
    assert table.capacity_rows is not None and table.capacity_rows <= first["new"]
    # Each applied decision has its effect measured one interval later.
    assert all("effect" in d for d in caps if d["interval"] < len(controller.history))
    assert controller.timeline.as_dict()["reversed_actions"] == 0


def test_cap_rows_needs_a_bounded_table_and_never_raises_the_cap() -> None:
    unbounded = EmbeddingTable(TableSpec(dim=4), seed=0, name="free")
    with pytest.raises(ValueError, match=r"eviction\.capacity_rows"):
        unbounded.cap_rows(10)
    bounded = EmbeddingTable(
        TableSpec(dim=4, shards=2, eviction=EvictionSpec(capacity_rows=100)), seed=0, name="b"
    )
    assert bounded.cap_rows(40) == 40  # 20 per shard
    assert bounded.cap_rows(1000) == 40  # a cap only goes down
    bounded.lookup(np.arange(200, dtype=np.int64), train=True)
    assert bounded.stats().rows <= 40
