"""Throughput of one job layout from calibrated ``Costs``: the simulator's rate law.

A trainer step of ``b`` rows (``b`` = the per-trainer batch) costs:

  dense   ``dense_s_per_step + b * dense_s_per_row`` on the trainer, divided by the
          speed-up of its threads, plus ``allreduce_s_per_step`` (DDP over gloo)
          when ``W > 1``;
  tables  in-process (``ps_shards == 0``): ``F`` lookup and update calls plus
          ``n = unique_ids(b)`` ids' lookup and update work, in the trainer;
  PS      with ``S`` shards, measured in the multi-process layout
          (``estuary.plan.probes``): the trainer's client CPU, a lookup and a
          push to each shard (``2S`` requests of ``rpc_s_per_request``, or
          ``rpc_sharded_s_per_request`` through the sharded client) and
          ``n * rpc_s_per_id`` (``rpc_sharded_s_per_id``), and the embedding
          collection's own work on the batch (``b * collection_s_per_row``:
          dedup, pooling, the gradient's scatter; in-process it is inside the
          table figures); on each shard, for
          every trainer, 2 requests of ``ps_s_per_request`` (every table's fixed
          per-call cost is in it: each shard pays it, it does not split over
          shards) and ``n / S`` ids of ``ps_s_per_id`` (the hottest shard
          ``hot_factor`` times that);
  network 3 round trips (lookup, push, wait for the update) and
          ``n * (2 * 4D + 16)`` bytes each way at the connection's bandwidth; with
          ``W > 1`` trainers ``ceil(log2 W)`` round trips of all-reduce.

In sync mode the step is two phases in series. The trainer phase: the dense
work (and the all-reduce) and the trainer's client CPU. The shard phase: all
``W`` trainers' requests reach every shard at once (they left the same
all-reduce), so a shard serves all ``W`` trainers' requests before the slowest
trainer's reply: the phase lasts the hottest shard's CPU of the step. With
``cores`` given (a shared machine) a phase lasts at least its CPU over all
processes over ``cores`` (``W`` trainers' phases, or all shards' work, contend
for the same cores), and with shards the request chain (every trainer's
requests' CPU, then all shards' work) at least their CPU over ``cores`` times
``chain_utilisation`` (``colocated``: the calibrated machine's own): the share
of the cores such a chain keeps busy, measured by calibration (its parts wait
on each other's replies, so it does not fill the cores as independent work
would). On the calibrated machine the W > 1 trainers' phase also lasts at
least each trainer's dense step (with the all-reduce) times ``ddp_stretch``
(a DDP group's measured wall over its CPU: the ranks wait on each other), times
``ddp_stretch_oversubscribed`` with more trainers than cores (a rank waiting on
one descheduled leaves its core idle), plus its client CPU, all times
``W / cores`` when W exceeds the cores. The job's rate is the least of

  trainers   ``W * b / step_s`` (slowed by ``straggler``: every trainer waits for
             the slowest at the all-reduce);
  ps         the hottest shard's cores over its CPU per step's ``W b`` rows;
  executors  ``E * executor_cpus`` cores over parse + hash per row, unless the data
             is preloaded (``estuary train`` with ``data.sources`` parses first);
  network    each shard's link: ``S * net_bytes_per_s`` over the bytes per row;
  cores      on a shared machine (``cores`` given) every process's CPU per row
             together over the machine's cores.

``predict_shared`` is the same law on a machine other processes share: a
process runs at ``cores_1`` of a core (the serial step stretches by
``1 / cores_1``) and all of the job's processes together get ``cores_n`` cores.
Its processes run on the calibrated machine (``colocated``), where k processes
computing at once each do ``concurrent_efficiency(k)`` of their work alone per
CPU second (``parallel_efficiency`` with every core busy, measured by
calibration): the W trainers' phase is slowed by it at k = W, the shard phase
at k = S, and the core bounds count ``cores * efficiency`` cores of work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from estuary.plan.costs import Costs

__all__ = [
    "Layout",
    "Prediction",
    "predict",
    "predict_shared",
    "ps_memory_bytes",
    "rpc_client_cpu",
]

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
    colocated: bool = False,
) -> Prediction:
    """Steady-state rows/s of ``layout`` (see the module docstring for the law).

    Args:
        cores: the cores the job's processes share (a shared machine); ``None``:
            each process has its own.
        colocated: the job's processes run on the calibrated machine itself, so
            a phase in which k of them compute at once runs at
            ``costs.concurrent_efficiency(k)`` of the calibrated speed.
    """
    c, w, s, b = costs, layout.trainers, layout.ps_shards, layout.batch_rows
    eff_w = c.concurrent_efficiency(w) if colocated else 1.0
    eff_s = c.concurrent_efficiency(s) if colocated else 1.0
    n = c.unique_ids(b)
    f = c.sparse_features
    dense_cpu = c.dense_s_per_step + c.dense_s_per_row * b
    if w > 1:
        dense_cpu += c.allreduce_s_per_step  # DDP's all-reduce of the dense gradients
    table_cpu = f * (c.lookup_s_per_call + c.update_s_per_call) + n * (
        c.lookup_s_per_id + c.update_s_per_id
    )
    dense_wall = dense_cpu / c.speedup(layout.trainer_cpus)
    wire_bytes, step, requests_cpu, client_cpu = 0.0, 0.0, 0.0, 0.0
    if s == 0:
        trainer_phase, trainer_cpu = (dense_wall + table_cpu) / eff_w, dense_cpu + table_cpu
        shard_phase = shard_cpu = hottest_cpu = 0.0
    else:
        wire_bytes = n * (2 * 4 * c.embedding_dim + 16)
        # The client's requests and the collection's dedup / pooling / scatter.
        requests_cpu = rpc_client_cpu(c, s, n)
        client_cpu = requests_cpu + c.collection_s_per_row * b
        trainer_phase = (dense_wall + client_cpu) / eff_w
        trainer_cpu = dense_cpu + client_cpu
        hottest_cpu, shard_cpu = _shard_cpu(c, n, w, s, hot_factor)
        shard_phase = hottest_cpu / max(layout.ps_cpus, 1e-9) / eff_s
        step += ROUND_TRIPS_PER_STEP * c.net_latency_s + wire_bytes / c.net_bytes_per_s
    if cores is not None:
        # W trainers' (then the shards') work of one step shares the machine's cores,
        # each core doing eff(k) of its work alone while k processes compute.
        trainer_phase = max(trainer_phase, w * trainer_cpu / (cores * _eff(c, w, cores, colocated)))
        if w > 1 and colocated:
            # The DDP group's dense step stretches past its CPU: its ranks wait
            # on each other in the all-reduce, and with more trainers than cores
            # a rank waiting on a descheduled one leaves its core idle.
            ddp = _ddp_phase(c, w, cores, dense_wall, client_cpu)
            trainer_phase = max(trainer_phase, ddp)
        shard_phase = max(shard_phase, shard_cpu / (cores * _eff(c, s, cores, colocated)))
        if s and colocated:
            # The request chain (every trainer's requests, then the shards' work)
            # keeps only `chain_utilisation` of the calibrated machine's cores
            # busy: its parts wait on each other's replies and wake-ups.
            chain = (w * requests_cpu + shard_cpu) / (cores * c.chain_utilisation)
            shard_phase = max(shard_phase, chain - requests_cpu / eff_w)
    step += trainer_phase + shard_phase
    if w > 1:
        step += math.ceil(math.log2(w)) * c.net_latency_s
    parse_cpu = c.parse_s_per_row + c.hash_s_per_id * c.ids_per_row
    cpu = {
        "trainer": trainer_cpu / b,
        "ps": shard_cpu / (w * b) if s else 0.0,
        "executor": 0.0 if layout.preloaded else parse_cpu,
    }
    limits = {"trainers": w * b / step / straggler}
    if s:
        # The hottest shard's CPU of one step (W x b rows) on its cores.
        limits["ps"] = w * b * layout.ps_cpus / max(hottest_cpu, 1e-12)
    if not layout.preloaded:
        limits["executors"] = layout.executors * layout.executor_cpus / parse_cpu
        # Each shard's link carries its 1/S of every trainer's traffic.
        limits["network"] = s * c.net_bytes_per_s * b / wire_bytes
    if cores is not None:
        eff = _eff(c, layout.processes, cores, colocated)
        limits["cores"] = cores * eff / sum(cpu.values())
    bottleneck = min(limits, key=lambda k: limits[k])
    rate = limits[bottleneck]
    role_cores = {
        "trainer": w * layout.trainer_cpus,
        "ps": s * layout.ps_cpus,
        "executor": layout.executors * layout.executor_cpus,
    }
    busy = {r: min(rate * cpu[r] / role_cores[r], 1.0) for r in role_cores if role_cores[r] > 0}
    return Prediction(rate, bottleneck, limits, step, cpu, busy)


def _ddp_phase(
    costs: Costs, trainers: int, cores: float, dense_wall: float, client_cpu: float
) -> float:
    """Wall seconds of ``trainers`` colocated trainers' phase on ``cores`` cores:
    each one's dense step (with the all-reduce) stretched by the DDP group's
    measured wall over its CPU (``ddp_stretch``; ``ddp_stretch_oversubscribed``
    with more trainers than cores: both timed with one thread a process), then
    its client CPU; with more trainers than cores each gets ``cores / trainers``
    of one."""
    over = max(1.0, trainers / cores)
    stretch = costs.ddp_stretch if trainers <= cores else costs.ddp_stretch_oversubscribed
    return over * (dense_wall * stretch + client_cpu) / _eff(costs, trainers, cores, True)


def _eff(costs: Costs, processes: int, cores: float, colocated: bool) -> float:
    """Work per CPU second of the job's processes on ``cores`` shared cores: as many
    compute at once as there are processes or cores, whichever is fewer."""
    return costs.concurrent_efficiency(min(float(processes), cores)) if colocated else 1.0


def rpc_client_cpu(costs: Costs, shards: int, ids: float) -> float:
    """Trainer CPU of one step's PS requests: a lookup and a push to each of
    ``shards`` servers (through the sharded client when more than one) for
    ``ids`` unique ids."""
    c = costs
    if shards == 1:
        return 2 * c.rpc_s_per_request + ids * c.rpc_s_per_id
    return 2 * shards * c.rpc_sharded_s_per_request + ids * c.rpc_sharded_s_per_id


def _shard_cpu(costs: Costs, ids: float, w: int, s: int, hot_factor: float) -> tuple[float, float]:
    """(hottest shard, all shards) CPU of one sync step of ``w`` trainers on ``s`` shards.

    Every trainer sends each shard a lookup and a push (``2 w`` requests a shard,
    each with every table's fixed per-call costs: they do not split over shards)
    and 1/S of its ``ids`` (the hottest shard ``hot_factor`` times that). In a
    sync step all ``w`` trainers' requests reach every shard together, so a shard
    serves all of them before the last trainer's reply leaves: the phase lasts
    the hottest shard's work (on its cores).
    """
    c = costs
    hottest = w * (2 * c.ps_s_per_request + ids / s * c.ps_s_per_id * hot_factor)
    every = w * (2 * s * c.ps_s_per_request + ids * c.ps_s_per_id)
    return hottest, every


def ps_memory_bytes(costs: Costs, ids: float, shards: int) -> float:
    """Bytes one of ``shards`` PS shards holds for ``ids`` rows spread evenly."""
    return costs.bytes_per_row * ids / max(shards, 1)


def predict_shared(costs: Costs, layout: Layout, *, cores_1: float, cores_n: float) -> Prediction:
    """``predict`` on a shared machine: one process gets ``cores_1`` of a core, the
    job's processes together ``cores_n`` cores (both probed while the job ran).

    Two bounds on the step; the larger holds: the free machine's step with every
    phase at ``cores_1`` of a core, and the step with the job's phases contending
    for ``cores_n`` cores (``predict(cores=cores_n)``). They are not multiplied:
    ``cores_n`` already counts the other processes' share, so a step bound by it
    is not slowed again by ``cores_1``.
    """
    share = min(cores_1, 1.0)
    alone = predict(costs, layout, colocated=True)
    shared = predict(costs, layout, cores=cores_n, colocated=True)
    step = max(alone.step_s / share, shared.step_s)
    limits = dict(shared.limits)
    limits["trainers"] = shared.limits["trainers"] * shared.step_s / step
    bottleneck = min(limits, key=lambda k: limits[k])
    return Prediction(
        limits[bottleneck], bottleneck, limits, step, shared.cpu_s_per_row, shared.busy
    )
