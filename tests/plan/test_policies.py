from __future__ import annotations

from dataclasses import replace

from estuary.plan.policies import DLRoverRules, EstuaryPolicy
from estuary.plan.types import Action, JobMetrics, Role

GIB = float(1 << 30)

BASE = JobMetrics(
    job=0,
    time_s=0.0,
    rows_per_s=1e5,
    trainers=4,
    ps_shards=2,
    executors=2,
    trainer_wait_frac=0.0,
    executor_queue=0.0,
    executor_rows_per_s=5e4,
    cpu_busy={"trainer": 0.7, "ps": 0.5, "executor": 0.9},
    ps_load_max_over_mean=1.0,
    ps_memory_bytes=1 * GIB,
    ps_memory_budget_bytes=10 * GIB,
    ps_memory_growth_bytes_per_s=0.0,
    trainer_step_max_over_median=1.0,
    oom_count=0,
    free_cores=100.0,
    free_memory_bytes=1e12,
    extra={"ps_cpus": 2.0, "trainer_cpus": 2.0},
)


def counts(decisions: list, role: Role) -> list[float]:
    return [d.value for d in decisions if d.role is role and d.action is Action.SET_COUNT]


def test_trainers_waiting_for_data_get_executors_in_proportion() -> None:
    m = replace(BASE, trainer_wait_frac=0.5)
    # Half the time waiting: twice the executors, +10% margin: ceil(2 / 0.5 * 1.1) = 5.
    assert counts(EstuaryPolicy().decide(m), Role.EXECUTOR) == [5]


def test_no_decision_is_reversed_within_two_intervals() -> None:
    p = EstuaryPolicy(interval_s=60.0)
    assert counts(p.decide(replace(BASE, trainer_wait_frac=0.5)), Role.EXECUTOR) == [5]
    idle = replace(
        BASE, executors=5, executor_queue=1.0, cpu_busy={"trainer": 0.7, "ps": 0.5, "executor": 0.3}
    )
    assert counts(p.decide(replace(idle, time_s=60.0)), Role.EXECUTOR) == []  # too soon
    assert counts(p.decide(replace(idle, time_s=120.0)), Role.EXECUTOR) == [2]  # ceil(5*.3/.8)


def test_memory_forecast_adds_shards_before_the_budget_is_crossed() -> None:
    # 6 of 10 GiB, growing 1 MiB/s: in 5 intervals (300 s) ~6.3 GiB > 80% of 10? no;
    # at 10 MiB/s: 6 + 2.9 = 8.9 GiB > 8 GiB -> shards for 2 * 8.9 / 8 = 3.
    calm = replace(BASE, ps_memory_bytes=6 * GIB, ps_memory_growth_bytes_per_s=1 << 20)
    assert counts(EstuaryPolicy().decide(calm), Role.PS) == []
    fast = replace(calm, ps_memory_growth_bytes_per_s=10 << 20)
    assert counts(EstuaryPolicy().decide(fast), Role.PS) == [3]


def test_memory_forecast_without_free_cores_raises_memory_instead() -> None:
    m = replace(BASE, ps_memory_bytes=9 * GIB, free_cores=0.0)
    mem = [d for d in EstuaryPolicy().decide(m) if d.action is Action.SET_MEMORY]
    assert [d.value for d in mem] == [20 * GIB]


def test_hot_shard_and_straggler_are_handled() -> None:
    m = replace(BASE, ps_load_max_over_mean=3.0, trainer_step_max_over_median=2.0)
    actions = {d.action for d in EstuaryPolicy().decide(m)}
    assert {Action.REBALANCE, Action.REPLACE_STRAGGLER} <= actions


def test_dlrover_adds_workers_in_proportion_to_ps_headroom() -> None:
    # PS at 0.5 of a 0.8 target: x1.6 workers, floor(4 * 1.6) = 6.
    assert counts(DLRoverRules().decide(BASE), Role.TRAINER) == [6]
    hot = replace(BASE, cpu_busy={"ps": 0.95})
    assert counts(DLRoverRules().decide(hot), Role.PS) == [3]


def test_dlrover_doubles_memory_after_an_oom() -> None:
    (d,) = DLRoverRules().on_oom(BASE)
    assert d.action is Action.SET_MEMORY and d.value == 20 * GIB
    big = replace(BASE, extra={"node_memory_bytes": 16 * GIB})
    (d,) = DLRoverRules().on_oom(big)
    assert d.action is Action.SET_COUNT and d.value == 4
