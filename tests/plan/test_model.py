from __future__ import annotations

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
    assert capped.bottleneck == "cores"
    assert capped.rows_per_s == pytest.approx(0.25 / (0.011024 / 1024))


def test_network_latency_lengthens_the_step() -> None:
    c = simple_costs(net_latency_s=1e-3)
    p = predict(c, Layout(2, 1, batch_rows=1024, preloaded=True))
    # 3 PS round trips + 1 all-reduce round trip (log2 2) on top of 10 + 1.024 ms.
    assert p.step_s == pytest.approx(0.010 + 0.001024 + 4e-3)


def test_invalid_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="ps_shards"):
        Layout(2, 0, preloaded=True)
    with pytest.raises(ValueError, match="executors"):
        Layout(1, 1, executors=0)
