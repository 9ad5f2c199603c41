"""The sizing answer: PS shards, trainers and executors for one job on N nodes.

Shards are at least what the tables' memory needs (``ids * bytes_per_row``
over ``mem_target`` of a shard's memory); executors are what parsing needs at
the pace of the rest, with ``headroom``. Trainers W and shards S are searched
on a geometric grid: in a sync step every shard serves all W trainers'
requests while they wait, and each trainer sends requests to every shard, so
neither the most trainers nor the most shards is best. The answer is the
layout that fits with the most predicted rows/s (within ``NEAR_BEST`` of it,
the one with the fewest cores), and its prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from estuary.plan.costs import Costs
from estuary.plan.model import Layout, Prediction, predict
from estuary.plan.simulator import ClusterSpec
from estuary.plan.trace import GIB

__all__ = ["Sizing", "size_job"]

GRID_STEP = 1.15  # W and S are searched on a geometric grid of this ratio
NEAR_BEST = 0.01  # layouts within 1% of the best rate: the one with fewest cores


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


def _grid(lo: int, hi: int, step: float = GRID_STEP) -> list[int]:
    """Integers from ``lo`` to ``hi`` (both in), each about ``step`` times the last."""
    out: list[int] = []
    x = float(max(lo, 1))
    while int(x) <= hi:
        if not out or int(x) != out[-1]:
            out.append(int(x))
        x = max(x * step, x + 1)
    return out


def _layout_for(
    costs: Costs, trainers: int, shards: int, c: ClusterSpec, headroom: float
) -> Layout:
    """W trainers, S shards and the executors parsing needs at their pace."""
    probe = Layout(trainers, shards, 1, c.batch_rows, c.trainer_cpus, c.ps_cpus, c.executor_cpus)
    p = predict(costs, probe)
    pace = min(v for k, v in p.limits.items() if k != "executors") * headroom
    executors = max(1, math.ceil(pace * p.cpu_s_per_row["executor"] / c.executor_cpus))
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
    """The layout of a job with ``ids`` ids that fits ``cluster`` with the most rows/s.

    Raises:
        ValueError: the tables alone do not fit the cluster's memory or cores.
    """
    c = cluster
    need = ids * costs.bytes_per_row
    min_shards = max(1, math.ceil(need / (mem_target * ps_memory_bytes)))

    def shard_memory(shards: int) -> float:
        # Shards added for CPU need less memory each: what they hold over mem_target.
        return min(ps_memory_bytes, math.ceil(need / shards / mem_target / GIB) * GIB)

    def fits(lay: Layout) -> bool:
        cores = (
            lay.trainers * c.trainer_cpus
            + lay.ps_shards * c.ps_cpus
            + lay.executors * c.executor_cpus
        )
        mem = (
            lay.trainers * c.trainer_memory_bytes
            + lay.ps_shards * shard_memory(lay.ps_shards)
            + lay.executors * c.executor_memory_bytes
        )
        return cores <= c.cores and mem <= c.memory_bytes

    best: tuple[float, float, Layout] | None = None
    for w in _grid(1, int(c.cores // c.trainer_cpus)):
        for s in _grid(min_shards, int(c.cores // c.ps_cpus)):
            lay = _layout_for(costs, w, s, c, headroom)
            if not fits(lay):
                break  # more shards fit no better
            rate = predict(costs, lay).rows_per_s
            used = w * c.trainer_cpus + s * c.ps_cpus + lay.executors * c.executor_cpus
            # The most rows/s; within NEAR_BEST of it, the fewest cores.
            if best is None or rate > best[0] * (1 + NEAR_BEST):
                best = (rate, used, lay)
            elif rate >= best[0] / (1 + NEAR_BEST) and used < best[1]:
                best = (max(rate, best[0]), used, lay)
    if best is None:
        raise ValueError(
            f"{ids:.3g} ids need {min_shards} shards of {ps_memory_bytes / GIB:.0f} GiB "
            f"({need / GIB:,.0f} GiB): more than {c.nodes} nodes hold with one trainer"
        )
    lay = best[2]
    ps_memory_bytes = shard_memory(lay.ps_shards)
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
