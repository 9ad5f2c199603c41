from __future__ import annotations

from dataclasses import replace

import pytest

from estuary.plan.costs import Costs
from estuary.plan.model import Layout, predict, predict_shared

from .conftest import simple_costs


def test_one_process_step_is_dense_plus_tables(costs: Costs) -> None:
    # 10 ms dense + 1024 ids * 1 us of table work = 11.024 ms per 1024 rows.
    p = predict(costs, Layout(1, 0, batch_rows=1024, preloaded=True))
    assert p.step_s == pytest.approx(0.011024)
    assert p.rows_per_s == pytest.approx(1024 / 0.011024)
    assert p.bottleneck == "trainers"


def test_ps_work_leaves_the_trainer_and_splits_over_shards(costs: Costs) -> None:
    one = predict(costs, Layout(1, 1, batch_rows=1024, preloaded=True))
    two = predict(costs, Layout(1, 2, batch_rows=1024, preloaded=True))
    assert one.step_s == pytest.approx(0.010 + 0.001024)  # free network
    assert two.step_s == pytest.approx(0.010 + 0.001024 / 2)
    assert one.cpu_s_per_row["ps"] == pytest.approx(1e-6)


def test_executors_bound_a_job_that_parses_slowly(costs: Costs) -> None:
    # 1 executor core parses 1e5 rows/s; 2 trainers could do ~2 * 93k.
    p = predict(costs, Layout(2, 1, executors=1, batch_rows=1024))
    assert p.bottleneck == "executors"
    assert p.rows_per_s == pytest.approx(1e5)


def test_a_shared_machine_caps_by_cores_and_per_process_share(costs: Costs) -> None:
    lay = Layout(1, 0, batch_rows=1024, preloaded=True)
    free = predict(costs, lay).rows_per_s
    assert predict_shared(costs, lay, cores_1=0.5, cores_n=2).rows_per_s == pytest.approx(free / 2)
    capped = predict_shared(costs, lay, cores_1=1.0, cores_n=0.25)
    # A quarter core: the step stretches 4x, and the cores' limit says the same.
    assert capped.limits["cores"] == pytest.approx(0.25 / (0.011024 / 1024))
    assert capped.rows_per_s == pytest.approx(0.25 / (0.011024 / 1024))


def test_a_shared_machine_takes_the_larger_bound_not_their_product(costs: Costs) -> None:
    # A process gets 0.4 of a core and the job's one process 0.4 cores: both say
    # the step takes 2.5x the free one, and it does (not 2.5 x 2.5 = 6.25x).
    lay = Layout(1, 0, batch_rows=1024, preloaded=True)
    free = predict(costs, lay)
    p = predict_shared(costs, lay, cores_1=0.4, cores_n=0.4)
    assert p.step_s == pytest.approx(free.step_s / 0.4)
    assert p.rows_per_s == pytest.approx(free.rows_per_s * 0.4)
    # Two trainers and a shard on 0.5 cores: the contention bound (all their CPU
    # over 0.5 cores) is above the per-process stretch and sets the step.
    two = Layout(2, 1, batch_rows=1024, preloaded=True)
    q = predict_shared(costs, two, cores_1=0.9, cores_n=0.5)
    assert q.step_s == pytest.approx(predict(costs, two, cores=0.5).step_s)
    assert q.step_s > predict(costs, two).step_s / 0.9


def test_network_latency_lengthens_the_step() -> None:
    c = simple_costs(net_latency_s=1e-3)
    p = predict(c, Layout(2, 1, batch_rows=1024, preloaded=True))
    # 3 PS round trips + 1 all-reduce round trip (log2 2) on top of 10 ms dense and
    # the shard serving both trainers' 1.024 ms of table work.
    assert p.step_s == pytest.approx(0.010 + 2 * 0.001024 + 4e-3)


def test_a_shard_serves_every_trainer_of_a_sync_step_in_turn(costs: Costs) -> None:
    # W trainers' requests reach the shard together: its phase is W x 1.024 ms.
    for w, s in ((1, 1), (2, 1), (3, 1), (4, 2)):
        p = predict(costs, Layout(w, s, batch_rows=1024, preloaded=True))
        assert p.step_s == pytest.approx(0.010 + w * 0.001024 / s)
        assert p.rows_per_s == pytest.approx(w * 1024 / p.step_s)


def test_request_costs_fall_on_the_trainer_and_on_every_shard() -> None:
    # Client: 1 ms a request through one server's client, 1.5 ms through the
    # sharded one, 2 requests per shard a step. Server: 2 ms a request (every
    # table's fixed per-call cost: it is paid on each shard, not split), 2
    # requests per trainer per shard, plus the shard's 1/S of the ids.
    c = simple_costs(
        rpc_s_per_request=1e-3, rpc_sharded_s_per_request=1.5e-3, ps_s_per_request=2e-3
    )
    one = predict(c, Layout(2, 1, batch_rows=1024, preloaded=True))
    assert one.step_s == pytest.approx((0.010 + 2 * 1e-3) + 2 * (2 * 2e-3 + 0.001024))
    two = predict(c, Layout(2, 2, batch_rows=1024, preloaded=True))
    assert two.step_s == pytest.approx((0.010 + 4 * 1.5e-3) + 2 * (2 * 2e-3 + 0.000512))
    # All shards' CPU of a step: W trainers x 2 requests x S shards, and every id once.
    assert two.cpu_s_per_row["ps"] == pytest.approx(2 * (2 * 2 * 2e-3 + 0.001024) / 2048)


