"""Scaling policies: pure functions of the metrics history (``Snapshot``s) that
return ``Decision``s; the controller applies them (``estuary.runtime.scaling.controller``).

``EstuaryPolicy`` sizes each knob to where the job's time goes, in one move:

- reads in flight (horizontal and vertical): the trainer waits for data
  (``trainer_wait`` above ``wait_high``) while the read slots (executors x
  reads per executor) are busy: size them to the trainer's demand. Demand is
  the rate the trainer would train at if it never waited
  (``rows_per_s / (1 - wait)``); one slot delivers what a read delivers while
  reading (``rows_per_s / (slots x busy)``: rows per read over wall per read);
  the reads in flight needed are ``headroom x demand / supply`` (Little's law),
  at most the driver's readers (``Bounds.max_reads``). They come from more
  reads per executor first (no process to start) as far as one process's CPU
  allows: a read costs ``executor_cpu`` CPU-seconds per second of it (near 0
  for a source that makes reads wait, near 1 for parsing), and an executor's
  reads together may use ``THREAD_CPU`` of a core (also within
  ``max_threads`` and the memory budget); the rest from more executors, in one
  move. CPU per read unknown: executors, and at the executor maximum double
  the reads per executor. Idle slots (idle fraction above ``idle_high``) with
  the trainer not waiting: shrink to ``headroom x`` the busy ones, executors
  first, then reads per executor.
- executor memory (vertical): when the executor holding the most memory peaks
  above ``memory_target`` of its budget, lower its concurrent reads to what
  fits; at one read, raise every executor's memory ask so that peak sits at
  ``memory_target``, and by ``MEMORY_GROWTH`` x at least (up to
  ``max_executor_memory_mb``; the pool replaces each executor with one asking
  that much, handing its split on whole). When every peak of the last
  ``hold_intervals + 1`` intervals stays below half of ``memory_target`` of the
  ask, lower it (the same replacement) so the highest sits at ``LOWER_FILL`` x
  ``memory_target``, never below the job's configured ask
  (``Bounds.min_executor_memory_mb``): between the two triggers (below 0.5 x
  and above 1 x ``memory_target``) lies a band in which neither fires, so a
  lowered ask is not raised again by the peak that lowered it.
- memory: fit each PS shard's rows to a line over the last intervals; when the
  forecast crosses its budget within ``memory_horizon_s`` (or it is past
  ``memory_target`` already and growing), add a PS shard while the shards are
  below ``Bounds.max_shards`` (a split: every shard gives the new one a share of
  its slots), else cap its rows so it stays at ``memory_target``. With shards
  that may be added, two shards forecast together below ``merge_below`` of one
  budget, the smaller no hotter than the mean, are merged (``min_shards``).
  With the row cap, a shard whose tables count sightings for admission
  (``admission.min_count`` above 1) has it doubled (``shard_admission:P``):
  fewer new ids earn a row, so the capped rows stay with ids that recur.
- hot shard: a shard with ``hot_ratio`` x the mean load (on Ray its hottest
  slots move to the coldest shard, or the slot map is refined first:
  ``estuary.runtime.ray.scaling``; elsewhere it is reported).

A knob is decided again only after a whole interval at its current value, with
every executor up (an interval that held a change or an executor's start-up
says nothing yet about the new size). ``Hysteresis`` (the controller's) then drops any decision that
would move a knob back within ``hold_intervals`` intervals.

``DLRoverRules`` re-implements DLRover's public threshold rules as the baseline:
every re-plan, with PS CPU below its target, grow the workers in proportion to
the PS CPU headroom (at most x2 a plan); after a shard exceeds its memory
(DLRover: an OOM), double its memory budget. It never shrinks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from estuary.config.scaling import ScalingSpec
from estuary.runtime.scaling.metrics import ShardMetrics, Snapshot

__all__ = [
    "LOWER_FILL",
    "ROW_SLACK",
    "THREAD_CPU",
    "Bounds",
    "DLRoverRules",
    "Decision",
    "EstuaryPolicy",
    "Hysteresis",
    "Policy",
    "forecast_crossing",
]

ROW_SLACK = 1.5  # a table's arrays grow by up to 1.5x (hash index) ahead of its rows
MIN_BUSY = 0.05  # below this the executors' supply rate is not measurable
MEMORY_GROWTH = 1.5  # an executor memory raise asks at least this multiple of the ask
# A lowered executor memory ask puts the quiet stretch's highest peak at this
# fraction of ``memory_target``: midway between the lowering trigger (0.5) and
# the raise trigger (1.0), so neither fires on the peaks that lowered it.
LOWER_FILL = 0.75
# One executor process's concurrent reads share its interpreter: sized so that
# together they compute at most this fraction of a core.
THREAD_CPU = 0.5


@dataclass(frozen=True)
class Bounds:
    """What the policy may set.

    Args:
        min_executors: fewest data executors.
        max_executors: most data executors.
        max_threads: most concurrent reads per executor (1: no vertical scaling).
        max_reads: most reads in flight over all executors (the driver's
            readers, ``data.dataset.executor.workers``); ``None``: no limit.
        min_shards: fewest PS shards a merge leaves.
        max_shards: most PS shards a split makes; ``None``: shards are neither
            added nor retired (memory is held by row caps alone).
        min_executor_memory_mb: the job's configured executor memory ask
            (``runtime.roles.data_executor.memory_mb``): a lowered ask never
            goes below it; ``None``: the ask is never lowered.
    """

    min_executors: int = 1
    max_executors: int = 8
    max_threads: int = 1
    max_reads: int | None = None
    min_shards: int = 1
    max_shards: int | None = None
    min_executor_memory_mb: int | None = None


@dataclass(frozen=True)
class Decision:
    """Set ``knob`` from ``old`` to ``new`` because of ``trigger``.

    Knobs: ``executors``, ``executor_threads``, ``executor_memory`` (each
    executor's memory ask, MiB), ``shard_rows:P`` (row cap of
    shard P), ``shard_admission:P`` (the least admission ``min_count`` of
    shard P's tables), ``shard_memory:P`` (memory budget of shard P), ``hot_shard:P``
    (``new`` is the mean load; applied on Ray), ``ps_shards`` (the PS shard count:
    up one is a split, the shard in ``metrics["shard"]`` triggered it; down one
    a merge of ``metrics["retire"]`` into ``metrics["into"]``).
    """

    knob: str
    old: float
    new: float
    trigger: str
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def direction(self) -> int:
        return (self.new > self.old) - (self.new < self.old)

    def as_dict(self) -> dict[str, object]:
        return {
            "knob": self.knob,
            "old": self.old,
            "new": self.new,
            "trigger": self.trigger,
            "metrics": {k: round(v, 4) for k, v in self.metrics.items()},
        }


class Policy(Protocol):
    name: str

    def decide(self, history: Sequence[Snapshot]) -> list[Decision]:
        """Decisions after the newest snapshot (``history[-1]``)."""
        ...


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _settled(history: Sequence[Snapshot], attr: str) -> bool:
    """The newest interval ran wholly at the knob's current value."""
    if len(history) < 2:
        return True
    return bool(getattr(history[-1], attr) == getattr(history[-2], attr))


def _settled_shards(history: Sequence[Snapshot]) -> bool:
    """The newest interval ran wholly with the shards it shows (none added or retired)."""
    return len(history) < 2 or len(history[-1].shards) == len(history[-2].shards)


def _starting(history: Sequence[Snapshot]) -> bool:
    """Executors came up during the newest interval (it ran partly without them)."""
    return len(history) >= 2 and history[-2].executors_starting > 0


def forecast_crossing(
    series: Sequence[tuple[float, int, int]],
    horizon_s: float,
    cap_rows: int | None = None,
    allocated_rows: int | None = None,
) -> tuple[float, float]:
    """(rows per second, bytes forecast ``horizon_s`` ahead) of a shard from its
    ``(t, rows, bytes)`` series: rows on a least-squares line (never past
    ``cap_rows``), each one past what the arrays hold already (``allocated_rows``,
    default the rows now: rows moved or evicted away leave room) at the newest
    bytes per held row times ``ROW_SLACK`` (arrays grow ahead of their rows)."""
    _, rows_last, bytes_last = series[-1]
    if len(series) < 2 or rows_last <= 0:
        return 0.0, float(bytes_last)
    ts = [s[0] for s in series]
    rs = [float(s[1]) for s in series]
    t_mean, r_mean = sum(ts) / len(ts), sum(rs) / len(rs)
    var = sum((t - t_mean) ** 2 for t in ts)
    slope = (
        sum((t - t_mean) * (r - r_mean) for t, r in zip(ts, rs, strict=True)) / var
        if var > 0
        else 0.0
    )
    held = max(rows_last, allocated_rows or 0)
    per_row = bytes_last / held
    new_rows = max(0.0, slope) * horizon_s
    if cap_rows is not None:
        new_rows = min(new_rows, max(0, cap_rows - rows_last))
    ahead = max(0.0, rows_last + new_rows - held) * per_row * ROW_SLACK
    return slope, float(bytes_last) + ahead


class EstuaryPolicy:
    """See the module docstring."""

    name = "estuary"

    def __init__(self, spec: ScalingSpec, bounds: Bounds, *, window: int = 4) -> None:
        self.spec = spec
        self.bounds = bounds
        self.window = window  # intervals the memory forecast fits

    def decide(self, history: Sequence[Snapshot]) -> list[Decision]:
        if not history:
            return []
        out = self._executor_memory(history)
        if not out:
            out = self._executors(history)
        out += self._memory(history)
        out += self._hot(history[-1])
        return out

    def _executors(self, history: Sequence[Snapshot]) -> list[Decision]:
        s, spec = history[-1], self.spec
        settled = _settled(history, "executors") and _settled(history, "executor_threads")
        if not settled or s.executors_starting or _starting(history):
            return []
        wait = s.trainer_wait
        # Unmeasured trainer wait: splits queued for a busy pool stand in for it.
        starved = wait > spec.wait_high if wait is not None else s.queue_depth > 0
        metrics = {
            "trainer_wait": -1.0 if wait is None else wait,
            "executor_busy": s.executor_busy,
            "rows_per_s": s.rows_per_s,
            "queue_depth": float(s.queue_depth),
            "executor_cpu": -1.0 if s.executor_cpu is None else s.executor_cpu,
        }
        if starved and s.executor_busy > 1.0 - spec.idle_high and s.rows_per_s > 0:
            return self._grow(s, wait, metrics)
        return self._shrink(s, wait, metrics)

    def _grow(self, s: Snapshot, wait: float | None, metrics: dict[str, float]) -> list[Decision]:
        """The reads in flight the trainer's demand needs (Little's law), as
        more reads per executor while its CPU allows, else more executors."""
        b = self.bounds
        slots = s.executors * s.executor_threads
        # One read slot delivers ``supply`` rows/s while reading (rows per read
        # / wall per read); the trainer would take ``demand`` if it never waited.
        supply = s.rows_per_s / (slots * max(s.executor_busy, MIN_BUSY))
        demand = s.rows_per_s / max(1.0 - (wait or 0.5), 0.05)
        need = max(math.ceil(self.spec.headroom * demand / supply), slots + 1)
        if b.max_reads is not None:
            need = min(need, b.max_reads)  # the driver reads no more at once
        cap = self._thread_cap(s)
        threads = max(s.executor_threads, min(cap, math.ceil(need / s.executors)))
        executors = _clamp(math.ceil(need / threads), s.executors, b.max_executors)
        if executors > s.executors:  # spread the reads over the executors
            threads = max(s.executor_threads, min(cap, math.ceil(need / executors)))
        if executors * threads <= slots < need and executors == b.max_executors:
            # At the executor maximum and short of the reads needed (CPU per
            # read unknown, or too high for more reads per executor): double them.
            doubled = min(b.max_threads, 2 * s.executor_threads, self._threads_that_fit(s))
            threads = max(threads, doubled)
        metrics["reads_needed"] = float(need)
        out = []
        if threads > s.executor_threads:  # first: executors added next open at it
            cpu = "unknown" if s.executor_cpu is None else f"{s.executor_cpu:.2f}"
            trigger = (
                f"trainer waits for data; reads wait on the source (executor CPU {cpu} "
                f"s per read-second): {need} reads in flight"
            )
            out.append(
                Decision("executor_threads", s.executor_threads, threads, trigger, dict(metrics))
            )
        if executors > s.executors:
            trigger = "trainer waits for data; executors busy"
            out.append(Decision("executors", s.executors, executors, trigger, dict(metrics)))
        return out

    def _shrink(self, s: Snapshot, wait: float | None, metrics: dict[str, float]) -> list[Decision]:
        """Idle read slots with the trainer fed: down to ``headroom x`` the busy
        ones, retiring executors first (each frees a process), then reads."""
        spec, b = self.spec, self.bounds
        idle = 1.0 - s.executor_busy
        calm = wait is None or wait < spec.wait_high / 2
        if not (calm and idle > spec.idle_high):
            return []
        slots = s.executors * s.executor_threads
        need = max(1, math.ceil(spec.headroom * slots * s.executor_busy))
        target = _clamp(math.ceil(need / s.executor_threads), b.min_executors, b.max_executors)
        if target < s.executors:
            trigger = "executors idle; trainer not waiting"
            return [Decision("executors", s.executors, target, trigger, metrics)]
        threads = max(1, math.ceil(need / s.executors))
        if threads < s.executor_threads:
            trigger = "executor reads idle; trainer not waiting"
            return [Decision("executor_threads", s.executor_threads, threads, trigger, metrics)]
        return []

    def _thread_cap(self, s: Snapshot) -> int:
        """Most reads per executor for a scale-up: ``max_threads``, what its
        memory budget holds, and what one process's CPU gives: its reads share
        one interpreter, so together they may use ``THREAD_CPU`` of a core (a
        read costing ``executor_cpu`` CPU-seconds per second of it). CPU per
        read unknown: one read (more executors, as for a CPU-bound source)."""
        if s.executor_cpu is None:
            return 1
        by_cpu = math.floor(THREAD_CPU / max(s.executor_cpu, 1e-3))
        return max(1, min(self.bounds.max_threads, self._threads_that_fit(s), by_cpu))

    def _threads_that_fit(self, s: Snapshot) -> int:
        """Most concurrent reads per executor whose forecast peak stays within
        ``memory_target`` of the executors' budget (no budget: no limit)."""
        m = s.executor_memory
        if m is None or m.budget_bytes is None:
            return self.bounds.max_threads
        per_read = m.per_read(s.executor_threads)
        room = self.spec.memory_target * m.budget_bytes - m.base_bytes
        if per_read <= 0:
            return self.bounds.max_threads
        return max(1, math.floor(room / per_read))

    def _executor_memory(self, history: Sequence[Snapshot]) -> list[Decision]:
        s = history[-1]
        m = s.executor_memory
        if m is None or m.budget_bytes is None or s.executors_starting or _starting(history):
            return []
        target = self.spec.memory_target * m.budget_bytes
        if m.peak_bytes <= target:
            return self._lower_memory(history)
        metrics = {
            "executor_peak_bytes": float(m.peak_bytes),
            "executor_base_bytes": float(m.base_bytes),
            "executor_budget_bytes": float(m.budget_bytes),
            "executor_threads": float(s.executor_threads),
        }
        if s.executor_threads > 1:
            threads = min(s.executor_threads - 1, self._threads_that_fit(s))
            trigger = f"executor memory peak above {self.spec.memory_target:g} of its budget"
            return [Decision("executor_threads", s.executor_threads, threads, trigger, metrics)]
        most = self.spec.max_executor_memory_mb
        budget_mb = m.budget_bytes / 2**20
        if most is None or budget_mb >= most:
            return []
        # Enough for the peak at the target, and at least MEMORY_GROWTH x the ask:
        # a read's memory creeps up over the first ones (caches, JIT), and each
        # raise replaces every executor, so raises come in strides, not steps.
        fit = math.ceil(m.peak_bytes / self.spec.memory_target / 2**20)
        ask = min(most, max(fit, math.ceil(MEMORY_GROWTH * budget_mb)))
        if ask <= budget_mb:
            return []
        trigger = (
            f"executor memory peak above {self.spec.memory_target:g} of its budget at one read"
        )
        return [Decision("executor_memory", budget_mb, ask, trigger, metrics)]

    def _lower_memory(self, history: Sequence[Snapshot]) -> list[Decision]:
        """Lower the executors' memory ask when every peak of the last
        ``hold_intervals + 1`` intervals, all at the current ask with every
        executor up, stayed below half of ``memory_target`` of it: to put the
        highest at ``LOWER_FILL x memory_target``, never below the job's ask."""
        floor = self.bounds.min_executor_memory_mb
        m = history[-1].executor_memory
        if floor is None or m is None or m.budget_bytes is None:
            return []
        budget_mb = m.budget_bytes / 2**20
        stretch = history[-(self.spec.hold_intervals + 1) :]
        if budget_mb <= floor or len(stretch) < self.spec.hold_intervals + 1:
            return []
        quiet = self.spec.memory_target / 2 * m.budget_bytes
        peaks: list[int] = []
        for s in stretch:
            e = s.executor_memory
            if e is None or e.budget_bytes != m.budget_bytes or s.executors_starting:
                return []  # not measured, or not all at this ask: no quiet stretch yet
            if e.peak_bytes >= quiet:
                return []
            peaks.append(e.peak_bytes)
        fit = math.ceil(max(peaks) / (LOWER_FILL * self.spec.memory_target) / 2**20)
        ask = max(floor, fit)
        if ask >= budget_mb:
            return []
        metrics = {
            "executor_peak_bytes": float(max(peaks)),
            "executor_base_bytes": float(m.base_bytes),
            "executor_budget_bytes": float(m.budget_bytes),
            "quiet_intervals": float(len(stretch)),
        }
        trigger = (
            f"executor memory peak below {self.spec.memory_target / 2:g} of its budget "
            f"for {len(stretch)} intervals"
        )
        return [Decision("executor_memory", budget_mb, ask, trigger, metrics)]

    def _memory(self, history: Sequence[Snapshot]) -> list[Decision]:
        s, spec = history[-1], self.spec
        if not _settled_shards(history):
            return []  # shards just added or retired: the next interval says more
        over: list[tuple[ShardMetrics, dict[str, float]]] = []
        ahead_of: dict[int, float] = {}
        recent = history[-self.window :]
        for shard in s.shards:
            if shard.budget_bytes is None or shard.rows <= 0:
                continue
            series = [
                (h.t, m.rows, m.memory_bytes)
                for h in recent
                for m in h.shards
                if m.shard == shard.shard
            ]
            slope, ahead = forecast_crossing(
                series, spec.memory_horizon_s, shard.capacity_rows, shard.allocated_rows
            )
            ahead_of[shard.shard] = ahead
            target_bytes = spec.memory_target * shard.budget_bytes
            # Past the target already, and growing (not living in room it has).
            past = shard.memory_bytes > target_bytes and (
                shard.allocated_rows is None or ahead > shard.memory_bytes
            )
            if ahead > shard.budget_bytes or past:
                metrics = {
                    "shard": float(shard.shard),
                    "memory_bytes": float(shard.memory_bytes),
                    "budget_bytes": float(shard.budget_bytes),
                    "forecast_bytes": ahead,
                    "rows_per_s": slope,
                }
                over.append((shard, metrics))
        count, b = len(s.shards), self.bounds
        if over and b.max_shards is not None and count < b.max_shards:
            # Add a shard (split): it takes rows from every shard, none is capped.
            worst = max(over, key=lambda o: o[1]["forecast_bytes"] / o[1]["budget_bytes"])
            trigger = (
                f"memory forecast of shard {worst[0].shard} crosses the budget within "
                f"{spec.memory_horizon_s:g} s: add a shard"
            )
            return [Decision("ps_shards", count, count + 1, trigger, worst[1])]
        if not over:
            return self._merge(s, ahead_of)
        out: list[Decision] = []
        for shard, metrics in over:
            assert shard.budget_bytes is not None
            admission = shard.admission_min_count
            if admission is not None:
                # Fewer new ids earn a row: the capped rows stay with ids that recur.
                trigger = (
                    f"memory forecast crosses the budget within {spec.memory_horizon_s:g} s: "
                    f"admit only ids seen {2 * admission} times"
                )
                out.append(
                    Decision(
                        f"shard_admission:{shard.shard}", admission, 2 * admission, trigger, metrics
                    )
                )
            per_row = shard.memory_bytes / shard.rows
            cap = int(spec.memory_target * shard.budget_bytes / (per_row * ROW_SLACK))
            if shard.capacity_rows is not None and cap >= shard.capacity_rows:
                continue  # capped at or below this already
            old = float(shard.capacity_rows if shard.capacity_rows is not None else shard.rows)
            trigger = f"memory forecast crosses the budget within {spec.memory_horizon_s:g} s"
            out.append(Decision(f"shard_rows:{shard.shard}", old, cap, trigger, metrics))
        return out

    def _merge(self, s: Snapshot, ahead_of: dict[int, float]) -> list[Decision]:
        """Retire the shard forecast smallest into the next smallest when both fit
        in ``merge_below`` of one budget and the retired one is no hotter than the
        mean (shards may be added: ``max_shards``; down to ``min_shards``)."""
        b, count = self.bounds, len(s.shards)
        budgets = {m.budget_bytes for m in s.shards}
        if b.max_shards is None or count <= max(1, b.min_shards) or None in budgets:
            return []
        if len(ahead_of) != count:
            return []
        budget = float(next(iter(budgets)) or 0)
        small, into = sorted(ahead_of, key=ahead_of.__getitem__)[:2]
        together = ahead_of[small] + ahead_of[into]
        mean = sum(m.load for m in s.shards) / count
        load = next(m.load for m in s.shards if m.shard == small)
        if together > self.spec.merge_below * budget or load > mean:
            return []
        metrics = {
            "retire": float(small),
            "into": float(into),
            "forecast_bytes": together,
            "budget_bytes": budget,
            "load": load,
            "mean_load": mean,
        }
        trigger = (
            f"shards {small} and {into} together forecast at {together / budget:.0%} of one "
            f"budget (merge below {self.spec.merge_below:.0%}); shard {small} not hot: merge"
        )
        return [Decision("ps_shards", count, count - 1, trigger, metrics)]

    def _hot(self, s: Snapshot) -> list[Decision]:
        return hot_shards(s.shards, self.spec.hot_ratio)


def hot_shards(shards: Sequence[ShardMetrics], ratio: float) -> list[Decision]:
    """``hot_shard:P`` for each shard with ``ratio`` x the mean load or more."""
    if len(shards) < 2:
        return []
    mean = sum(s.load for s in shards) / len(shards)
    if mean <= 0:
        return []
    return [
        Decision(
            f"hot_shard:{s.shard}",
            s.load,
            mean,
            f"load {s.load / mean:.1f}x the mean shard load",
            {"load": s.load, "mean_load": mean},
        )
        for s in shards
        if s.load >= ratio * mean
    ]


class DLRoverRules:
    """DLRover's public threshold rules (see the module docstring).

    Args:
        bounds: the same bounds as the policy compared.
        ps_cpu_target: PS CPU use the workers are grown to.
        replan_intervals: intervals between two re-plans (DLRover: 300 s).
    """

    name = "dlrover_rules"

    def __init__(self, bounds: Bounds, *, ps_cpu_target: float = 0.8, replan_intervals: int = 1):
        self.bounds = bounds
        self.ps_cpu_target = ps_cpu_target
        self.replan_intervals = replan_intervals

    def decide(self, history: Sequence[Snapshot]) -> list[Decision]:
        if not history or len(history) % self.replan_intervals:
            return []
        s, b = history[-1], self.bounds
        out: list[Decision] = []
        ps_cpu = s.cpu.get("ps")
        if ps_cpu is not None and ps_cpu < self.ps_cpu_target and s.executors < b.max_executors:
            grow = min(2.0, self.ps_cpu_target / max(ps_cpu, 1e-3))
            target = _clamp(math.ceil(s.executors * grow), b.min_executors, b.max_executors)
            if target > s.executors:
                trigger = "PS CPU below target: workers grown by its headroom"
                metrics = {"ps_cpu": ps_cpu, "target": self.ps_cpu_target}
                out.append(Decision("executors", s.executors, target, trigger, metrics))
        for shard in s.shards:
            if shard.budget_bytes is not None and shard.memory_bytes > shard.budget_bytes:
                metrics = {"memory_bytes": float(shard.memory_bytes)}
                out.append(
                    Decision(
                        f"shard_memory:{shard.shard}",
                        shard.budget_bytes,
                        2 * shard.budget_bytes,
                        "shard over its memory (OOM): memory doubled",
                        metrics,
                    )
                )
        return out


class Hysteresis:
    """Drops a decision that moves a knob back the other way within ``hold``
    intervals of its last move (and report-only knobs repeated within ``hold``)."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self._last: dict[str, tuple[int, int]] = {}  # knob -> (interval, direction)

    def allow(self, decision: Decision, interval: int) -> bool:
        last = self._last.get(decision.knob)
        if last is not None and interval - last[0] <= self.hold:
            back = decision.direction != last[1]
            if back or decision.knob.startswith("hot_shard"):
                return False
        self._last[decision.knob] = (interval, decision.direction)
        return True
