"""PS shards added and retired live on Ray (``estuary.runtime.ray.scaling``).

Split: one PS server actor, a table that grows every step, and the scaling
controller with a memory budget and room for a second shard. The memory
forecast crosses the budget, the manager starts a second ``ServerActor`` (its
own resource ask) and moves half the slots to it between two steps while the
trainer runs. No shard's memory ever passes the budget (one shard alone would:
shown), every row is trained once (the same table as one local table trained
alike), every trained id lives on exactly one server, and the state loads into
two fresh servers as it was (a resume after the split).

Merge: two servers, one retired into the other between two steps; the retired
actor is stopped once the trainer moved on; every row trained once.

Both on either data plane: socket clients (the map names each server's address
and key) or Ray actor calls (the map names each server's actor; the trainer
finds a joined one by its name)."""

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
from estuary.config.spec import RoleResources
from estuary.embedding import EmbeddingTable
from estuary.ps import HostedTable, PSClient, ServerConfig
from estuary.ps.sharded import ROUTING_METADATA, ShardedPSClient
from estuary.ps.types import PSError
from estuary.runtime.ray.actors import ServerActor, kill_all, server_name
from estuary.runtime.ray.plane import ActorPSClient, actor_clients, connect_actor
from estuary.runtime.ray.scaling import RayShards, ServerSpawner
from estuary.runtime.scaling import Bounds, Controller, Decision, EstuaryPolicy
from estuary.train import load_checkpoint

from ..distributed.conftest import write_job
from .test_hot_shard import SEED, SPEC, StepClock

pytestmark = pytest.mark.ray
BATCH = 200  # new ids per step (and 40 seen before)
STEPS = 60
PER = 5  # the controller looks every PER steps (one interval of the test's clock)
BUDGET = 600_000  # bytes per shard: one shard passes it at ~10,000 rows


def growing_batches() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    out = []
    for step in range(STEPS):
        new = np.arange(step * BATCH, (step + 1) * BATCH, dtype=np.int64) * 7919 + 13
        seen = out[-1][rng.choice(BATCH, 40, replace=False)] if out else np.empty(0, np.int64)
        out.append(np.concatenate([new, seen]))
    return out


def start_servers(ray: Any, config: ServerConfig, count: int) -> tuple[list[Any], list[PSClient]]:
    keys = [os.urandom(32) for _ in range(count)]
    servers = [
        ServerActor.options(name=server_name()).remote(config, k)  # type: ignore[attr-defined]
        for k in keys
    ]
    endpoints = ray.get([s.endpoint.remote() for s in servers], timeout=60)
    return servers, [PSClient(e[0], k, timeout_s=60) for e, k in zip(endpoints, keys, strict=True)]


def client_of(plane: str, servers: list[Any], conns: list[PSClient]) -> ShardedPSClient:
    """A sharded client of the servers on ``plane``: socket clients (fresh ones
    of ``conns``' addresses) or actor calls (finding joined servers by name)."""
    if plane == "actor":
        return ShardedPSClient(actor_clients(servers, timeout_s=60), connect=connect_actor)
    return ShardedPSClient([PSClient(c.address, c.authkey, timeout_s=60) for c in conns])