def test_per_id_client_cost_and_the_all_reduce_are_trainer_cpu() -> None:
    c = simple_costs(rpc_s_per_id=1e-6, rpc_sharded_s_per_id=2e-6, allreduce_s_per_step=3e-3)
    # One trainer: no all-reduce; 1024 ids through one server's client.
    solo = predict(c, Layout(1, 1, batch_rows=1024, preloaded=True))
    assert solo.step_s == pytest.approx(0.010 + 0.001024 + 0.001024)
    # Two trainers on two shards: the all-reduce and the sharded client's per-id CPU.
    pair = predict(c, Layout(2, 2, batch_rows=1024, preloaded=True))
    assert pair.step_s == pytest.approx((0.010 + 0.003 + 0.002048) + 2 * 0.000512)
    assert pair.cpu_s_per_row["trainer"] == pytest.approx((0.010 + 0.003 + 0.002048) / 1024)


def test_the_collections_own_work_is_trainer_cpu_with_ps_shards_only() -> None:
    """In-process, the collection's dedup / pooling / scatter is inside the
    calibrated table figures; with PS shards the trainer pays it beside the
    client's requests (timed on ids already unique)."""
    c = simple_costs(collection_s_per_row=1e-6)
    solo = predict(c, Layout(1, 0, batch_rows=1024, preloaded=True))
    assert solo.step_s == pytest.approx(0.010 + 0.001024)  # dense + tables, as without it
    ps = predict(c, Layout(1, 1, batch_rows=1024, preloaded=True))
    assert ps.cpu_s_per_row["trainer"] == pytest.approx((0.010 + 0.001024) / 1024)
    assert ps.step_s == pytest.approx(0.010 + 0.001024 + 0.001024)  # + the shard's ids


def test_trainers_and_shards_contend_for_a_shared_machines_cores(costs: Costs) -> None:
    # 3 trainers' 10 ms dense phases on 2 cores take 15 ms; the one shard's phase
    # (3 x 1.024 ms, one process) is not shortened by the second core.
    lay = Layout(3, 1, batch_rows=1024, preloaded=True)
    p = predict(costs, lay, cores=2.0)
    assert p.step_s == pytest.approx(0.015 + 3 * 0.001024)
    # On 4 cores each trainer has its own: the free-machine step.
    assert predict(costs, lay, cores=4.0).step_s == pytest.approx(0.010 + 3 * 0.001024)
    # Two shards' phases (2 x 0.512 ms each, 2.048 ms of CPU) on half a core: 4.096 ms.
    q = predict(costs, Layout(2, 2, batch_rows=1024, preloaded=True), cores=0.5)
    assert q.step_s == pytest.approx(2 * 0.010 / 0.5 + 2 * 0.001024 / 0.5)


def test_invalid_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="ps_shards"):
        Layout(2, 0, preloaded=True)
    with pytest.raises(ValueError, match="executors"):
        Layout(1, 1, executors=0)


def test_processes_computing_at_once_run_at_the_measured_efficiency() -> None:
    # 2 cores at 0.5 efficiency: 2 trainers' 10 ms dense phases at once take 20 ms
    # each, then the one shard's 2 x 1.024 ms alone (efficiency 1 for one process).
    c = simple_costs(parallel_efficiency=0.5)
    two = Layout(2, 1, batch_rows=1024, preloaded=True)
    p = predict_shared(c, two, cores_1=1.0, cores_n=2.0)
    assert p.step_s == pytest.approx(0.010 / 0.5 + 2 * 0.001024)
    # Linear cores (efficiency 1) give the old law's step: 10 ms + the shard's.
    free = predict_shared(simple_costs(), two, cores_1=1.0, cores_n=2.0)
    assert free.step_s == pytest.approx(0.010 + 2 * 0.001024)
    # One process alone never pays it.
    one = Layout(1, 0, batch_rows=1024, preloaded=True)
    assert predict_shared(c, one, cores_1=1.0, cores_n=1.0).step_s == pytest.approx(0.011024)
    # Two shards' phase runs at once too: 2 x 0.512 ms each, at half speed.
    q = predict_shared(c, Layout(2, 2, batch_rows=1024, preloaded=True), cores_1=1.0, cores_n=2.0)
    assert q.step_s == pytest.approx(0.010 / 0.5 + 2 * 0.000512 / 0.5)


