"""The jobs a simulated cluster runs: shapes, user specs and the incidents they meet.

``make_trace`` draws ``jobs`` jobs from one seed:

- arrivals: a Poisson process (exponential gaps of mean ``mean_gap_s``);
- sizes, heavy-tailed: training rows ~ Pareto(1.3) (most jobs small, a few
  up to 30x the median), distinct ids grow with rows, the dense model's cost per
  row x lognormal(0, 0.5), the natural width W* (trainers) ~ 1 + Pareto;
- the user's spec: the balanced layout for W* (PS shards and executors such that
  neither limits W* trainers, by ``model.predict``) with every count multiplied by
  lognormal(0, 0.8) (clipped to [1/4, 4]: over- and under-provisioned), and PS
  memory = the need at the job's final table size x lognormal(0, 0.5) (about
  a third of the jobs ask for less than they will need);
- incidents: a third of the jobs get a hot shard (one shard takes 2-4x the
  mean load) from a random point on, a quarter a straggling trainer (1.5-3x
  slower) for 30 min; node failures are drawn by the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from estuary.plan.costs import Costs
from estuary.plan.model import Layout, predict

__all__ = ["SimJob", "balanced_layout", "balanced_specs", "make_trace"]

GIB = float(1 << 30)


@dataclass(frozen=True)
class SimJob:
    """One job of a trace.

    Args:
        id: index in the trace.
        arrival_s: submission time.
        rows_total: training rows to process.
        ids_total: distinct ids the tables hold once every row was seen.
        ids_scale_rows: rows after which 63% of ``ids_total`` were seen
            (``ids(r) = ids_total * (1 - exp(-r / ids_scale_rows))``).
        dense_mult: the dense step's cost relative to the calibrated model's.
        trainers, ps_shards, executors: the user's counts.
        ps_memory_bytes: the user's memory per PS shard.
        hot_factor: the busiest shard's load over the mean once hot (1: never).
        hot_at_frac: fraction of ``rows_total`` at which the hot shard appears.
        straggler_factor: a trainer's slowdown once straggling (1: never).
        straggler_at_frac: fraction of ``rows_total`` at which it starts.
        straggler_s: how long it lasts unless replaced.
        balanced: (trainers, PS shards, executors) of the balanced layout the
            user's counts were drawn around (a well-sized static spec).
    """

    id: int
    arrival_s: float
    rows_total: float
    ids_total: float
    ids_scale_rows: float
    dense_mult: float
    trainers: int
    ps_shards: int
    executors: int
    ps_memory_bytes: float
    hot_factor: float = 1.0
    hot_at_frac: float = 1.0
    straggler_factor: float = 1.0
    straggler_at_frac: float = 1.0
    straggler_s: float = 1800.0
    balanced: tuple[int, int, int] = (1, 1, 1)

    def ids_at(self, rows: float) -> float:
        """Distinct ids in the tables after ``rows`` rows."""
        return self.ids_total * -math.expm1(-rows / self.ids_scale_rows)

    def rows_at_ids(self, ids: float) -> float:
        """Rows after which the tables hold ``ids`` ids (inf if never)."""
        if ids >= self.ids_total:
            return math.inf
        return -self.ids_scale_rows * math.log1p(-ids / self.ids_total)


def balanced_layout(
    costs: Costs,
    trainers: int,
    *,
    batch_rows: int,
    trainer_cpus: float,
    ps_cpus: float,
    executor_cpus: float,
    headroom: float = 1.2,
) -> Layout:
    """PS shards and executors such that ``trainers`` trainers set the pace with
    ``headroom`` to spare (the layout a careful user would ask for)."""
    probe = Layout(trainers, 1, 1, batch_rows, trainer_cpus, ps_cpus, executor_cpus)
    p = predict(costs, probe)
    target = p.limits["trainers"] * headroom
    shards = max(1, math.ceil(target * p.cpu_s_per_row["ps"] / ps_cpus))
    executors = max(1, math.ceil(target * p.cpu_s_per_row["executor"] / executor_cpus))
    return Layout(trainers, shards, executors, batch_rows, trainer_cpus, ps_cpus, executor_cpus)


def make_trace(
    costs: Costs,
    *,
    jobs: int = 200,
    seed: int = 0,
    mean_gap_s: float = 150.0,
    batch_rows: int = 2048,
    trainer_cpus: float = 2.0,
    ps_cpus: float = 2.0,
    executor_cpus: float = 1.0,
    median_rows: float = 2e8,
    max_shard_bytes: float = 128 * GIB,
) -> list[SimJob]:
    """``jobs`` jobs drawn from ``seed`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    t = 0.0
    out = []
    for i in range(jobs):
        t += float(rng.exponential(mean_gap_s))
        rows = median_rows * min(float(rng.pareto(1.3) + 1.0) / 1.7, 30.0)
        ids = rows * float(rng.uniform(0.5, 3.0)) * costs.sparse_features * 0.1
        scale = rows * float(rng.uniform(0.3, 2.0))
        mult = float(np.exp(rng.normal(0.0, 0.5)))
        width = int(min(32, 1 + math.floor(float(rng.pareto(1.5)) * 3)))
        job_costs = scaled(costs, mult)
        ideal = balanced_layout(
            job_costs,
            width,
            batch_rows=batch_rows,
            trainer_cpus=trainer_cpus,
            ps_cpus=ps_cpus,
            executor_cpus=executor_cpus,
        )

        def skew(n: int) -> int:
            return max(1, round(n * float(np.clip(np.exp(rng.normal(0.0, 0.8)), 0.25, 4.0))))

        shards_for_memory = math.ceil(costs.bytes_per_row * ids / (max_shard_bytes / 2))
        shards = skew(ideal.ps_shards)
        # No user asks for a shard bigger than half a node: more shards instead.
        shards = max(shards, shards_for_memory)
        need = costs.bytes_per_row * ids / shards
        memory = min(max(GIB, need * float(np.exp(rng.normal(0.1, 0.5)))), max_shard_bytes)
        hot = rng.random() < 1 / 3
        slow = rng.random() < 1 / 4
        out.append(
            SimJob(
                id=i,
                arrival_s=t,
                rows_total=rows,
                ids_total=ids,
                ids_scale_rows=scale,
                dense_mult=mult,
                trainers=min(skew(width), 64),
                ps_shards=shards,
                executors=skew(ideal.executors),
                ps_memory_bytes=memory,
                hot_factor=float(rng.uniform(2.0, 4.0)) if hot else 1.0,
                hot_at_frac=float(rng.uniform(0.0, 0.6)) if hot else 1.0,
                straggler_factor=float(rng.uniform(1.5, 3.0)) if slow else 1.0,
                straggler_at_frac=float(rng.uniform(0.0, 0.7)) if slow else 1.0,
                balanced=(width, max(ideal.ps_shards, shards_for_memory), ideal.executors),
            )
        )
    return out


def balanced_specs(jobs: list[SimJob]) -> list[SimJob]:
    """The same jobs with the balanced counts instead of the user's (memory kept):
    the best a static spec does without knowing a job's incidents."""
    return [
        replace(j, trainers=j.balanced[0], ps_shards=j.balanced[1], executors=j.balanced[2])
        for j in jobs
    ]


def scaled(costs: Costs, dense_mult: float) -> Costs:
    """``costs`` with the dense step ``dense_mult`` times as expensive."""
    from dataclasses import replace

    return replace(
        costs,
        dense_s_per_row=costs.dense_s_per_row * dense_mult,
        dense_s_per_step=costs.dense_s_per_step * dense_mult,
    )
