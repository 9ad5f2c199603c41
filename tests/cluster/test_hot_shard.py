"""The hot-shard rebalance on Ray (``estuary.runtime.ray.scaling``): two PS
server actors, a trainer whose ids mostly land on shard 0, and the scaling
controller. The policy finds shard 0 hot, the actuator moves its hottest slots
to shard 1 while the trainer runs, the timeline logs the migration (rows,
pause) and its effect (shard 0's load share falls), and the trained table is
bit for bit the one a single local table trains: every row trained once. A
shard whose load is all in one slot gets a finer slot map first, then a move;
one hot id alone is reported."""

from __future__ import annotations

import json
import os
import queue
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from estuary.config.scaling import ScalingSpec
from estuary.config.spec import InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingTable
from estuary.ps import HostedTable, PSClient, ServerConfig
from estuary.ps.sharded import ShardedPSClient, server_share
from estuary.ps.slots import SlotMap
from estuary.runtime.ray.actors import ServerActor, kill_all
from estuary.runtime.ray.scaling import RayShards
from estuary.runtime.scaling import Bounds, Controller, Decision, EstuaryPolicy

pytestmark = pytest.mark.ray
SPEC = TableSpec(
    dim=4,
    initializer=InitializerSpec("uniform", 0.1),
    optimizer=SparseOptimizerSpec(name="adagrad", lr=0.1),
    initial_capacity_rows=64,
)
SEED = 9
STEPS = 300
MOVE_AT = 30  # the controller looks (and moves) once the trainer is past this step ...
LATEST = 120  # ... and the trainer waits here until it has moved, should it get here first


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def start_two_servers(ray: Any) -> tuple[list[Any], ShardedPSClient]:
    """Two PS server actors sharing table ``t`` and a trainer's client of them."""
    tables = {"t": server_share(HostedTable(SPEC, SEED), 2)}
    config = ServerConfig(tables, world_size=1, staleness=0, wait_timeout_s=30.0)
    keys = [os.urandom(32) for _ in range(2)]
    servers = [ServerActor.remote(config, k) for k in keys]  # type: ignore[attr-defined]
    try:
        endpoints = ray.get([s.endpoint.remote() for s in servers], timeout=60)
    except BaseException:
        kill_all(servers)
        raise
    trainer = ShardedPSClient(
        [PSClient(e[0], k, timeout_s=60) for e, k in zip(endpoints, keys, strict=True)]
    )
    return servers, trainer


def assert_trained_once(state: dict[str, np.ndarray], batches: list[np.ndarray]) -> None:
    """Every row trained once: ``state`` is one local table trained on ``batches``."""
    local = EmbeddingTable(replace(SPEC), seed=SEED, name="t")
    for ids in batches:
        local.apply_gradients(ids, local.lookup(ids, train=True) * 0.5 + 0.1)
    want = local.state_dict()
    got_order, want_order = np.argsort(state["ids"]), np.argsort(want["ids"])
    np.testing.assert_array_equal(state["ids"][got_order], want["ids"][want_order])
    for key in [k for k in want if k == "weights" or k.startswith("opt.")]:
        np.testing.assert_array_equal(state[key][got_order], want[key][want_order], err_msg=key)


def skewed_batches() -> list[np.ndarray]:
    """85% of each batch's ids on shard 0 of the even map, spread over its slots."""
    pool = np.arange(0, 20_000, dtype=np.int64)
    owner = SlotMap.even(2).server_of(pool)
    zero, one = pool[owner == 0], pool[owner == 1]
    rng = np.random.default_rng(0)
    return [
        np.concatenate([rng.choice(zero, 220, replace=False), rng.choice(one, 40, replace=False)])
        for _ in range(STEPS)
    ]


def test_a_hot_shard_is_rebalanced_live_and_every_row_trained_once(
    ray_instance: Any, tmp_path: Path
) -> None:
    servers, trainer = start_two_servers(ray_instance)
    try:
        shards = RayShards(servers, None)
        clock = StepClock()
        scaling = ScalingSpec(enabled=True, interval_s=1.0, hot_ratio=1.3)
        controller = Controller(
            EstuaryPolicy(scaling, Bounds()),
            shards.sample,
            shards,
            interval_s=1.0,
            clock=clock,
            out=tmp_path,
            name="scaling_ps",
        )
        batches = skewed_batches()
        reached, moved = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def train() -> None:
            try:
                table = trainer.table("t")
                for step, ids in enumerate(batches, start=1):
                    rows = table.lookup(ids, train=True)
                    table.apply_gradients(ids, rows * 0.5 + 0.1)
                    if step == MOVE_AT:
                        reached.set()
                    if step == LATEST:
                        moved.wait(120)
                table.wait_applied()
            except BaseException as exc:
                errors.append(exc)

        controller.step()  # interval 0: nothing trained yet
        thread = threading.Thread(target=train)
        thread.start()
        assert reached.wait(120)
        clock.now = 1.0
        controller.step()  # shard 0 hot (~85% of the ids): slots move, the trainer runs on
        moved.set()
        thread.join(120)
        assert not errors, errors
        clock.now = 2.0
        controller.step()  # the effect
        controller.close()
        state = trainer.table("t").state_dict(mark_clean=False)
        trainer.close()
    finally:
        kill_all(servers)

    timeline = json.loads((tmp_path / "scaling_ps.json").read_text())
    moves = [d for d in timeline["decisions"] if d["knob"] == "hot_shard:0" and d["applied"]]
    assert len(moves) == 1, timeline["decisions"]
    move = moves[0]
    assert move["migration"]["to"] == 1 and move["migration"]["rows"] > 0
    assert move["migration"]["pause_ms"] > 0
    assert MOVE_AT <= move["migration"]["fence"]["t"] <= LATEST
    effect = move["effect"]
    assert effect["load_share_before"] > 0.75
    assert effect["load_share_after"] < effect["load_share_before"] - 0.15, effect
    assert timeline["reversed_actions"] == 0

    # Every row trained once: the same table as one local table trained alike.
    assert_trained_once(state, batches)


