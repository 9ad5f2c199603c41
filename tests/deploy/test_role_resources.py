"""runtime.ray.role_resources: every role's placement bundle asks for its own
node marker, the custom resource the rendered clusters give each group's nodes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from estuary.config import JobSpec
from estuary.deploy.roles import ray_node_resources, worker_roles

cluster = pytest.importorskip("estuary.runtime.ray.cluster", reason="needs ray")


def test_bundles_ask_for_the_role_marker_the_rendered_nodes_offer(job: JobSpec) -> None:
    placed = replace(
        job, runtime=replace(job.runtime, ray=replace(job.runtime.ray, role_resources=True))
    )
    asks = {ask.role: ask for ask in cluster.role_asks(placed)}
    for plan in worker_roles(job):
        offered = ray_node_resources(plan)
        bundle = asks[plan.role].bundle()
        (marker,) = [k for k in bundle if k.startswith("estuary_")]
        assert offered["resources"] == f'{{"{marker}":1}}'
        assert bundle["CPU"] <= offered["num-cpus"]  # one process fits its node
        assert asks[plan.role].count == plan.count
    # Off (the default): no custom resource, the bundles of before.
    assert all(set(a.bundle()) <= {"CPU", "GPU", "memory"} for a in cluster.role_asks(job))