def test_contention_counts_cores_of_work_not_cpu_seconds() -> None:
    # 3 trainers on 2 cores at 0.8: 30 ms of dense CPU over 1.6 cores of work.
    c = simple_costs(parallel_efficiency=0.8)
    lay = Layout(3, 1, batch_rows=1024, preloaded=True)
    p = predict(c, lay, cores=2.0, colocated=True)
    assert p.step_s == pytest.approx(0.030 / 1.6 + 3 * 0.001024)
    # The all-processes bound counts the same 1.6 cores; on half a core one
    # process at a time computes, at full efficiency.
    assert p.limits["cores"] == pytest.approx(1.6 / sum(p.cpu_s_per_row.values()))
    half = predict(c, lay, cores=0.5, colocated=True)
    assert half.limits["cores"] == pytest.approx(0.5 / sum(half.cpu_s_per_row.values()))
    # Not colocated (a cluster's own cores per process): no efficiency applies.
    assert predict(c, lay, cores=2.0).step_s == pytest.approx(0.015 + 3 * 0.001024)


def test_the_request_chain_fills_only_its_measured_share_of_the_cores() -> None:
    """With shards on a shared machine, the request chain (every trainer's
    requests, then all shards' work) lasts at least its CPU over ``cores x
    chain_utilisation``: 2x2 on 2 cores, 1 ms of requests a trainer a step and
    2.048 ms of shard work (1.024 ms a shard) that the old law ran side by side."""
    base = simple_costs(rpc_sharded_s_per_request=0.00025)  # 4 requests: 1 ms a step
    lay = Layout(2, 2, batch_rows=1024, preloaded=True)
    full = predict(base, lay, cores=2.0, colocated=True)
    # At 1 the chain's CPU over 2 cores (2.024 ms) is the old phases' 1 + 1.024 ms.
    assert full.step_s == pytest.approx(0.010 + 0.001 + 0.001024)
    half = predict(replace(base, chain_utilisation=0.5), lay, cores=2.0, colocated=True)
    # At 0.5: (2 x 1 ms + 2.048 ms) / (2 x 0.5) = 4.048 ms from the requests on.
    assert half.step_s == pytest.approx(0.010 + 0.004048)
    # Each process on its own cores (a cluster), or another machine's shared
    # cores: the calibrated machine's figure does not apply.
    halved = replace(base, chain_utilisation=0.5)
    assert predict(halved, lay).step_s == pytest.approx(full.step_s)
    assert predict(halved, lay, cores=2.0).step_s == pytest.approx(
        predict(base, lay, cores=2.0).step_s
    )
    # No shards: no chain.
    one = Layout(1, 0, batch_rows=1024, preloaded=True)
    assert predict(
        replace(base, chain_utilisation=0.5), one, cores=2.0, colocated=True
    ).step_s == pytest.approx(predict(base, one, cores=2.0, colocated=True).step_s)


def test_a_colocated_ddp_groups_dense_step_stretches_by_its_measured_wall() -> None:
    """Trainers sharing the calibrated machine: each one's dense step (with the
    all-reduce) lasts ``ddp_stretch`` times its CPU (the ranks wait on each
    other), ``ddp_stretch_oversubscribed`` times with more trainers than cores.
    10 ms of dense CPU and 0.5 ms of client requests a trainer a step, 2 cores."""
    base = simple_costs(rpc_s_per_request=0.00025)  # 2 requests: 0.5 ms a step
    stretched = replace(base, ddp_stretch=1.2, ddp_stretch_oversubscribed=1.3)
    two, three = (Layout(w, 1, batch_rows=1024, preloaded=True) for w in (2, 3))
    # Each trainer on its own core: 10 ms x 1.2 + 0.5 ms, 2 ms more than the old law.
    assert predict(stretched, two, cores=2.0, colocated=True).step_s == pytest.approx(
        predict(base, two, cores=2.0, colocated=True).step_s + 0.002
    )
    # 3 on 2 cores: 1.5 x (10 ms x 1.3 + 0.5 ms), 1.5 x 3 ms = 4.5 ms more.
    old = predict(base, three, cores=2.0, colocated=True)
    assert old.step_s == pytest.approx(1.5 * 0.0105 + 3 * 0.001024)
    new = predict(stretched, three, cores=2.0, colocated=True)
    assert new.step_s == pytest.approx(old.step_s + 0.0045)
    assert new.rows_per_s < old.rows_per_s
    # predict_shared (the bench's validation) carries it.
    assert predict_shared(stretched, three, cores_1=1.0, cores_n=2.0).step_s == pytest.approx(
        new.step_s
    )
    # Not colocated (a cluster: each trainer its own cores), or one trainer
    # (no DDP group): the calibrated machine's stretch does not apply.
    for lay in (two, three):
        assert predict(stretched, lay).step_s == pytest.approx(predict(base, lay).step_s)
        assert predict(stretched, lay, cores=2.0).step_s == pytest.approx(
            predict(base, lay, cores=2.0).step_s
        )
    one = Layout(1, 1, batch_rows=1024, preloaded=True)
    assert predict(stretched, one, cores=2.0, colocated=True).step_s == pytest.approx(
        predict(base, one, cores=2.0, colocated=True).step_s
    )
