"""Data executors added and removed while a ``data.dataset`` job reads (the
scaling manager's horizontal knob, ``RayExecutorPool.resize``): no restart, no
split lost or read twice. The pool feeds a ``Driver`` whose progress records
every trained batch; resizes and a thread change happen at fixed batches
mid-run, with splits in flight."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.util.placement_group import placement_group, remove_placement_group

from estuary.config import load_job
from estuary.config.spec import RoleResources
from estuary.data.graph import Driver
from estuary.runtime.ray.executors import RayExecutors

from ..graph.conftest import write_hours
from ..graph.test_multi_trainer import write_job

pytestmark = pytest.mark.ray
HOURS = 6


def test_executors_added_and_removed_mid_run_train_every_row_exactly_once(
    ray_instance: Any, tmp_path: Path
) -> None:
    written = write_hours(tmp_path, HOURS, 120, files=3)  # 18 splits, 2,160 rows
    path = write_job(tmp_path, HOURS, mode="sync")
    raw = yaml.safe_load(path.read_text())
    raw["data"]["dataset"]["executor"].update(workers=4, lookahead_splits=4)
    path.write_text(yaml.safe_dump(raw))
    job = load_job(path)
    group = placement_group([{"CPU": 0.25}])
    ray_instance.get(group.ready())
    spec = RayExecutors(
        count=1,
        resources=RoleResources(cpus=0.25, gpus=0.0, memory_mb=None),
        groups=(group,),
        max_restarts=0,
        name="estuary-elastic-test",
        direct=False,
        max_threads=2,
        bridge=1,
    )
    pool = spec()
    driver = Driver(job.data, job.base_dir, batch_size=16, pool=pool, seed=3)
    # batch -> what happens: grow, a larger memory ask (each executor replaced),
    # more threads, shrink; then, once the retired executors have stopped (their
    # splits in flight handed on), grow again.
    schedule = {3: ("resize", 3), 6: ("memory", 300), 12: ("threads", 2), 25: ("resize", 1)}
    seen, regrown, swapped = [], False, None
    try:
        for i, batch in enumerate(driver.batches()):
            driver.progress.record(batch.row_ids)
            if i in schedule:
                what, n = schedule[i]
                {"resize": pool.resize, "threads": pool.set_threads, "memory": pool.set_memory}[
                    what
                ](n)
            elif i == 7:  # the replacements swap in once up (the reads go on meanwhile)
                deadline = time.monotonic() + 120
                while pool.starting and time.monotonic() < deadline:
                    time.sleep(0.05)
                swapped = (sorted(pool.actors), pool.memory_usage())
            elif i > 25 and not regrown and pool.running == 1:
                pool.resize(2)
                regrown = True
            seen.append((i, pool.count, pool.running))
    finally:
        driver.close()
        if ray_instance.util.placement_group_table(group)["state"] != "REMOVED":
            remove_placement_group(group)
    assert len(seen) > 40  # every change happened mid-run
    # Retired executors stopped once their splits in flight were handed on.
    assert regrown and seen[-1][1:] == (2, 2)
    assert [r["to"] for r in pool.summary()["data_executor_resizes"]] == [3, 1, 2]
    assert swapped is not None
    actors, memory = swapped
    assert actors == [3, 4, 5]  # executors 0-2 replaced, none added or lost
    assert memory is not None and memory.budget_bytes == 300 * 2**20
    assert 0 < memory.base_bytes <= memory.peak_bytes
    assert pool.summary()["data_executor_memory_changes"] == [{"from_mb": None, "to_mb": 300}]
    # Executor 0, replaced, gave its placement group back; no later one took it.
    # Every other executor had a group the pool reserved (1-2 and 6 grown, 3-5
    # replacing 0-2 with the larger ask); those retired or replaced (1, 2, 4,
    # 5) gave theirs back at once, the rest went when the pool closed.
    assert sorted(pool.released) == [0, 1, 2, 4, 5]
    assert ray_instance.util.placement_group_table(group)["state"] == "REMOVED"
    assert pool.summary()["data_executor_groups_reserved"] == 6 and not pool.reserved
    assert pool.summary()["data_executor_restarts"] == 0
    # Each executor reported its reads' CPU past its first (warm-up) read:
    # some, and no more than the reads' wall time (one thread each).
    cpu, wall = pool.clock.cpu()
    assert 0 < cpu <= wall
    # The first grow (1 -> 3 at 1 read each, one bridged read per executor): executor 0
    # read one more split at once while the new ones started, then gave it back.
    assert pool.summary()["data_executor_bridged_starts"] >= 1
    assert sum(pool._loans.values()) == 0 and not pool._lent
    progress = driver.progress
    assert progress.duplicate_rows == 0
    assert progress.rows_trained == written.rows
    trained: dict[str, list[int]] = {}
    for splits in progress.accounting().values():
        for split, ranges in splits.items():
            trained.setdefault(split, []).extend(r for a, b in ranges for r in range(a, b))
    assert {split: sorted(rows) for split, rows in trained.items()} == written.good
    assert progress.tasks_committed == HOURS


def test_a_ray_job_with_scaling_on_trains_every_row_once_and_logs_its_timeline(
    ray_instance: Any, tmp_path: Path
) -> None:
    """``runtime.scaling.enabled`` on a ``data.dataset`` job on Ray: the manager
    runs on rank 0 beside the executors for the whole run; whatever it decides
    (timing decides, so not asserted), every row is trained once and the run
    folder holds the timeline: a snapshot per interval, each decision with its
    trigger, none reversed, and the plot."""
    from estuary.runtime.ray import RayRuntime

    from ..graph.conftest import assert_every_row_once

    written = write_hours(tmp_path, HOURS, 400, files=2)
    path = write_job(tmp_path, HOURS, mode="sync")
    raw = yaml.safe_load(path.read_text())
    raw["data"]["dataset"]["executor"].update(workers=4, lookahead_splits=4)
    raw["runtime"] = {
        "backend": "ray",
        # An ask far below what an executor process holds: the manager raises it.
        "roles": {"data_executor": {"count": 1, "min": 1, "max": 3, "cpus": 0.25, "memory_mb": 16}},
        "scaling": {"enabled": True, "interval_s": 0.5, "max_executor_memory_mb": 8192},
    }
    path.write_text(yaml.safe_dump(raw))
    result = RayRuntime().run(load_job(path), progress=False)
    assert_every_row_once(path, written, HOURS)
    folder = tmp_path / "out"
    timeline = json.loads((folder / "scaling.json").read_text())
    assert timeline["policy"] == "estuary" and timeline["snapshots"]
    assert timeline["snapshots"][0]["executors"] == 1
    assert all(1 <= s["executors"] <= 3 for s in timeline["snapshots"])
    memory = [s["executor_memory"] for s in timeline["snapshots"] if s["executor_memory"]]
    assert memory and all(0 < m["base_bytes"] <= m["peak_bytes"] for m in memory)
    assert all(d["trigger"] and "metrics" in d for d in timeline["decisions"])
    assert timeline["reversed_actions"] == 0
    assert (folder / "scaling.png").stat().st_size > 0
    resizes = result.extra.get("data_executor_resizes", [])
    applied = [d for d in timeline["decisions"] if d["applied"]]
    assert [r["to"] for r in resizes] == [d["new"] for d in applied if d["knob"] == "executors"]
    # runtime.scaling.bridge_reads (default 4) reaches the job's pool: a grow is
    # bridged by the running executor while the added ones start.
    grew = any(d["new"] > d["old"] for d in applied if d["knob"] == "executors")
    assert (result.extra.get("data_executor_bridged_starts", 0) >= 1) == grew
    # The memory ask: raised (from 16 MiB, far below what an executor holds) in
    # strides of 1.5x at least, each to hold the peak that crossed 0.8 of it.
    moves = [d for d in applied if d["knob"] == "executor_memory"]
    raised = [d for d in moves if d["new"] > d["old"]]
    assert 1 <= len(raised) <= 3 and raised[0]["old"] == 16
    for d in raised:
        peak = d["metrics"]["executor_peak_bytes"]
        assert d["new"] >= 1.5 * d["old"] and d["new"] * 2**20 * 0.8 >= min(peak, 8192 * 2**20)
    # A lowering (peaks below 0.4 of the ask for a stretch) never goes below 16 MiB.
    assert all(d["new"] >= 16 for d in moves if d["new"] < d["old"])
    changes = result.extra["data_executor_memory_changes"]
    assert changes == [{"from_mb": d["old"], "to_mb": d["new"]} for d in moves]
    # The last snapshot's budget is the ask of the last move decided before it (a
    # move decided at the last interval has no snapshot after it).
    last = [s for s in timeline["snapshots"] if s["executor_memory"]][-1]
    before = [d for d in moves if d["interval"] < last["interval"]]
    want_mb = before[-1]["new"] if before else 16
    assert last["executor_memory"]["budget_bytes"] == want_mb * 2**20


def test_on_ray_the_manager_caps_a_growing_ps_shard_before_its_budget(
    ray_instance: Any, tmp_path: Path
) -> None:
    """Every row brings a new id, so each PS shard's table grows all run long
    (~2 MiB each unbounded, measured in-process). With a 1 MiB budget per shard
    and the manager on, the driver caps the shards' rows on the forecast: no
    snapshot of a shard's memory is over the budget, and the final tables hold
    fewer ids than the run saw (the cap evicted cold rows)."""
    from estuary.runtime.ray import RayRuntime

    from ..graph.conftest import hour_dir

    hours, rows = 8, 6000
    for hour in range(hours):
        folder = hour_dir(tmp_path, hour)
        folder.mkdir(parents=True)
        lines = [
            f"{i % 2}\t{i % 9}\t{i % 4}\t{hour * rows + i:06x}\t{i % 7:04x}" for i in range(rows)
        ]
        (folder / "part-00000.tsv").write_text("\n".join(lines) + "\n")
        (folder / "_SUCCESS").write_text("")
    path = write_job(tmp_path, hours, mode="sync")
    raw = yaml.safe_load(path.read_text())
    raw["train"]["batch_size"] = 256
    raw["output"]["checkpoint_every_steps"] = None
    raw["model"]["embedding"]["default"]["eviction"] = {"capacity_rows": 10**7}
    raw["runtime"] = {
        "backend": "ray",
        "roles": {"ps": {"count": 2, "memory_mb": 1}},
        "scaling": {"enabled": True, "interval_s": 0.5, "memory_horizon_s": 10},
    }
    path.write_text(yaml.safe_dump(raw))
    RayRuntime().run(load_job(path), progress=False)
    timeline = json.loads((tmp_path / "out" / "scaling_ps.json").read_text())
    budget = 2**20
    memory = [sh["memory_bytes"] for s in timeline["snapshots"] for sh in s["shards"]]
    assert memory and max(memory) <= budget, max(memory)
    caps = [d for d in timeline["decisions"] if d["knob"].startswith("shard_rows") and d["applied"]]
    assert caps and all(d["metrics"]["memory_bytes"] < budget for d in caps)
    final = timeline["snapshots"][-1]["shards"]
    assert sum(sh["rows"] for sh in final) < hours * rows
    assert timeline["reversed_actions"] == 0