@pytest.mark.parametrize("plane", ["socket", "actor"])
def test_a_shard_is_added_before_the_budget_every_row_once(
    ray_instance: Any, tmp_path: Path, plane: str
) -> None:
    config = ServerConfig({"t": HostedTable(SPEC, SEED)}, world_size=1, staleness=0)
    config = replace(config, wait_timeout_s=30.0)
    servers, conns = start_servers(ray_instance, config, 1)
    spawn = ServerSpawner(config, RoleResources(cpus=0.5), client_timeout_s=60, plane=plane)
    shards = RayShards(servers, BUDGET, client=client_of(plane, servers, conns), spawn=spawn)
    clock = StepClock()
    scaling = ScalingSpec(enabled=True, interval_s=1.0, memory_horizon_s=4.0)
    controller = Controller(
        EstuaryPolicy(scaling, Bounds(min_shards=1, max_shards=2)),
        shards.sample,
        shards,
        interval_s=1.0,
        clock=clock,
        out=tmp_path,
        name="scaling_ps",
    )
    trainer = client_of(plane, servers, conns)  # one server: sharded, so it can follow a split
    batches = growing_batches()
    at: queue.Queue[int] = queue.Queue()
    go: queue.Queue[None] = queue.Queue()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            table = trainer.table("t")
            for step, ids in enumerate(batches, start=1):
                rows = table.lookup(ids, train=True)
                table.apply_gradients(ids, rows * 0.5 + 0.1)
                if step % PER == 0:
                    table.wait_applied()
                    at.put(step)
                    go.get(timeout=120)  # the controller's interval, between two steps
            table.wait_applied()
        except BaseException as exc:
            errors.append(exc)
            at.put(-1)

    try:
        controller.step()  # interval 0: nothing trained yet
        thread = threading.Thread(target=train)
        thread.start()
        while True:
            step = at.get(timeout=120)
            if step < 0:
                break
            clock.now = step / PER
            controller.step()
            go.put(None)
            if step == STEPS:
                break
        thread.join(120)
        assert not errors, errors
        clock.now += 1.0
        controller.step()  # the effect
        controller.close()
        assert shards.client is not None and shards.client.servers == 2
        assert trainer.servers == 2
        joined = trainer.clients[1]  # how the trainer reached the new server
        assert isinstance(joined, ActorPSClient) == (plane == "actor")
        final = trainer.table("t")
        state = final.state_dict(mark_clean=False)
        split_ids = [p.state_dict(mark_clean=False)["ids"] for p in final.parts]
        slot_map = trainer.slot_map
        trainer.close()

        # The state after the split loads into two fresh servers as it was.
        fresh, fresh_conns = start_servers(ray_instance, config, 2)
        try:
            resumed = ShardedPSClient(fresh_conns)
            table = resumed.table("t")
            table.load_state_dict(state)
            assert resumed.slot_map.servers == 2 and resumed.slot_map.version > 0
            for part, ids in zip(table.parts, split_ids, strict=True):
                got = part.state_dict(mark_clean=False)["ids"]
                np.testing.assert_array_equal(np.sort(got), np.sort(ids))
            resumed.close()
        finally:
            kill_all(fresh)
    finally:
        kill_all([*servers, *shards.started])

    timeline = json.loads((tmp_path / "scaling_ps.json").read_text())
    splits = [d for d in timeline["decisions"] if d["knob"] == "ps_shards" and d["new"] == 2]
    assert len(splits) == 1 and splits[0]["applied"], timeline["decisions"]
    split = splits[0]
    assert split["metrics"]["forecast_bytes"] > BUDGET >= split["metrics"]["memory_bytes"]
    assert split["migration"]["kind"] == "split" and split["migration"]["rows"] > 0
    assert split["migration"]["pause_ms"] > 0 and len(split["migration"]["memory_bytes_after"]) == 2
    assert split["effect"]["shards_after"] == 2
    assert not [d for d in timeline["decisions"] if d["knob"].startswith("shard_rows")]
    assert timeline["reversed_actions"] == 0
    # No shard ever passed its budget; one shard alone would have.
    peak = max(s["memory_bytes"] for snap in timeline["snapshots"] for s in snap["shards"])
    assert peak <= BUDGET, peak

    # Every row trained once: the same table as one local table trained alike.
    local = train_locally(batches)
    assert local.stats().bytes > BUDGET  # one shard alone crosses the budget by the end
    assert_same_rows(state, local)
    # Every trained id on exactly one server, the one the slot map names.
    for p, ids in enumerate(split_ids):
        assert (slot_map.server_of(ids) == p).all()
    held = np.concatenate(split_ids)
    assert np.unique(held).size == held.size
    np.testing.assert_array_equal(np.sort(held), np.unique(np.concatenate(batches)))


def train_locally(batches: list[np.ndarray]) -> EmbeddingTable:
    local = EmbeddingTable(replace(SPEC), seed=SEED, name="t")
    for ids in batches:
        local.apply_gradients(ids, local.lookup(ids, train=True) * 0.5 + 0.1)
    return local


def assert_same_rows(state: dict[str, np.ndarray], local: EmbeddingTable) -> None:
    want = local.state_dict()
    got_order, want_order = np.argsort(state["ids"]), np.argsort(want["ids"])
    np.testing.assert_array_equal(state["ids"][got_order], want["ids"][want_order])
    for key in [k for k in want if k == "weights" or k.startswith("opt.")]:
        np.testing.assert_array_equal(state[key][got_order], want[key][want_order], err_msg=key)


