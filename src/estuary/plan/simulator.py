"""A discrete-event simulator of a shared cluster running training jobs.

Events (a heap ordered by time): job arrivals, policy ticks (every running job,
every ``policy.interval_s``), node failures and repairs, the end of a pause, and
each job's next completion, OOM kill, hot-shard or straggler onset. Between two
events every job's rate is constant (``model.predict`` on its layout, costs and
incidents), so progress and table growth advance in closed form and the next
completion or OOM time is solved exactly (re-solved after every event).

The controller is the simulator: a policy only returns ``Decision``s; this
module checks them against the cluster's free resources, applies them, charges
their pause (``ClusterSpec.pause_s``) and logs them. Scheduling is FIFO with
backfill on cores and memory. A node failure kills a job with a process on the
node (weighted by cores held): it restarts from its last checkpoint.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from estuary.plan.costs import Costs
from estuary.plan.model import Layout, Prediction, predict
from estuary.plan.trace import GIB, SimJob, scaled
from estuary.plan.types import Action, Decision, JobMetrics, Policy, Role

__all__ = ["ClusterSpec", "JobState", "SimResult", "simulate"]

REBALANCED_LOAD = 1.1  # max/mean shard load after moving a hot shard's ranges
MAX_OOMS_PER_JOB = 50  # a policy that lets a job die more often than this loops forever


@dataclass(frozen=True)
class ClusterSpec:
    """The simulated cluster and what its operations cost.

    Args:
        nodes: machines.
        cores_per_node: logical CPUs of each.
        memory_per_node_bytes: memory of each.
        trainer_cpus, ps_cpus, executor_cpus: cores of one process of each role.
        trainer_memory_bytes, executor_memory_bytes: memory of one trainer / executor.
        batch_rows: rows of one trainer step.
        node_mtbf_s: mean time between failures of one node (0: none).
        node_repair_s: how long a failed node is gone.
        checkpoint_every_s: a running job's checkpoint interval.
        restart_s: a killed job's time to restart (schedule, load the checkpoint).
        pause_s: role -> seconds the job stops when that role is resized
            (executors join live: 0; trainers re-form the all-reduce group; PS
            shards move id ranges between steps).
        rebalance_s: pause of moving a hot shard's ranges.
        replace_s: pause of replacing a straggling trainer.
        max_job_share: the most of the cluster's cores a policy may give one job.
    """

    nodes: int = 100
    cores_per_node: int = 32
    memory_per_node_bytes: float = 256 * GIB
    trainer_cpus: float = 2.0
    ps_cpus: float = 2.0
    executor_cpus: float = 1.0
    trainer_memory_bytes: float = 8 * GIB
    executor_memory_bytes: float = 2 * GIB
    batch_rows: int = 2048
    node_mtbf_s: float = 3 * 86400.0
    node_repair_s: float = 1800.0
    checkpoint_every_s: float = 900.0
    restart_s: float = 180.0
    pause_s: dict[str, float] = field(
        default_factory=lambda: {"trainer": 30.0, "ps": 30.0, "executor": 0.0}
    )
    rebalance_s: float = 15.0
    replace_s: float = 30.0
    max_job_share: float = 0.25

    @property
    def cores(self) -> float:
        return float(self.nodes * self.cores_per_node)

    @property
    def memory_bytes(self) -> float:
        return self.nodes * self.memory_per_node_bytes


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"

    @property
    def is_terminal(self) -> bool:
        return self is JobState.DONE


@dataclass
class _Run:
    """A job's mutable state in the simulation."""

    job: SimJob
    costs: Costs
    trainers: int
    ps_shards: int
    executors: int
    ps_memory_bytes: float
    state: JobState = JobState.QUEUED
    rows: float = 0.0
    checkpoint_rows: float = 0.0
    checkpoint_at_s: float = 0.0
    started_s: float = math.nan
    finished_s: float = math.nan
    paused_until_s: float = 0.0
    hot: float = 1.0
    hot_fixed: bool = False
    straggler: float = 1.0
    straggler_until_s: float = 0.0
    ooms: int = 0
    version: int = 0
    pred: Prediction | None = None
    last_mem_bytes: float = 0.0
    last_tick_s: float = 0.0

    def cores(self, c: ClusterSpec) -> float:
        return (
            self.trainers * c.trainer_cpus
            + self.ps_shards * c.ps_cpus
            + self.executors * c.executor_cpus
        )

    def memory(self, c: ClusterSpec) -> float:
        return (
            self.trainers * c.trainer_memory_bytes
            + self.ps_shards * self.ps_memory_bytes
            + self.executors * c.executor_memory_bytes
        )

    def shard_bytes(self) -> float:
        """The fullest shard's bytes (a hot shard holds no more rows: load, not size)."""
        return self.costs.bytes_per_row * self.job.ids_at(self.rows) / self.ps_shards


