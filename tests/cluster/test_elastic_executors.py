"""Data executors added and removed while a ``data.dataset`` job reads (the
scaling manager's horizontal knob, ``RayExecutorPool.resize``): no restart, no
split lost or read twice. The pool feeds a ``Driver`` whose progress records
every trained batch; resizes and a thread change happen at fixed batches
mid-run, with splits in flight."""

from __future__ import annotations

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
        group=group,
        first_bundle=0,
        max_restarts=0,
        name="estuary-elastic-test",
        direct=False,
        max_threads=2,
    )
    pool = spec()
    driver = Driver(job.data, job.base_dir, batch_size=16, pool=pool, seed=3)
    # batch -> (what happens, executors after): grow, more threads, shrink, grow.
    schedule = {3: ("resize", 3), 12: ("threads", 2), 25: ("resize", 1), 40: ("resize", 2)}
    seen = []
    try:
        for i, batch in enumerate(driver.batches()):
            driver.progress.record(batch.row_ids)
            if i in schedule:
                what, n = schedule[i]
                pool.resize(n) if what == "resize" else pool.set_threads(n)
            seen.append((pool.count, pool.running))
    finally:
        driver.close()
        remove_placement_group(group)
    assert len(seen) > 40  # every change happened mid-run
    # Retired executors stop once their split in flight is handed on.
    assert (1, 1) in seen[26:40] and seen[-1] == (2, 2)
    assert [r["to"] for r in pool.summary()["data_executor_resizes"]] == [3, 1, 2]
    assert pool.summary()["data_executor_restarts"] == 0
    progress = driver.progress
    assert progress.duplicate_rows == 0
    assert progress.rows_trained == written.rows
    trained: dict[str, list[int]] = {}
    for splits in progress.accounting().values():
        for split, ranges in splits.items():
            trained.setdefault(split, []).extend(r for a, b in ranges for r in range(a, b))
    assert {split: sorted(rows) for split, rows in trained.items()} == written.good
    assert progress.tasks_committed == HOURS