@pytest.mark.parametrize("plane", ["socket", "actor"])
def test_a_merge_retires_a_shard_between_steps_every_row_once(
    ray_instance: Any, plane: str
) -> None:
    config = ServerConfig({"t": HostedTable(SPEC, SEED)}, world_size=1, staleness=0)
    servers, conns = start_servers(ray_instance, config, 2)
    spawn = ServerSpawner(config, RoleResources(cpus=0.5), client_timeout_s=60, plane=plane)
    shards = RayShards(servers, BUDGET, client=client_of(plane, servers, conns), spawn=spawn)
    batches = growing_batches()[:20]
    # Idle through the merge (an evaluator, or a trainer whose embedding worker
    # looks up): it catches up only after the retired server is stopped. On the
    # actor plane it never asked the servers for their entries (none at hand).
    if plane == "actor":
        idle = ShardedPSClient(
            [ActorPSClient(s, timeout_s=60) for s in servers], connect=connect_actor
        )
    else:
        idle = client_of(plane, servers, conns)
    idle_table = idle.table("t")
    try:
        trainer = client_of(plane, servers, conns)
        table = trainer.table("t")
        for step, ids in enumerate(batches, start=1):
            table.apply_gradients(ids, table.lookup(ids, train=True) * 0.5 + 0.1)
            if step == 10:
                table.wait_applied()
                merge = Decision("ps_shards", 2, 1, "test: merge", {"retire": 1.0, "into": 0.0})
                assert shards.apply(merge) is None
                assert shards.last_detail is not None
                assert shards.last_detail["migration"]["kind"] == "merge"
                assert shards.servers == servers[:1] and shards.retired == servers[1:]
        table.wait_applied()
        assert trainer.servers == 1
        shards.sample(1.0)  # the trainer moved on: the retired server is stopped
        assert not shards._retiring
        with pytest.raises(ray_instance.exceptions.RayActorError):
            ray_instance.get(servers[1].endpoint.remote(), timeout=30)
        state = table.state_dict(mark_clean=False)
        trainer.close()
        idle.refresh_routing()  # the retired server is gone: it is dropped, not asked
        assert idle.servers == 1
        idle_state = idle_table.state_dict(mark_clean=False)
        np.testing.assert_array_equal(np.sort(idle_state["ids"]), np.sort(state["ids"]))
        idle.close()
    finally:
        shards.close()
        kill_all(servers)
    assert_same_rows(state, train_locally(batches))


def test_a_resume_starts_the_shards_the_checkpoint_had(ray_instance: Any, tmp_path: Path) -> None:
    """A run whose PS shards may change (``runtime.roles.ps.max`` above ``min``,
    a PS memory budget, the manager on) records its shards and slot map in every
    checkpoint; a resume starts that many shards, whatever the job's count (a
    split or merge changed it): one beyond the placement group here. Trained
    as the local runtime trains."""
    from estuary.cli import main

    from .test_ray_runtime import assert_same_tables, sets

    job_path = write_job(tmp_path)
    elastic = [
        "runtime.backend=ray",
        "runtime.roles.ps.min=1",
        "runtime.roles.ps.max=3",
        "runtime.ray.ps.memory_mb=1",
        "runtime.scaling.enabled=true",
        "runtime.scaling.interval_s=0.5",
        "runtime.scaling.merge_below=0.001",  # ~5 KB shards: no merge, no split here
    ]
    ray_run = ["train", str(job_path), "--no-progress", "--output", str(tmp_path / "ray")]
    assert main([*ray_run, *sets(*elastic, "runtime.ps_shards=2", "train.epochs=1")]) == 0
    first = load_checkpoint(tmp_path / "ray" / "checkpoints").manifest["metadata"]
    assert first[ROUTING_METADATA]["servers"] == 2
    # The job now says one shard; the checkpoint had two: two come back.
    assert main([*ray_run, "--resume", *sets(*elastic, "runtime.ps_shards=1")]) == 0
    again = load_checkpoint(tmp_path / "ray" / "checkpoints").manifest["metadata"]
    assert again[ROUTING_METADATA]["servers"] == 2
    local = ["train", str(job_path), "--no-progress", "--output", str(tmp_path / "local")]
    assert main([*local, *sets("runtime.ps_shards=2")]) == 0
    assert_same_tables(tmp_path / "ray", tmp_path / "local")