def one_slot_batches(steps: int) -> list[np.ndarray]:
    """Per batch, 200 ids all in slot 0 of the even 2-server map (shard 0) and 20
    spread over shard 1: no slot move can even the pair until the map is finer."""
    pool = np.arange(0, 3_000_000, dtype=np.int64)
    even = SlotMap.even(2)
    slot = even.slot_of(pool)
    hot, cold = pool[slot == 0], pool[even.owners[slot] == 1][:20_000]
    rng = np.random.default_rng(1)
    return [
        np.concatenate([rng.choice(hot, 200, replace=False), rng.choice(cold, 20, replace=False)])
        for _ in range(steps)
    ]


def test_a_hot_slot_is_refined_then_split_across_shards_every_row_once(
    ray_instance: Any, tmp_path: Path
) -> None:
    """Shard 0's load all in one slot: the first interval refines the slot map
    (every slot split into 16, no row moves, the trainer runs on), the next
    moves part of that slot's ids to shard 1; the trained table is bit for bit
    one local table's."""
    per, steps = 30, 90
    servers, trainer = start_two_servers(ray_instance)
    try:
        shards = RayShards(servers, None)
        clock = StepClock()
        scaling = ScalingSpec(enabled=True, interval_s=1.0, hot_ratio=1.3, hold_intervals=0)
        controller = Controller(
            EstuaryPolicy(scaling, Bounds()),
            shards.sample,
            shards,
            interval_s=1.0,
            hold_intervals=0,
            clock=clock,
            out=tmp_path,
            name="scaling_ps",
        )
        batches = one_slot_batches(steps)
        at: queue.Queue[int] = queue.Queue()
        go: queue.Queue[None] = queue.Queue()
        errors: list[BaseException] = []

        def train() -> None:
            try:
                table = trainer.table("t")
                for step, ids in enumerate(batches, start=1):
                    rows = table.lookup(ids, train=True)
                    table.apply_gradients(ids, rows * 0.5 + 0.1)
                    if step % per == 0:
                        at.put(step)
                        go.get(timeout=120)  # the controller's interval, between two steps
                table.wait_applied()
            except BaseException as exc:
                errors.append(exc)
                at.put(-1)

        controller.step()  # interval 0: nothing trained yet
        thread = threading.Thread(target=train)
        thread.start()
        while (step := at.get(timeout=120)) > 0:
            clock.now = step / per
            controller.step()  # 1: refine; 2: move; 3: the move's effect
            go.put(None)
            if step == steps:
                break
        thread.join(120)
        assert not errors, errors
        controller.close()
        state = trainer.table("t").state_dict(mark_clean=False)
        slot_map = trainer.slot_map
        trainer.close()
    finally:
        kill_all(servers)

    timeline = json.loads((tmp_path / "scaling_ps.json").read_text())
    applied = [d for d in timeline["decisions"] if d["knob"] == "hot_shard:0" and d["applied"]]
    assert len(applied) == 2, timeline["decisions"]
    refine, move = (d["migration"] for d in applied)
    assert refine["kind"] == "refine" and refine["factor"] == 16 and refine["rows"] == 0
    assert refine["hot_slot"] == 0 and refine["hot_slot_share"] > 0.99
    assert refine["slot_count"] == 16 * 2048 and refine["pause_ms"] > 0
    assert "kind" not in move and move["to"] == 1 and move["rows"] > 0
    assert move["slot_count"] == 16 * 2048 and move["version"] == 2
    assert applied[1]["effect"]["load_share_before"] > 0.85
    assert applied[1]["effect"]["load_share_after"] < 0.65, applied[1]["effect"]
    assert slot_map.slots == 16 * 2048 and timeline["reversed_actions"] == 0

    assert_trained_once(state, batches)


def test_a_single_hot_id_is_refined_once_then_reported(ray_instance: Any) -> None:
    """One id carrying all of a shard's load: the map is refined to its finest
    (no row moves), the id still cannot be split, and the next decision says so."""
    hot_id = np.flatnonzero(SlotMap.even(2).server_of(np.arange(100)) == 0)[:1].astype(np.int64)
    servers, trainer = start_two_servers(ray_instance)
    try:
        table = trainer.table("t")
        shards = RayShards(servers, None)
        hot = Decision("hot_shard:0", 1.0, 0.5, "test: one hot id")
        answers = []
        for t in (1.0, 2.0):
            for _ in range(5):
                table.apply_gradients(hot_id, table.lookup(hot_id, train=True) + 0.1)
            table.wait_applied()
            shards.sample(t)
            answers.append(shards.apply(hot))
        shards.sample(3.0)  # no lookup since: nothing to plan from, nothing refined
        answers.append(shards.apply(hot))
        trainer.close()
    finally:
        kill_all(servers)
    assert answers[0] is None and shards.migrations[0]["kind"] == "refine"
    assert shards.migrations[0]["rows"] == 0 and shards.migrations[0]["slot_count"] == 16 * 2048
    assert answers[1] is not None and "at its finest (32768 slots)" in answers[1]
    assert "carries 100% of its load" in answers[1]
    assert answers[2] is not None and "no lookups counted on shard 0" in answers[2]
    assert len(shards.migrations) == 1
