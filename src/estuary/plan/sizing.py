"""The sizing answer: PS shards, trainers and executors for one job on N nodes.

Shards are the larger of what the tables' memory needs (``ids * bytes_per_row``
over ``mem_target`` of a shard's memory) and what the PS CPU needs at the
trainers' pace; executors are what parsing needs at that pace; both with
``headroom``. Trainers are as many as fit in the cluster with their shards and
executors (a sync job's rate grows with its trainers; the all-reduce's
``log2 W`` round trips are in the rate law), so the answer is the largest
layout that fits, and its predicted rows/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from estuary.plan.costs import Costs
from estuary.plan.model import Layout, Prediction, predict
from estuary.plan.simulator import ClusterSpec
from estuary.plan.trace import GIB

__all__ = ["Sizing", "size_job"]


@dataclass(frozen=True)
class Sizing:
    """One job's layout on a cluster and what it is predicted to do.

    Args:
        layout: the counts and cores of each role.
        prediction: rows/s, bottleneck and busy fractions of the layout.
        ids: distinct ids the tables hold.
        ps_memory_bytes: memory given to each shard.
        shard_bytes: bytes each shard holds (ids spread evenly).
        cores_used: cores of every role together.
        memory_used_bytes: memory of every role together.
        shards_for_memory: the shards the tables' bytes alone need.
    """

    layout: Layout
    prediction: Prediction
    ids: float
    ps_memory_bytes: float
    shard_bytes: float
    cores_used: float
    memory_used_bytes: float
    shards_for_memory: int

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) lines for a printed table."""
        lay, p = self.layout, self.prediction
        return [
            (
                "PS shards",
                f"{lay.ps_shards} x {lay.ps_cpus:g} cores, "
                f"{self.ps_memory_bytes / GIB:,.0f} GiB (memory alone needs "
                f"{self.shards_for_memory})",
            ),
            ("trainers", f"{lay.trainers} x {lay.trainer_cpus:g} cores, batch {lay.batch_rows}"),
            ("data executors", f"{lay.executors} x {lay.executor_cpus:g} cores"),
            ("predicted throughput", f"{p.rows_per_s:,.0f} rows/s (bound: {p.bottleneck})"),
            (
                "memory per shard",
                f"{self.shard_bytes / GIB:,.1f} GiB for {self.ids:.3g} ids "
                f"({self.ids / lay.ps_shards:.3g} rows each)",
            ),
            (
                "cores / memory used",
                f"{self.cores_used:,.0f} cores, {self.memory_used_bytes / GIB:,.0f} GiB",
            ),
        ]


def _layout_for(
    costs: Costs, trainers: int, c: ClusterSpec, min_shards: int, headroom: float
) -> Layout:
    probe = Layout(
        trainers, max(min_shards, 1), 1, c.batch_rows, c.trainer_cpus, c.ps_cpus, c.executor_cpus
    )
    p = predict(costs, probe)
    target = p.limits["trainers"] * headroom
    shards = max(min_shards, math.ceil(target * p.cpu_s_per_row["ps"] / c.ps_cpus))
    executors = max(1, math.ceil(target * p.cpu_s_per_row["executor"] / c.executor_cpus))
    return Layout(
        trainers, shards, executors, c.batch_rows, c.trainer_cpus, c.ps_cpus, c.executor_cpus
    )


def size_job(
    costs: Costs,
    ids: float,
    cluster: ClusterSpec,
    *,
    ps_memory_bytes: float = 64 * GIB,
    mem_target: float = 0.8,
    headroom: float = 1.2,
) -> Sizing:
    """The largest balanced layout of a job with ``ids`` ids that fits ``cluster``.

    Raises:
        ValueError: the tables alone do not fit the cluster's memory or cores.
    """
    c = cluster
    need = ids * costs.bytes_per_row
    min_shards = max(1, math.ceil(need / (mem_target * ps_memory_bytes)))

    def fits(lay: Layout) -> bool:
        cores = (
            lay.trainers * c.trainer_cpus
            + lay.ps_shards * c.ps_cpus
            + lay.executors * c.executor_cpus
        )
        mem = (
            lay.trainers * c.trainer_memory_bytes
            + lay.ps_shards * ps_memory_bytes
            + lay.executors * c.executor_memory_bytes
        )
        return cores <= c.cores and mem <= c.memory_bytes

    if not fits(_layout_for(costs, 1, c, min_shards, headroom)):
        raise ValueError(
            f"{ids:.3g} ids need {min_shards} shards of {ps_memory_bytes / GIB:.0f} GiB "
            f"({need / GIB:,.0f} GiB): more than {c.nodes} nodes hold with one trainer"
        )
    lo, hi = 1, 2
    while fits(_layout_for(costs, hi, c, min_shards, headroom)):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the largest W that fits (fitting is monotone in W)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(_layout_for(costs, mid, c, min_shards, headroom)) else (lo, mid)
    lay = _layout_for(costs, lo, c, min_shards, headroom)
    # Shards added for CPU need less memory each: what they hold over mem_target.
    ps_memory_bytes = min(ps_memory_bytes, math.ceil(need / lay.ps_shards / mem_target / GIB) * GIB)
    return Sizing(
        layout=lay,
        prediction=predict(costs, lay),
        ids=ids,
        ps_memory_bytes=ps_memory_bytes,
        shard_bytes=need / lay.ps_shards,
        cores_used=lay.trainers * c.trainer_cpus
        + lay.ps_shards * c.ps_cpus
        + lay.executors * c.executor_cpus,
        memory_used_bytes=lay.trainers * c.trainer_memory_bytes
        + lay.ps_shards * ps_memory_bytes
        + lay.executors * c.executor_memory_bytes,
        shards_for_memory=min_shards,
    )
