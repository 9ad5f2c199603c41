from __future__ import annotations

import pytest

from estuary.plan.costs import Costs
from estuary.plan.model import Layout, predict
from estuary.plan.policies import EstuaryPolicy, StaticPolicy
from estuary.plan.simulator import ClusterSpec, simulate
from estuary.plan.trace import GIB, SimJob

# One 3-core node: one job of 1 trainer + 1 shard + 1 executor (1 core each) at a time.
CLUSTER = ClusterSpec(
    nodes=1,
    cores_per_node=3,
    memory_per_node_bytes=1e15,
    trainer_cpus=1,
    ps_cpus=1,
    executor_cpus=1,
    batch_rows=1024,
    node_mtbf_s=0.0,
    checkpoint_every_s=1e9,
    restart_s=50.0,
)


def rate(costs: Costs) -> float:
    return predict(costs, Layout(1, 1, 1, 1024)).rows_per_s  # 1024 / 11.024 ms


def job(i: int, arrival_s: float, rows: float, **kw: float) -> SimJob:
    base: dict = dict(
        id=i,
        arrival_s=arrival_s,
        rows_total=rows,
        ids_total=1e3,
        ids_scale_rows=1.0,
        dense_mult=1.0,
        trainers=1,
        ps_shards=1,
        executors=1,
        ps_memory_bytes=GIB,
    )
    return SimJob(**(base | kw))


def test_one_job_completes_in_rows_over_rate(costs: Costs) -> None:
    r = simulate([job(0, 5.0, rate(costs) * 100)], costs, StaticPolicy(), CLUSTER)
    assert r.jct_s[0] == pytest.approx(100.0)
    assert r.makespan_s == pytest.approx(105.0)


def test_a_job_that_does_not_fit_waits_for_the_first(costs: Costs) -> None:
    #   job 0  |=====100 s=====|
    #   job 1     ^arrives 10   |=====100 s=====|   JCT = 90 queued + 100
    jobs = [job(0, 0.0, rate(costs) * 100), job(1, 10.0, rate(costs) * 100)]
    r = simulate(jobs, costs, StaticPolicy(), CLUSTER)
    assert r.jct_s == pytest.approx({0: 100.0, 1: 190.0})


def test_an_oom_costs_the_restart_and_the_work_since_the_checkpoint(costs: Costs) -> None:
    # 1e6 ids x 100 B = 100 MB at the end; a 50 MB shard fills when ids(r) = 5e5,
    # at r = ln 2 * scale rows. No checkpoint: the restart redoes everything.
    rows = rate(costs) * 100
    scale = rows / 2
    j = job(0, 0.0, rows, ids_total=1e6, ids_scale_rows=scale, ps_memory_bytes=50e6)
    r = simulate([j], costs, StaticPolicy(), CLUSTER)
    oom_s = 0.6931471805599453 * scale / rate(costs)
    assert r.ooms == 1
    assert r.jct_s[0] == pytest.approx(oom_s + 50.0 + 100.0)
    assert [d["action"] for d in r.decisions] == ["set_memory"]


def test_estuary_adds_shards_before_the_oom(costs: Costs) -> None:
    # The same job over a longer run: the growth is visible a few intervals ahead.
    rows = rate(costs) * 3000
    cluster = ClusterSpec(**{**CLUSTER.__dict__, "cores_per_node": 16, "max_job_share": 1.0})
    j = job(0, 0.0, rows, ids_total=1e6, ids_scale_rows=rows / 2, ps_memory_bytes=50e6)
    static = simulate([j], costs, StaticPolicy(), cluster)
    ours = simulate([j], costs, EstuaryPolicy(), cluster)
    assert static.ooms == 1
    assert ours.ooms == 0
    assert any(d["role"] == "ps" and d["to"] > d["from"] for d in ours.decisions)
    assert ours.reversed_actions == 0
    assert ours.jct_s[0] < static.jct_s[0]


def test_jobs_need_every_role(costs: Costs) -> None:
    with pytest.raises(ValueError, match="job 0"):
        simulate([job(0, 0.0, 1e6, executors=0)], costs, StaticPolicy(), CLUSTER)


def test_a_policy_that_never_gives_memory_is_an_error(costs: Costs) -> None:
    from estuary.plan.policies import StaticPolicy as Static

    class Stubborn(Static):
        def on_oom(self, metrics):  # type: ignore[no-untyped-def]
            return []

    rows = rate(costs) * 100
    j = job(0, 0.0, rows, ids_total=1e6, ids_scale_rows=rows / 2, ps_memory_bytes=50e6)
    with pytest.raises(RuntimeError, match="job 0: 51 OOM kills"):
        simulate([j], costs, Stubborn(), CLUSTER)


def test_the_same_trace_and_seed_give_the_same_result(costs: Costs) -> None:
    from estuary.plan.trace import make_trace

    cluster = ClusterSpec(nodes=4, node_mtbf_s=3600.0)
    jobs = make_trace(costs, jobs=12, seed=3, mean_gap_s=60.0, median_rows=2e7)
    first = simulate(jobs, costs, EstuaryPolicy(), cluster, seed=5)
    again = simulate(jobs, costs, EstuaryPolicy(), cluster, seed=5)
    assert first.jct_s == again.jct_s and first.decisions == again.decisions
    assert len(first.jct_s) == 12 and all(v > 0 for v in first.jct_s.values())
    assert first.failures == again.failures
