"""Scaling policies for the simulator: static, DLRover's public rules, Estuary's.

Each reads a ``JobMetrics`` and returns ``Decision``s; the simulator applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from estuary.plan.types import Action, Decision, JobMetrics, Role

__all__ = ["DLRoverRules", "EstuaryPolicy", "StaticPolicy"]


@dataclass
class StaticPolicy:
    """The user's spec for the whole run. After an OOM kill the user resubmits
    with twice the memory per shard (what a person on call does)."""

    name: str = "static"
    interval_s: float = 3600.0

    def decide(self, metrics: JobMetrics) -> list[Decision]:
        return []

    def on_oom(self, metrics: JobMetrics) -> list[Decision]:
        return [
            Decision(
                metrics.job,
                Role.PS,
                Action.SET_MEMORY,
                2 * metrics.ps_memory_budget_bytes,
                "oom: user doubles memory",
            )
        ]


@dataclass
class DLRoverRules:
    """A reimplementation of DLRover's public PS-job rules (its resource optimizer):
    re-plan every 300 s; add workers in proportion to the PS CPU headroom
    (``workers * target / ps_busy``, at most 2x per step) while the PS have
    headroom; add a PS when the PS CPU is over ``ps_hot``; after an OOM, double the
    memory (or the PS count when a doubled shard would not fit on a node). Data executors stay as
    the user set them (DLRover has no data-to-trainer ratio controller)."""

    name: str = "dlrover_rules"
    interval_s: float = 300.0
    ps_target: float = 0.8
    ps_hot: float = 0.9

    def decide(self, metrics: JobMetrics) -> list[Decision]:
        m = metrics
        ps_busy = m.cpu_busy.get("ps", 0.0)
        if ps_busy > self.ps_hot:
            return [
                Decision(
                    m.job,
                    Role.PS,
                    Action.SET_COUNT,
                    m.ps_shards + 1,
                    f"ps cpu {ps_busy:.2f} > {self.ps_hot}",
                )
            ]
        if 0 < ps_busy < self.ps_target:
            factor = min(self.ps_target / ps_busy, 2.0)
            workers = math.floor(m.trainers * factor)
            if workers > m.trainers:
                return [
                    Decision(
                        m.job,
                        Role.TRAINER,
                        Action.SET_COUNT,
                        workers,
                        f"ps cpu {ps_busy:.2f} < {self.ps_target}: x{factor:.2f} workers",
                    )
                ]
        return []

    def on_oom(self, metrics: JobMetrics) -> list[Decision]:
        m = metrics
        doubled = 2 * m.ps_memory_budget_bytes
        if doubled <= m.extra.get("node_memory_bytes", float("inf")):
            return [Decision(m.job, Role.PS, Action.SET_MEMORY, doubled, "oom: double memory")]
        return [Decision(m.job, Role.PS, Action.SET_COUNT, 2 * m.ps_shards, "oom: double PS")]


@dataclass
class EstuaryPolicy:
    """Estuary's policy: sizes each role to where the job's time goes.

    Every ``interval_s`` (60 s), from the job's metrics, in this order:

    1. memory: forecast when the fullest shard crosses ``mem_target`` of its budget
       at the measured growth; within ``horizon_intervals`` intervals, add shards
       so the forecast peak fits (or double the memory when no cores are free):
       acts before the OOM instead of after it;
    2. a hot shard (max/mean load > 1.5) is rebalanced; a straggling trainer
       (step time > 1.4x the median) replaced;
    3. data: trainers waiting for data (> 5% of their time) get executors in
       proportion (``E / (1 - wait)``); executors idle behind a full queue are cut
       to what the trainers consume (``E * busy / 0.8``);
    4. PS: CPU over 0.85 adds shards in proportion; under 0.3 removes one, never
       below the shards memory needed (forecast or OOM) and only when the rest
       hold the forecast for 4x the split's horizon;
    5. trainers: when trainers set the pace (busy > 0.85, no wait, PS under 0.7)
       and the cluster has free cores, 1.5x trainers; under 0.3 busy, fewer.

    Hysteresis: a decision that would reverse this policy's last change of the
    same role on the same job within ``2 * interval_s`` is dropped.
    """

    name: str = "estuary"
    interval_s: float = 60.0
    mem_target: float = 0.8
    horizon_intervals: float = 5.0
    _last: dict[tuple[int, Role], tuple[float, int]] = field(default_factory=dict)
    _memory_shards: dict[int, int] = field(default_factory=dict)  # job -> shards memory needs

    def _keep(self, m: JobMetrics, d: Decision, current: float) -> bool:
        sign = 1 if d.value > current else -1 if d.value < current else 0
        if sign == 0:
            return False
        prev = self._last.get((m.job, d.role))
        if prev is not None and prev[1] != sign and m.time_s - prev[0] < 2 * self.interval_s:
            return False
        self._last[(m.job, d.role)] = (m.time_s, sign)
        return True

    def _count(
        self, m: JobMetrics, role: Role, current: int, new: int, reason: str, out: list[Decision]
    ) -> None:
        d = Decision(m.job, role, Action.SET_COUNT, float(max(1, new)), reason)
        if self._keep(m, d, current):
            out.append(d)

    def decide(self, metrics: JobMetrics) -> list[Decision]:
        m, out = metrics, list[Decision]()
        busy = m.cpu_busy
        # 1. memory forecast
        budget = m.ps_memory_budget_bytes
        horizon = self.horizon_intervals * self.interval_s
        peak = m.ps_memory_bytes + m.ps_memory_growth_bytes_per_s * horizon
        # A merge must hold for longer than a split's horizon: it is not undone soon.
        far_peak = m.ps_memory_bytes + m.ps_memory_growth_bytes_per_s * 4 * horizon
        if peak > self.mem_target * budget:
            total = peak * m.ps_shards
            shards = math.ceil(total / (self.mem_target * budget))
            extra_cores = (shards - m.ps_shards) * m.extra.get("ps_cpus", 1.0)
            if extra_cores <= m.free_cores:
                self._memory_shards[m.job] = max(shards, self._memory_shards.get(m.job, 1))
                self._count(
                    m,
                    Role.PS,
                    m.ps_shards,
                    shards,
                    f"memory forecast {peak / budget:.2f} of budget in {horizon:.0f}s",
                    out,
                )
            else:
                out.append(
                    Decision(
                        m.job,
                        Role.PS,
                        Action.SET_MEMORY,
                        2 * budget,
                        f"memory forecast {peak / budget:.2f}, no free cores",
                    )
                )
        # 2. incidents
        if m.ps_load_max_over_mean > 1.5:
            out.append(
                Decision(
                    m.job,
                    Role.PS,
                    Action.REBALANCE,
                    1.0,
                    f"hot shard {m.ps_load_max_over_mean:.1f}x mean",
                )
            )
        if m.trainer_step_max_over_median > 1.4:
            out.append(
                Decision(
                    m.job,
                    Role.TRAINER,
                    Action.REPLACE_STRAGGLER,
                    1.0,
                    f"straggler {m.trainer_step_max_over_median:.1f}x median step",
                )
            )
        # 3. data executors
        ex_busy = busy.get("executor", 0.0)
        if m.trainer_wait_frac > 0.05:
            new = math.ceil(m.executors / (1.0 - min(m.trainer_wait_frac, 0.9)) * 1.1)
            self._count(
                m, Role.EXECUTOR, m.executors, new, f"trainer wait {m.trainer_wait_frac:.2f}", out
            )
        elif m.executor_queue >= 1.0 and ex_busy < 0.6:
            self._count(
                m,
                Role.EXECUTOR,
                m.executors,
                math.ceil(m.executors * ex_busy / 0.8),
                f"queue full, executor cpu {ex_busy:.2f}",
                out,
            )
        # 4. PS shards (unless memory already grew them)
        ps_busy = busy.get("ps", 0.0)
        if not any(d.role is Role.PS and d.action is Action.SET_COUNT for d in out):
            if ps_busy > 0.85:
                self._count(
                    m,
                    Role.PS,
                    m.ps_shards,
                    math.ceil(m.ps_shards * ps_busy / 0.7),
                    f"ps cpu {ps_busy:.2f}",
                    out,
                )
            elif (
                ps_busy < 0.3
                and m.ps_shards - 1 >= self._memory_shards.get(m.job, 1)
                and far_peak * m.ps_shards < self.mem_target * budget * (m.ps_shards - 1)
            ):
                self._count(m, Role.PS, m.ps_shards, m.ps_shards - 1, f"ps cpu {ps_busy:.2f}", out)
        # 5. trainers
        tr_busy = busy.get("trainer", 0.0)
        trainer_cores = m.extra.get("trainer_cpus", 1.0)
        if tr_busy > 0.85 and m.trainer_wait_frac < 0.05 and ps_busy < 0.7:
            room = int(m.free_cores // trainer_cores)
            new = min(math.ceil(m.trainers * 1.5), m.trainers + room)
            self._count(
                m,
                Role.TRAINER,
                m.trainers,
                new,
                f"trainer cpu {tr_busy:.2f}, ps {ps_busy:.2f}",
                out,
            )
        elif tr_busy < 0.3 and m.trainers > 1:
            self._count(
                m,
                Role.TRAINER,
                m.trainers,
                math.ceil(m.trainers * tr_busy / 0.6),
                f"trainer cpu {tr_busy:.2f}",
                out,
            )
        return out

    def on_oom(self, metrics: JobMetrics) -> list[Decision]:
        # The forecast missed (growth faster than one interval shows): grow the shards.
        m = metrics
        self._memory_shards[m.job] = max(2 * m.ps_shards, self._memory_shards.get(m.job, 1))
        self._last[(m.job, Role.PS)] = (m.time_s, 1)
        return [Decision(m.job, Role.PS, Action.SET_COUNT, 2 * m.ps_shards, "oom: double PS")]
