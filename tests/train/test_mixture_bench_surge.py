"""``bench/mixture.py``'s surges: the traffic surge's window holds the no-surge
window's own rows among more draws of the same hour, and a surge run scores
every arriving row, keeps the buffer within its bytes and leaves fifo's overflow
in the producer's backlog."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

pytest.importorskip("river", reason="bench/mixture.py compares against river")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "mixture.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_mixture", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_traffic_window_spreads_the_windows_own_rows_among_more_of_the_same_hour(
    bench: ModuleType,
) -> None:
    data = bench.synthetic("abrupt", 3, 400, 4, 50)
    own_window = bench.Batch.concatenate(data.windows[1])
    rows, own = bench.traffic_window("abrupt", 3, 400, 4, 1, 12.5)
    assert rows.num_rows == 5000 and own.size == 400
    np.testing.assert_array_equal(rows.labels[own], own_window.labels)
    np.testing.assert_array_equal(rows.dense[own], own_window.dense)
    for name in data.features:
        np.testing.assert_array_equal(rows.sparse[name].values[own], own_window.sparse[name].values)
    gaps = np.diff(own)
    assert gaps.min() >= 11 and gaps.max() <= 14  # one own row in every ~12.5
    others = np.setdiff1d(np.arange(rows.num_rows), own)
    assert not np.array_equal(rows.labels[others][:400], own_window.labels)  # new draws
    # the same hour: the other rows' ids come from the same vocabularies
    seen = set(own_window.sparse["C1"].values.tolist())
    assert np.isin(rows.sparse["C1"].values[others], list(seen)).mean() > 0.5


@pytest.mark.parametrize("policy", ["priority", "uniform", "fifo"])
def test_traffic_surge_run_scores_every_row_within_the_buffer(
    bench: ModuleType, policy: str
) -> None:
    args = bench.arguments().parse_args(["--batch-size", "50", "--surge-buffer-rows", "200"])
    data = bench.synthetic("abrupt", 0, 400, 4, 50)
    traffic = bench.traffic_window("abrupt", 0, 400, 4, 1, 12.5)
    run = bench.surge_run(data, 0, args, policy, 1, traffic)
    counts = run["counts"]
    arrived = 400 + 5000  # window 0, then the surge window; 10x = 500 rows a tick
    offered = counts["offered"] + run["backlog_rows_at_end"]
    assert offered == arrived
    assert run["buffer_peak_bytes"] <= run["buffer_capacity_bytes"]
    assert len(run["windows"]) == 2 and all(0.4 < a <= 1 for a in run["windows"])
    assert 0.4 < run["surge_window_own_rows_auc"] <= 1
    # 8 + 10 ticks of one 50-row step: the surge window lasts as long as without the surge
    assert counts["taken"] == 50 * (8 + 10)
    if policy == "fifo":
        assert run["backlog_rows_at_end"] > 4000  # backpressure: the producer holds the rest
        assert counts["sampled_out"] == counts["evicted"] == counts["expired"] == 0
    else:
        assert run["backlog_rows_at_end"] == 0
        assert counts["sampled_out"] + counts["evicted"] + counts["expired"] > 4000


@pytest.mark.parametrize("traffic", [False, True])
def test_keep_pace_trains_every_row_in_the_no_surge_runs_steps(
    bench: ModuleType, traffic: bool
) -> None:
    args = bench.arguments().parse_args(["--batch-size", "50", "--surge-buffer-rows", "200"])
    data = bench.synthetic("abrupt", 0, 400, 4, 50)
    rows = bench.traffic_window("abrupt", 0, 400, 4, 1, 12.5) if traffic else None
    run = bench.surge_run(data, 0, args, "priority", 1, rows, keep_pace=True)
    counts = run["counts"]
    arrived = 400 + (5000 if traffic else 400)
    assert counts["offered"] == counts["taken"] == arrived  # nothing shed, nothing left
    assert run["kept_fraction"] == 1.0 and run["backlog_rows_at_end"] == 0
    assert counts["sampled_out"] == counts["evicted"] == counts["expired"] == 0
    assert run["lag_p99_ticks"] == 0  # every row trained in the tick it came
    # Steps of 40 rows (a no-surge tick's): window 0 is 10 ticks of 40 rows; the
    # surge arrives 500 rows a tick: the replay's 400 rows in one tick (10
    # steps, as many as the no-surge run takes for them), the traffic's 5,000 in
    # 10 ticks of 13 steps (12 of 40 rows, one of 20).
    no_surge = bench.surge_run(data, 0, args, None)
    assert no_surge["steps"] == 20
    assert run["steps"] == (10 + 10 * 13 if traffic else 20)
    assert len(run["windows"]) == 2 and all(0.4 < a <= 1 for a in run["windows"])


def test_keep_pace_needs_a_surge(bench: ModuleType) -> None:
    args = bench.arguments().parse_args(["--batch-size", "50", "--surge-buffer-rows", "200"])
    data = bench.synthetic("abrupt", 0, 400, 4, 50)
    with pytest.raises(ValueError, match="keep_pace"):
        bench.surge_run(data, 0, args, None, keep_pace=True)


def test_surge_reports_keep_pace_paired_with_the_no_surge_runs(bench: ModuleType) -> None:
    args = bench.arguments().parse_args(
        [
            "--batch-size", "50", "--surge-buffer-rows", "200", "--rows-per-hour", "400",
            "--hours", "4", "--surge-seeds", "2", "--surge-scenarios", "abrupt",
            "--surge-steady-at", "-1", "--no-surge-traffic",
        ]
    )  # fmt: skip
    report = bench.surge(args)["surge"]
    keep = report["keep_pace"]
    assert len(keep["drop_by_seed"]) == 2 and keep["kept_fraction"] == 1.0
    assert keep["steps"] == keep["no_surge_steps"]  # the replay: as many steps, all at once
    for base, auc, drop in zip(
        report["no_surge"]["auc_by_seed"], keep["auc_by_seed"], keep["drop_by_seed"], strict=True
    ):
        assert drop == pytest.approx(base - auc, abs=2e-4)  # by seed (the AUCs are rounded)
    assert keep["seeds_over_0.003"] == sum(d > 0.003 for d in keep["drop_by_seed"])
    paired = np.array(report["priority"]["auc_by_seed"]) - np.array(keep["auc_by_seed"])
    assert keep["priority_minus_it"]["mean"] == pytest.approx(paired.mean())
    assert keep["priority_minus_it"]["seeds_priority_ahead"] == int((paired > 0).sum())
    args.no_surge_keep_pace = True
    assert "keep_pace" not in bench.surge(args)["surge"]
