from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from estuary.cli import main
from estuary.plan.costs import Costs, save_costs
from estuary.plan.model import predict
from estuary.plan.simulator import ClusterSpec
from estuary.plan.sizing import _grid, _layout_for, size_job
from estuary.plan.trace import GIB

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "criteo.yaml"


def test_shards_hold_the_tables_and_the_layout_fits(costs: Costs) -> None:
    cluster = ClusterSpec(nodes=10)
    s = size_job(costs, 1e9, cluster, ps_memory_bytes=16 * GIB)
    # 1e9 ids x 100 B = 100 GB over 80% of 16 GiB shards.
    assert s.shards_for_memory == math.ceil(1e11 / (0.8 * 16 * GIB))
    assert s.layout.ps_shards >= s.shards_for_memory
    assert s.cores_used <= cluster.cores
    assert s.memory_used_bytes <= cluster.memory_bytes
    assert s.shard_bytes * s.layout.ps_shards == pytest.approx(1e11)
    # Neither PS nor executors set the pace: the trainers do.
    assert s.prediction.bottleneck == "trainers"


def test_more_nodes_more_trainers_more_rows(costs: Costs) -> None:
    small = size_job(costs, 1e8, ClusterSpec(nodes=4))
    big = size_job(costs, 1e8, ClusterSpec(nodes=40))
    assert big.layout.trainers > small.layout.trainers
    assert big.prediction.rows_per_s > small.prediction.rows_per_s


def test_tables_too_big_for_the_cluster_are_an_error(costs: Costs) -> None:
    with pytest.raises(ValueError, match="ids need"):
        size_job(costs, 1e13, ClusterSpec(nodes=2))


def test_estuary_plan_prints_the_sizing(
    tmp_path: Path, costs: Costs, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "costs.json"
    save_costs(costs, saved)
    out_json = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            str(EXAMPLE),
            "--nodes",
            "100",
            "--ids",
            "1e10",
            "--costs",
            str(saved),
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "PS shards" in text and "predicted throughput" in text
    answer = json.loads(out_json.read_text())
    assert answer["ps_shards"] >= math.ceil(1e10 * 100 / (0.8 * 64 * GIB))
    assert answer["trainers"] >= 1 and answer["executors"] >= 1


def test_estuary_plan_names_a_bad_calibration_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "costs.json"
    bad.write_text(json.dumps({"parse_s_per_row": 1.0}))
    rc = main(["plan", str(EXAMPLE), "--nodes", "4", "--costs", str(bad)])
    assert rc == 2
    assert f"error: {bad}.allreduce_s_per_step: missing" in capsys.readouterr().err  # sorted first


def test_the_grid_is_geometric_and_covers_both_ends() -> None:
    assert _grid(1, 5) == [1, 2, 3, 4, 5]
    g = _grid(3, 1000, step=2.0)
    assert g == [3, 6, 12, 24, 48, 96, 192, 384, 768]


def test_costly_requests_make_sizing_choose_fewer_shards(costs: Costs) -> None:
    # Every trainer sends 2 requests to every shard: at 5 ms of trainer CPU each,
    # more shards lengthen every step, so the answer keeps them near what memory needs.
    cluster = ClusterSpec(nodes=10)
    cheap = size_job(costs, 1e8, cluster)
    dear = size_job(
        replace(costs, rpc_s_per_request=5e-3, rpc_sharded_s_per_request=5e-3), 1e8, cluster
    )
    assert dear.layout.ps_shards < cheap.layout.ps_shards
    assert dear.prediction.rows_per_s < cheap.prediction.rows_per_s
    # The answer is at least as fast as the same trainers with one shard more.
    dear_costs = replace(costs, rpc_s_per_request=5e-3, rpc_sharded_s_per_request=5e-3)
    lay = dear.layout
    more = _layout_for(dear_costs, lay.trainers, lay.ps_shards + 1, cluster, 1.2)
    assert predict(dear_costs, more).rows_per_s <= dear.prediction.rows_per_s * (1 + 0.01)
