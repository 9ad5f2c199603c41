"""Throughput of one job layout from calibrated ``Costs``: the simulator's rate law.

A trainer step of ``b`` rows (``b`` = the per-trainer batch) costs:

  dense   ``dense_s_per_step + b * dense_s_per_row`` on the trainer, divided by the
          speed-up of its threads;
  tables  for its ``n = unique_ids(b)`` ids, ``F`` lookup and update calls plus
          ``n`` ids' lookup and update work: in the trainer when the tables are
          in-process (``ps_shards == 0``), else on the PS shards, ``1/S`` each
          (the hottest shard ``hot_factor`` times its share);
  network with a PS: 3 round trips (lookup, push, wait for the update) and
          ``n * (2 * 4D + 16)`` bytes each way at the connection's bandwidth, plus
          the CPU to copy them and the RPC's own CPU (``2S`` requests of
          ``rpc_s_per_request`` and ``n * rpc_s_per_id``), half in the trainer,
          half in the shards; with ``W > 1`` trainers an all-reduce of the
          dense gradients (``ceil(log2 W)`` round trips).

In sync mode the step is two phases in series. The trainer phase: the dense
work and the trainer's half of the RPC. The shard phase: all ``W`` trainers'
requests reach every shard at once (they left the same all-reduce), so each
shard serves ``W`` trainers' shares (its tables' work and its half of the
RPC) before the slowest trainer's reply, and the phase lasts ``W`` times one
trainer's share of a shard. With ``cores`` given (a shared machine) a phase
lasts at least its CPU over all processes over ``cores`` (``W`` trainers'
phases, or all shards' work, contend for the same cores). The job's rate is
the least of

  trainers   ``W * b / step_s`` (slowed by ``straggler``: every trainer waits for
             the slowest at the all-reduce);
  ps         ``S * ps_cpus`` cores over the tables' CPU per row (hottest shard);
  executors  ``E * executor_cpus`` cores over parse + hash per row, unless the data
             is preloaded (``estuary train`` with ``data.sources`` parses first);
  network    each shard's link: ``S * net_bytes_per_s`` over the bytes per row;
  cores      on a shared machine (``cores`` given) every process's CPU per row
             together over the machine's cores.

``predict_shared`` is the same law on a machine other processes share: a
process runs at ``cores_1`` of a core (the serial step stretches by
``1 / cores_1``) and all of the job's processes together get ``cores_n`` cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from estuary.plan.costs import Costs

__all__ = ["Layout", "Prediction", "predict", "predict_shared", "ps_memory_bytes"]

ROUND_TRIPS_PER_STEP = 3  # lookup, push, wait for the applied step


@dataclass(frozen=True)
class Layout:
    """How one job is laid out on processes.

    Args:
        trainers: W trainer processes.
        ps_shards: S parameter-server shards; 0 = tables inside the (single) trainer.
        executors: E data executors; 0 with ``preloaded`` = data parsed up front.
        batch_rows: b, rows of one trainer step.
        trainer_cpus: cores (torch threads) of each trainer.
        ps_cpus: cores of each PS shard.
        executor_cpus: cores of each executor.
        preloaded: the rows are parsed before training (no executor limit).
    """

    trainers: int
    ps_shards: int
    executors: int = 0
    batch_rows: int = 1024
    trainer_cpus: float = 1.0
    ps_cpus: float = 1.0
    executor_cpus: float = 1.0
    preloaded: bool = False

    def __post_init__(self) -> None:
        if self.trainers < 1:
            raise ValueError(f"trainers: must be >= 1, got {self.trainers}")
        if self.ps_shards < 0 or self.executors < 0:
            raise ValueError("ps_shards and executors must be >= 0")
        if self.ps_shards == 0 and self.trainers > 1:
            raise ValueError("ps_shards: W > 1 trainers share tables on >= 1 PS shard")
        if self.executors == 0 and not self.preloaded:
            raise ValueError("executors: 0 executors needs preloaded data")

    @property
    def processes(self) -> int:
        return self.trainers + self.ps_shards + self.executors


@dataclass(frozen=True)
class Prediction:
    """Predicted steady state of one layout.

    Args:
        rows_per_s: the job's training rows per second.
        bottleneck: the limit that set it (``trainers``, ``ps``, ``executors``,
            ``cores``).
        limits: rows/s each part alone would allow.
        step_s: wall seconds of one trainer step.
        cpu_s_per_row: role -> CPU seconds per trained row.
        busy: role -> fraction of its cores kept busy at ``rows_per_s``.
    """

    rows_per_s: float
    bottleneck: str
    limits: dict[str, float]
    step_s: float
    cpu_s_per_row: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)


def predict(
    costs: Costs,
    layout: Layout,
    *,
    cores: float | None = None,
    hot_factor: float = 1.0,
    straggler: float = 1.0,
) -> Prediction:
    """Steady-state rows/s of ``layout`` (see the module docstring for the law)."""
    c, w, s, b = costs, layout.trainers, layout.ps_shards, layout.batch_rows
    n = c.unique_ids(b)
    f = c.sparse_features
    dense_cpu = c.dense_s_per_step + c.dense_s_per_row * b
    table_cpu = f * (c.lookup_s_per_call + c.update_s_per_call) + n * (
        c.lookup_s_per_id + c.update_s_per_id
    )
    dense_wall = dense_cpu / c.speedup(layout.trainer_cpus)
    net_cpu, wire_bytes, step = 0.0, 0.0, 0.0
    if s == 0:
        trainer_phase, trainer_cpu = dense_wall + table_cpu, dense_cpu + table_cpu
        shard_phase = shard_cpu = 0.0
    else:
        wire_bytes = n * (2 * 4 * c.embedding_dim + 16)
        # Two requests (lookup, push) to each of S shards, plus every id's share.
        net_cpu = wire_bytes * c.net_cpu_s_per_byte + 2 * s * c.rpc_s_per_request
        net_cpu += n * c.rpc_s_per_id
        trainer_phase = dense_wall + net_cpu / 2
        trainer_cpu = dense_cpu + net_cpu / 2
        shard_phase, shard_cpu = _shard_phase(table_cpu, net_cpu, w, s, layout.ps_cpus, hot_factor)
        step += ROUND_TRIPS_PER_STEP * c.net_latency_s + wire_bytes / c.net_bytes_per_s
    if cores is not None:
        # W trainers' (then the shards') work of one step shares the machine's cores.
        trainer_phase = max(trainer_phase, w * trainer_cpu / cores)
        shard_phase = max(shard_phase, shard_cpu / cores)
    step += trainer_phase + shard_phase
    if w > 1:
        step += math.ceil(math.log2(w)) * c.net_latency_s
    parse_cpu = c.parse_s_per_row + c.hash_s_per_id * c.ids_per_row
    cpu = {
        "trainer": (dense_cpu + (table_cpu if s == 0 else net_cpu / 2)) / b,
        "ps": (table_cpu + net_cpu / 2) / b if s else 0.0,
        "executor": 0.0 if layout.preloaded else parse_cpu,
    }
    limits = {"trainers": w * b / step / straggler}
    if s:
        limits["ps"] = s * layout.ps_cpus / (cpu["ps"] * hot_factor)
    if not layout.preloaded:
        limits["executors"] = layout.executors * layout.executor_cpus / parse_cpu
        # Each shard's link carries its 1/S of every trainer's traffic.
        limits["network"] = s * c.net_bytes_per_s * b / wire_bytes
    if cores is not None:
        limits["cores"] = cores / sum(cpu.values())
    bottleneck = min(limits, key=lambda k: limits[k])
    rate = limits[bottleneck]
    role_cores = {
        "trainer": w * layout.trainer_cpus,
        "ps": s * layout.ps_cpus,
        "executor": layout.executors * layout.executor_cpus,
    }
    busy = {r: min(rate * cpu[r] / role_cores[r], 1.0) for r in role_cores if role_cores[r] > 0}
    return Prediction(rate, bottleneck, limits, step, cpu, busy)


def _shard_phase(
    table_cpu: float, net_cpu: float, w: int, s: int, ps_cpus: float, hot_factor: float
) -> tuple[float, float]:
    """(wall, CPU) of the PS part of one sync step of ``w`` trainers on ``s`` shards.

    One trainer's tables' work and half its RPC CPU (the server's end) split over
    the shards, the hottest ``hot_factor`` times its share; in a sync step all
    ``w`` trainers' requests reach every shard together, so a shard serves ``w``
    of them before the last trainer's reply leaves: its wall is ``w`` times one
    trainer's share on ``ps_cpus`` cores. The CPU is all shards' work of the step.
    """
    per_trainer = (table_cpu * hot_factor + net_cpu / 2) / s
    return w * per_trainer / max(ps_cpus, 1e-9), w * (table_cpu + net_cpu / 2)


def ps_memory_bytes(costs: Costs, ids: float, shards: int) -> float:
    """Bytes one of ``shards`` PS shards holds for ``ids`` rows spread evenly."""
    return costs.bytes_per_row * ids / max(shards, 1)


def predict_shared(costs: Costs, layout: Layout, *, cores_1: float, cores_n: float) -> Prediction:
    """``predict`` on a shared machine: one process gets ``cores_1`` of a core, the
    job's processes together ``cores_n`` cores (both probed while the job ran)."""
    free = predict(costs, layout, cores=cores_n)
    limits = dict(free.limits)
    limits["trainers"] *= min(cores_1, 1.0)
    bottleneck = min(limits, key=lambda k: limits[k])
    return Prediction(
        limits[bottleneck],
        bottleneck,
        limits,
        free.step_s / min(cores_1, 1.0),
        free.cpu_s_per_row,
        free.busy,
    )