def write_growing_job(folder: Path, rows: int) -> Path:
    """``write_job``'s job (one epoch) on ``rows`` rows whose ``s1`` and ``s3``
    ids are new in every row: the tables grow all through the run."""
    import yaml

    from ..distributed.conftest import job_dict

    rng = np.random.default_rng(0)
    lines = ["label,d1,d2,s1,s2,s3"]
    for i in range(rows):
        label, d1, d2 = int(rng.random() < 0.3), int(rng.integers(0, 10)), int(rng.integers(0, 5))
        lines.append(f"{label},{d1},{d2},a{i},b{rng.integers(0, 20)},c{i}")
    (folder / "train.csv").write_text("\n".join(lines) + "\n")
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict(epochs=1)))
    return path


@pytest.mark.parametrize("plane", ["socket", "actor"])
def test_estuary_train_on_ray_adds_a_shard_mid_run_on_either_plane(
    ray_instance: Any, tmp_path: Path, plane: str
) -> None:
    """End to end: ``estuary train`` on Ray with one PS shard, a 1 MB PS memory
    budget (one shard would pass it: ~1.45 MB by the end; 16,000 rows, so the
    split lands well before the last step even on a loaded machine: at 12,000
    rows the socket plane's came at step 498 of 563 and once at the last) and
    room for a second.
    The manager adds it mid-run, between two steps while the trainer runs; the
    trainers follow over their data plane (on the actor plane they find the new
    server actor by its name). No shard passes the budget, the checkpoint
    records two shards, and the trained tables are the local runtime's."""
    from estuary.cli import main

    from .test_ray_runtime import assert_same_tables, sets

    job_path = write_growing_job(tmp_path, 16_000)
    elastic = [
        "runtime.backend=ray",
        "runtime.roles.ps.min=1",
        "runtime.roles.ps.max=2",
        "runtime.ray.ps.memory_mb=1",
        "runtime.scaling.enabled=true",
        "runtime.scaling.interval_s=0.2",
        f"runtime.ray.data_plane={plane}",
    ]
    out = tmp_path / "ray"
    assert (
        main(["train", str(job_path), "--no-progress", "--output", str(out), *sets(*elastic)]) == 0
    )
    local = tmp_path / "local"
    assert main(["train", str(job_path), "--no-progress", "--output", str(local)]) == 0

    timeline = json.loads((out / "scaling_ps.json").read_text())
    splits = [d for d in timeline["decisions"] if d["knob"] == "ps_shards"]
    assert len(splits) == 1 and splits[0]["applied"] and splits[0]["new"] == 2, splits
    final = load_checkpoint(out / "checkpoints")
    fence = splits[0]["migration"]["fence"]
    assert 0 < max(fence.values()) < final.manifest["step"], (fence, final.manifest["step"])
    assert final.manifest["metadata"][ROUTING_METADATA]["servers"] == 2
    peak = max(s["memory_bytes"] for snap in timeline["snapshots"] for s in snap["shards"])
    assert peak <= 2**20, peak
    assert_same_tables(out, local)


@pytest.mark.parametrize("plane", ["socket", "actor"])
def test_estuary_train_on_ray_merges_shards_with_embedding_workers_on_either_plane(
    ray_instance: Any, tmp_path: Path, plane: str
) -> None:
    """End to end: two trainers whose embedding workers look up (the trainers'
    own clients stay idle but for checkpoints every 10 steps and evaluation),
    two small PS shards merged into one early in the run. The retired server is
    stopped once every rank moved on; the trainers' idle clients then drop it
    when they next reach the servers instead of failing on it. The checkpoint
    records one shard and the tables are the local runtime's."""
    from estuary.cli import main

    from ..distributed.conftest import write_job
    from .test_ray_runtime import assert_same_tables, sets

    job_path = write_job(tmp_path, rows=3000)
    two = ["runtime.trainers=2", "runtime.ps_shards=2"]
    elastic = [
        "runtime.backend=ray",
        "runtime.roles.ps.min=1",
        "runtime.roles.ps.max=2",
        "runtime.ray.ps.memory_mb=1",
        "runtime.scaling.enabled=true",
        "runtime.scaling.interval_s=0.15",
        "runtime.scaling.merge_below=0.9",
        "runtime.embedding_workers=true",
        "output.checkpoint_every_steps=10",
        f"runtime.ray.data_plane={plane}",
    ]
    out, local = tmp_path / "ray", tmp_path / "local"
    run = ["train", str(job_path), "--no-progress", "--output"]
    assert main([*run, str(out), *sets(*two, *elastic)]) == 0
    assert main([*run, str(local), *sets(*two)]) == 0

    timeline = json.loads((out / "scaling_ps.json").read_text())
    merges = [d for d in timeline["decisions"] if d["knob"] == "ps_shards"]
    assert len(merges) == 1 and merges[0]["applied"] and merges[0]["new"] == 1, merges
    assert merges[0]["migration"]["kind"] == "merge"
    final = load_checkpoint(out / "checkpoints")
    assert max(merges[0]["migration"]["fence"].values()) < final.manifest["step"]
    assert final.manifest["metadata"][ROUTING_METADATA]["servers"] == 1
    assert_same_tables(out, local)