@dataclass
class SimResult:
    """What one policy did to one trace.

    Args:
        policy: the policy's name.
        jct_s: job id -> completion time minus arrival.
        makespan_s: last completion.
        cpu_util: cores doing work over cores allocated, time-averaged.
        cluster_cpu_util: cores doing work over the cluster's cores, until makespan.
        memory_util: PS bytes in use over PS bytes allocated, time-averaged.
        ooms: PS shards killed for memory.
        failures: jobs killed by node failures.
        decisions: every applied decision: time, job, role, action, value, reason.
        reversed_actions: decisions that undid one on the same job and role
            within two of the policy's intervals.
    """

    policy: str
    jct_s: dict[int, float]
    makespan_s: float
    cpu_util: float
    cluster_cpu_util: float
    memory_util: float
    ooms: int
    failures: int
    decisions: list[dict[str, Any]]
    reversed_actions: int

    @property
    def mean_jct_s(self) -> float:
        return float(np.mean(list(self.jct_s.values())))

    def summary(self) -> dict[str, Any]:
        v = np.array(list(self.jct_s.values()))
        return {
            "policy": self.policy,
            "jobs": len(v),
            "mean_jct_s": float(v.mean()),
            "p50_jct_s": float(np.percentile(v, 50)),
            "p95_jct_s": float(np.percentile(v, 95)),
            "makespan_s": self.makespan_s,
            "cpu_util": self.cpu_util,
            "cluster_cpu_util": self.cluster_cpu_util,
            "memory_util": self.memory_util,
            "ooms": self.ooms,
            "failures": self.failures,
            "decisions": len(self.decisions),
            "reversed_actions": self.reversed_actions,
        }


_ROLE_FIELD = {Role.TRAINER: "trainers", Role.PS: "ps_shards", Role.EXECUTOR: "executors"}


