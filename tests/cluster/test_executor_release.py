"""Data executors give back what they no longer use: each sits in a placement
group of its own (``cluster.place``, or reserved by the pool for executors it
adds or replaces), removed once the executor is stopped for good, replaced by
a memory change or retired by a shrink, so its reserved CPU and memory return
to the cluster while the job runs."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from ray.util.placement_group import placement_group, remove_placement_group

from estuary.config.spec import RoleResources
from estuary.runtime.ray.cluster import PlacementError, RoleAsk, place
from estuary.runtime.ray.executors import RayExecutors

pytestmark = pytest.mark.ray

SMALL = RoleResources(cpus=0.25, gpus=0.0, memory_mb=None)
EXECUTOR = RoleResources(cpus=0.5, gpus=0.0, memory_mb=64)


def reserved(ray: Any, group: Any) -> dict[str, float]:
    """The cluster's resources that ``group`` reserves (``CPU_group_<id>``, ...)."""
    tag = f"_group_{group.id.hex()}"
    return {k: v for k, v in ray.cluster_resources().items() if k.endswith(tag)}


def wait_for(check: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_replaced_and_retired_executors_give_their_reservation_back(ray_instance: Any) -> None:
    asks = [
        RoleAsk("ps", 1, SMALL),
        RoleAsk("trainer", 1, SMALL),
        RoleAsk("data_executor", 3, EXECUTOR),
    ]
    placement = place(asks, timeout_s=30.0)
    try:
        # The core roles share one group; each executor has its own.
        assert placement.first_bundle == {"ps": 0, "trainer": 1}
        groups = placement.executor_groups
        assert len(groups) == 3
        for group in groups:
            # The cluster's resource view follows the reservation asynchronously.
            assert wait_for(lambda g=group: reserved(ray_instance, g))
            held = reserved(ray_instance, group)
            assert held[f"CPU_group_{group.id.hex()}"] == 0.5
            assert held[f"memory_group_{group.id.hex()}"] == 64 * 2**20
        spec = RayExecutors(
            count=3,
            resources=EXECUTOR,
            groups=placement.live_executor_groups(),
            max_restarts=0,
            name=f"estuary-release-test-{time.monotonic_ns()}",
            direct=False,
        )
        pool = spec()
        try:
            # A shrink retires executor 2 (no split in flight: stopped at once).
            pool.resize(2)
            assert wait_for(lambda: not reserved(ray_instance, groups[2]))
            assert pool.released == [2]
            assert reserved(ray_instance, groups[0]) and reserved(ray_instance, groups[1])
            assert placement.live_executor_groups() == (groups[0], groups[1], None)
            # A memory change replaces executors 0 and 1, each in a group the
            # pool reserves with the new ask; once each replacement is up, the
            # old one stops and its group goes.
            pool.set_memory(48)
            assert wait_for(lambda: pool.starting == 0 and len(pool.released) == 3)
            assert sorted(pool.actors) == [3, 4]
            assert sorted(pool.released) == [0, 1, 2]
            for group in groups:
                assert wait_for(lambda g=group: not reserved(ray_instance, g))
                assert ray_instance.util.placement_group_table(group)["state"] == "REMOVED"
            own = dict(pool.reserved)
            assert sorted(own) == [3, 4]
            for group in own.values():
                assert wait_for(lambda g=group: reserved(ray_instance, g))
                assert reserved(ray_instance, group)[f"memory_group_{group.id.hex()}"] == 48 * 2**20
            # A grow reserves the added executor a group too; a shrink removes it.
            pool.resize(3)
            grown = pool.reserved[5]
            assert wait_for(lambda: reserved(ray_instance, grown))
            assert wait_for(lambda: pool.starting == 0)
            pool.resize(2)
            assert wait_for(lambda: not reserved(ray_instance, grown))
            assert ray_instance.util.placement_group_table(grown)["state"] == "REMOVED"
            assert sorted(pool.reserved) == [3, 4]
            # The core group stays until the job ends.
            assert reserved(ray_instance, placement.group)
            summary = pool.summary()
            assert summary["data_executor_groups_released"] == 4
            assert summary["data_executor_groups_reserved"] == 3
        finally:
            pool.close()
        # Closing removes the groups the pool reserved (no attempt reuses them).
        for group in own.values():
            assert wait_for(lambda g=group: not reserved(ray_instance, g))
        # A next attempt (a restart) gets no removed group: the pool reserves
        # its executors new ones, and they come up (none waits on a group
        # that is gone).
        again = dataclasses.replace(spec, groups=placement.live_executor_groups())
        assert again.groups == (None, None, None)
        restarted = again()
        try:
            pids = ray_instance.get([h.pid.remote() for h in restarted.actors.values()], timeout=30)
            assert len(set(pids)) == 3
            assert sorted(restarted.reserved) == [0, 1, 2]
        finally:
            restarted.close()
    finally:
        placement.remove()  # skips the groups the pool removed
    assert ray_instance.util.placement_group_table(placement.group)["state"] == "REMOVED"


def test_placement_keeps_no_group_when_the_executors_do_not_fit_in_time(
    ray_instance: Any,
) -> None:
    """All or none: the core group fits, the executors' do not (the CPUs are
    held by another group): every group is removed and the error says so."""
    total = ray_instance.cluster_resources()["CPU"]
    blocker = placement_group([{"CPU": total - 0.5}])  # 0.5 CPU left free

    # The blocker is ready once the rest is free enough, not free: wait until
    # nothing else holds CPU, so the core group fits and only the executors' do not.
    def only_blocker_holds_cpu() -> bool:
        return abs(ray_instance.available_resources().get("CPU", 0.0) - 0.5) < 1e-6

    try:
        # Blocking wait: earlier tests' actors and groups are freed asynchronously.
        ray_instance.get(blocker.ready(), timeout=30)
        assert wait_for(only_blocker_holds_cpu, 30), ray_instance.available_resources()
        asks = [RoleAsk("ps", 1, SMALL), RoleAsk("data_executor", 2, EXECUTOR)]
        before = {g for g in ray_instance.util.placement_group_table() if g}
        with pytest.raises(PlacementError, match="has not had room for them within 1 s"):
            place(asks, timeout_s=1.0)
        table = ray_instance.util.placement_group_table()
        ours = [v for k, v in table.items() if k not in before]
        assert [v["state"] for v in ours] == ["REMOVED"] * 3, ours
    finally:
        remove_placement_group(blocker)