def test_a_shard_the_cluster_has_no_room_for_is_not_applied_and_splits_stop(
    ray_instance: Any,
) -> None:
    config = ServerConfig({"t": HostedTable(SPEC, SEED)}, world_size=1, staleness=0)
    servers, conns = start_servers(ray_instance, config, 1)
    spawn = ServerSpawner(config, RoleResources(cpus=100), timeout_s=1.0)
    shards = RayShards(
        servers,
        BUDGET,
        client=ShardedPSClient([PSClient(conns[0].address, conns[0].authkey)]),
        spawn=spawn,
    )
    try:
        split = Decision("ps_shards", 1, 2, "test: split", {"shard": 0.0})
        why_not = shards.apply(split)
        assert why_not is not None and "did not start within 1 s" in why_not
        assert shards.apply(split) == why_not  # no second wait
        assert shards.servers == servers and not shards.started
    finally:
        shards.close()
        kill_all(servers)


def test_on_the_actor_plane_an_unnamed_server_refuses_a_split_and_nothing_changes(
    ray_instance: Any,
) -> None:
    """A server actor started without a name cannot be found by the job's other
    clients after a split: the decision is refused naming why, before anything
    starts or moves."""
    config = ServerConfig({"t": HostedTable(SPEC, SEED)}, world_size=1, staleness=0)
    unnamed = ServerActor.remote(config, os.urandom(32))  # type: ignore[attr-defined]
    client = ShardedPSClient([ActorPSClient(unnamed, timeout_s=60)], connect=connect_actor)
    with pytest.raises(PSError, match="has no name"):
        client.clients[0].member()
    spawn = ServerSpawner(config, RoleResources(cpus=0.5), client_timeout_s=60, plane="actor")
    shards = RayShards([unnamed], BUDGET, client=client, spawn=spawn)
    try:
        why_not = shards.apply(Decision("ps_shards", 1, 2, "test: split", {"shard": 0.0}))
        assert why_not is not None and "has no name" in why_not, why_not
        assert shards.servers == [unnamed] and not shards.started
    finally:
        shards.close()
        kill_all([unnamed])


def test_a_shard_counting_admissions_gets_its_min_count_raised_live(ray_instance: Any) -> None:
    """``shard_admission:P`` on Ray: the server's tables admit only ids seen the
    new number of times from then on, and the next sample reads it back; a
    shard whose tables admit every id says there is nothing to raise."""
    from estuary.config.spec import AdmissionSpec

    counting = replace(SPEC, admission=AdmissionSpec(min_count=2, counter="exact"))
    config = ServerConfig({"t": HostedTable(counting, SEED)}, world_size=1, staleness=0)
    plain_config = ServerConfig({"t": HostedTable(SPEC, SEED)}, world_size=1, staleness=0)
    servers, conns = start_servers(ray_instance, config, 1)
    plain, _ = start_servers(ray_instance, plain_config, 1)
    try:
        shards = RayShards(servers, BUDGET)
        assert shards.sample(1.0).shards[0].admission_min_count == 2
        assert shards.apply(Decision("shard_admission:0", 2, 4, "test")) is None
        assert shards.last_detail == {"admission_min_count": {"t": 4}}
        assert shards.sample(2.0).shards[0].admission_min_count == 4
        table = ShardedPSClient(conns).table("t")
        ids = np.array([11], np.int64)
        for seen in range(1, 5):
            table.apply_gradients(ids, table.lookup(ids, train=True) * 0 + 0.1)
            table.wait_applied()
            assert (table.stats().rows == 1) == (seen == 4), seen
        at_most = shards.apply(Decision("shard_admission:0", 1 << 16, 1 << 17, "test"))
        assert at_most is not None and "count no higher" in at_most
        none = RayShards(plain, BUDGET)
        assert none.sample(1.0).shards[0].admission_min_count is None
        why = none.apply(Decision("shard_admission:0", 1, 2, "test"))
        assert why is not None and "counts admissions" in why
    finally:
        kill_all([*servers, *plain])