class _Sim:
    def __init__(
        self, jobs: list[SimJob], costs: Costs, policy: Policy, cluster: ClusterSpec, seed: int
    ) -> None:
        self.c, self.policy, self.rng = cluster, policy, np.random.default_rng(seed)
        self.runs = [
            _Run(
                j,
                scaled(costs, j.dense_mult),
                j.trainers,
                j.ps_shards,
                j.executors,
                j.ps_memory_bytes,
            )
            for j in jobs
        ]
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.down_nodes = 0
        self.decisions: list[dict[str, Any]] = []
        self.failures = 0
        self.used_core_s = self.alloc_core_s = self.mem_used_s = self.mem_alloc_s = 0.0

    # -- events ---------------------------------------------------------------
    def push(self, t: float, kind: str, job: int = -1, version: int = -1) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, job, version))

    def capacity(self) -> tuple[float, float]:
        up = self.c.nodes - self.down_nodes
        return up * self.c.cores_per_node, up * self.c.memory_per_node_bytes

    def free(self) -> tuple[float, float]:
        cores, mem = self.capacity()
        for r in self.runs:
            if r.state is JobState.RUNNING:
                cores -= r.cores(self.c)
                mem -= r.memory(self.c)
        return cores, mem

    def rate(self, r: _Run) -> float:
        if r.state is not JobState.RUNNING or self.now < r.paused_until_s:
            return 0.0
        return r.pred.rows_per_s if r.pred else 0.0

    def refresh(self, r: _Run) -> None:
        """Re-predict ``r``'s rate and re-solve its next completion / OOM / onset."""
        c = self.c
        if r.straggler > 1 and self.now >= r.straggler_until_s:
            r.straggler = 1.0
        layout = Layout(
            r.trainers,
            r.ps_shards,
            r.executors,
            c.batch_rows,
            c.trainer_cpus,
            c.ps_cpus,
            c.executor_cpus,
        )
        r.pred = predict(r.costs, layout, hot_factor=r.hot, straggler=r.straggler)
        r.version += 1
        rate = self.rate(r)
        if rate <= 0:
            return
        j = r.job
        self.push(self.now + (j.rows_total - r.rows) / rate, "done", j.id, r.version)
        oom_rows = j.rows_at_ids(r.ps_memory_bytes * r.ps_shards / r.costs.bytes_per_row)
        if oom_rows < j.rows_total:
            self.push(self.now + max(oom_rows - r.rows, 0.0) / rate, "oom", j.id, r.version)
        for frac, kind in ((j.hot_at_frac, "hot"), (j.straggler_at_frac, "straggle")):
            at = frac * j.rows_total
            if at > r.rows and (
                (kind == "hot" and r.hot == 1 and not r.hot_fixed)
                or (
                    kind == "straggle"
                    and r.straggler == 1
                    and j.straggler_factor > 1
                    and r.straggler_until_s == 0
                )
            ):
                self.push(self.now + (at - r.rows) / rate, kind, j.id, r.version)
        if r.straggler > 1:
            self.push(r.straggler_until_s, "refresh", j.id, r.version)

    def advance(self, t: float) -> None:
        dt = t - self.now
        if dt <= 0:
            return
        for r in self.runs:
            if r.state is not JobState.RUNNING:
                continue
            rate = self.rate(r)
            r.rows = min(r.rows + rate * dt, r.job.rows_total)
            assert r.pred is not None
            self.used_core_s += rate * sum(r.pred.cpu_s_per_row.values()) * dt
            self.alloc_core_s += r.cores(self.c) * dt
            self.mem_used_s += r.shard_bytes() * r.ps_shards * dt
            self.mem_alloc_s += r.ps_memory_bytes * r.ps_shards * dt
            if t - r.checkpoint_at_s >= self.c.checkpoint_every_s:
                r.checkpoint_rows, r.checkpoint_at_s = r.rows, t
        self.now = t

    # -- scheduling -----------------------------------------------------------
    def schedule(self) -> None:
        cores, mem = self.free()
        for r in self.runs:  # FIFO with backfill
            if r.state is not JobState.QUEUED or r.job.arrival_s > self.now:
                continue
            if r.cores(self.c) <= cores and r.memory(self.c) <= mem:
                cores -= r.cores(self.c)
                mem -= r.memory(self.c)
                r.state, r.started_s = JobState.RUNNING, self.now
                r.checkpoint_at_s = self.now
                r.last_tick_s = self.now
                r.last_mem_bytes = r.shard_bytes()
                self.refresh(r)
                self.push(self.now + self.policy.interval_s, "tick", r.job.id)

    def metrics(self, r: _Run) -> JobMetrics:
        assert r.pred is not None
        p, lim = r.pred, r.pred.limits
        others = min(v for k, v in lim.items() if k != "executors")
        exec_lim = lim.get("executors", math.inf)
        wait = max(0.0, 1.0 - exec_lim / others) if exec_lim < others else 0.0
        mem = r.shard_bytes()
        dt = max(self.now - r.last_tick_s, 1e-9)
        growth = max(mem - r.last_mem_bytes, 0.0) / dt
        r.last_mem_bytes, r.last_tick_s = mem, self.now
        cores, free_mem = self.free()
        return JobMetrics(
            job=r.job.id,
            time_s=self.now,
            rows_per_s=p.rows_per_s,
            trainers=r.trainers,
            ps_shards=r.ps_shards,
            executors=r.executors,
            trainer_wait_frac=wait,
            executor_queue=1.0 if exec_lim > p.rows_per_s * 1.05 else 0.0,
            executor_rows_per_s=min(exec_lim, p.rows_per_s) / max(r.executors, 1),
            cpu_busy={**p.busy, "trainer": p.rows_per_s / lim["trainers"]},
            ps_load_max_over_mean=r.hot,
            ps_memory_bytes=mem,
            ps_memory_budget_bytes=r.ps_memory_bytes,
            ps_memory_growth_bytes_per_s=growth,
            trainer_step_max_over_median=r.straggler,
            oom_count=r.ooms,
            free_cores=cores,
            free_memory_bytes=free_mem,
            extra={
                "max_cores": self.c.max_job_share * self.c.cores,
                "trainer_cpus": self.c.trainer_cpus,
                "ps_cpus": self.c.ps_cpus,
                "executor_cpus": self.c.executor_cpus,
                "node_memory_bytes": self.c.memory_per_node_bytes,
            },
        )

    # -- the controller ---------------------------------------------------------
    def apply(self, r: _Run, decisions: list[Decision], *, restarting: bool = False) -> None:
        pause = 0.0
        for d in decisions:
            cores, mem = self.free()
            old: float
            if d.action is Action.SET_COUNT:
                name = _ROLE_FIELD[d.role]
                old = getattr(r, name)
                new = max(1, int(d.value))
                per_cores = getattr(self.c, f"{d.role.value}_cpus")
                per_mem = {
                    Role.TRAINER: self.c.trainer_memory_bytes,
                    Role.PS: r.ps_memory_bytes,
                    Role.EXECUTOR: self.c.executor_memory_bytes,
                }[d.role]
                cap = self.c.max_job_share * self.c.cores
                if new > old and not restarting:  # grow into free resources, up to the job's share
                    room = min(
                        cores // per_cores, mem // per_mem, (cap - r.cores(self.c)) // per_cores
                    )
                    new = int(old) + max(0, min(new - int(old), int(room)))
                if new == old:
                    continue
                setattr(r, name, new)
                pause = max(pause, self.c.pause_s[d.role.value])
            elif d.action is Action.SET_MEMORY:
                old = r.ps_memory_bytes
                extra = (d.value - old) * r.ps_shards
                if d.value <= old or (extra > mem and not restarting):
                    continue
                r.ps_memory_bytes = d.value
            elif d.action is Action.REBALANCE:
                if r.hot <= REBALANCED_LOAD:
                    continue
                old, r.hot, r.hot_fixed = r.hot, REBALANCED_LOAD, True
                d = replace(d, value=REBALANCED_LOAD)
                pause = max(pause, self.c.rebalance_s)
            else:  # REPLACE_STRAGGLER
                if r.straggler <= 1:
                    continue
                old, r.straggler = r.straggler, 1.0
                pause = max(pause, self.c.replace_s)
            self.decisions.append(
                {
                    "time_s": self.now,
                    "job": r.job.id,
                    "role": d.role.value,
                    "action": d.action.value,
                    "from": old,
                    "to": d.value,
                    "reason": d.reason,
                }
            )
        if pause and not restarting:
            r.paused_until_s = max(r.paused_until_s, self.now + pause)
            self.push(r.paused_until_s, "refresh", r.job.id)
        self.refresh(r)

    def kill(self, r: _Run) -> None:
        """Restart from the last checkpoint after ``restart_s``."""
        r.rows = r.checkpoint_rows
        r.paused_until_s = self.now + self.c.restart_s
        r.checkpoint_at_s = self.now
        r.last_mem_bytes = r.shard_bytes()
        self.push(r.paused_until_s, "refresh", r.job.id)

    # -- main loop -------------------------------------------------------------
    def run(self) -> SimResult:
        for r in self.runs:
            self.push(r.job.arrival_s, "arrive", r.job.id)
        if self.c.node_mtbf_s > 0:
            t, horizon = 0.0, self.runs[-1].job.arrival_s * 20 + 1e6
            while t < horizon:
                t += float(self.rng.exponential(self.c.node_mtbf_s / self.c.nodes))
                self.push(t, "fail")
        while self.heap and any(not r.state.is_terminal for r in self.runs):
            t, _, kind, jid, version = heapq.heappop(self.heap)
            self.advance(t)
            run = self.runs[jid] if jid >= 0 else None
            if kind == "arrive":
                self.schedule()
            elif kind == "fail":
                self.fail()
            elif kind == "repair":
                self.down_nodes -= 1
                self.schedule()
            elif run is None or run.state is not JobState.RUNNING:
                continue
            else:
                self.job_event(run, kind, version)
        stuck = [r.job.id for r in self.runs if not r.state.is_terminal]
        if stuck:
            raise RuntimeError(
                f"jobs {stuck[:5]} never fit the cluster "
                f"({self.c.cores:.0f} cores, {self.c.memory_bytes / GIB:.0f} GiB)"
            )
        return self.result()

    def job_event(self, r: _Run, kind: str, version: int) -> None:
        """One event of running job ``r``; completion, OOM and onsets only count
        when solved for the job's current rate (``version``)."""
        current = version == r.version
        if kind == "done" and current:
            r.rows, r.state, r.finished_s = r.job.rows_total, JobState.DONE, self.now
            r.version += 1
            self.schedule()
        elif kind == "oom" and current:
            r.ooms += 1
            if r.ooms > MAX_OOMS_PER_JOB:
                raise RuntimeError(
                    f"job {r.job.id}: {r.ooms} OOM kills; policy "
                    f"{self.policy.name!r} never gives it the memory"
                )
            self.kill(r)
            self.apply(r, self.policy.on_oom(self.metrics(r)), restarting=True)
        elif kind == "hot" and current:
            r.hot = r.job.hot_factor
            self.refresh(r)
        elif kind == "straggle" and current:
            r.straggler = r.job.straggler_factor
            r.straggler_until_s = self.now + r.job.straggler_s
            self.refresh(r)
        elif kind == "refresh":
            self.refresh(r)
        elif kind == "tick":
            if self.now >= r.paused_until_s:
                self.apply(r, self.policy.decide(self.metrics(r)))
            self.push(self.now + self.policy.interval_s, "tick", r.job.id)

    def fail(self) -> None:
        self.down_nodes += 1
        self.push(self.now + self.c.node_repair_s, "repair")
        running = [r for r in self.runs if r.state is JobState.RUNNING]
        if not running:
            return
        held = np.array([r.cores(self.c) for r in running])
        # A node holds a process of a job with probability ~ the job's share of cores.
        if self.rng.random() < held.sum() / self.c.cores:
            victim = running[int(self.rng.choice(len(running), p=held / held.sum()))]
            self.failures += 1
            self.kill(victim)
            victim.version += 1
            self.refresh(victim)

    def result(self) -> SimResult:
        jct = {r.job.id: r.finished_s - r.job.arrival_s for r in self.runs}
        last: dict[tuple[int, str, str], tuple[float, int]] = {}
        reversed_n = 0
        window = 2 * self.policy.interval_s
        for d in self.decisions:
            if d["action"] not in ("set_count", "set_memory"):
                continue
            key = (d["job"], d["role"], d["action"])
            sign = 1 if d["to"] > d["from"] else -1
            prev = last.get(key)
            if prev is not None and prev[1] != sign and d["time_s"] - prev[0] < window:
                reversed_n += 1
            last[key] = (d["time_s"], sign)
        return SimResult(
            policy=self.policy.name,
            jct_s=jct,
            makespan_s=self.now,
            cpu_util=self.used_core_s / max(self.alloc_core_s, 1e-9),
            cluster_cpu_util=self.used_core_s / (self.c.cores * max(self.now, 1e-9)),
            memory_util=self.mem_used_s / max(self.mem_alloc_s, 1e-9),
            ooms=sum(r.ooms for r in self.runs),
            failures=self.failures,
            decisions=self.decisions,
            reversed_actions=reversed_n,
        )


def simulate(
    jobs: list[SimJob],
    costs: Costs,
    policy: Policy,
    cluster: ClusterSpec | None = None,
    *,
    seed: int = 0,
) -> SimResult:
    """Run ``jobs`` on ``cluster`` under ``policy``; the same ``seed`` draws the
    same node failures for every policy."""
    cluster = cluster or ClusterSpec()
    for r_job in jobs:
        if r_job.trainers < 1 or r_job.ps_shards < 1 or r_job.executors < 1:
            raise ValueError(f"job {r_job.id}: every role needs >= 1 process")
    return _Sim(jobs, costs, policy, replace(cluster), seed).run()
