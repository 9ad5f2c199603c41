"""``bench/law_replay.py`` re-predicts a saved validation with the law and finds
the all-reduce figure that would have made each config exact (runs the
script on a hand-made ``bench/simulate.py`` JSON; nothing is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from estuary.plan.model import Layout, predict_shared

from .conftest import simple_costs

ROOT = Path(__file__).resolve().parents[2]


def test_the_replay_recovers_the_all_reduce_the_measured_rate_implies(tmp_path: Path) -> None:
    costs = simple_costs(allreduce_s_per_step=4e-3, rpc_s_per_request=1e-4)
    truth = replace(costs, allreduce_s_per_step=1.5e-3)  # what the "real runs" ran at
    validation = []
    for w, s, faster in ((1, 0, 1.0), (2, 1, 1.0), (3, 1, 1.5)):
        layout = Layout(w, s, 0, 1024, preloaded=True)
        rate = predict_shared(truth, layout, cores_1=1.0, cores_n=2.0).rows_per_s
        validation.append(
            {
                "config": f"{w}x{s}",
                "trainers": w,
                "ps_shards": s,
                "measured_rows_per_s": rate * faster,  # 3x1: faster than any all-reduce allows
                "measured_rounds": [rate * faster] * 2,
                "cores_1": [1.0, 1.0],
                "cores_n": [2.0, 2.0],
            }
        )
    run = tmp_path / "sim.json"
    raw = costs.to_dict()
    del raw["chain_utilisation"]  # a version-4 file: --chain-utilisation stands in
    run.write_text(json.dumps({"costs": raw, "validation": validation}))
    out = tmp_path / "replay.json"
    script = ROOT / "bench" / "law_replay.py"
    argv = [sys.executable, str(script), str(run), "--chain-utilisation", "1", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert "2x1" in done.stdout
    [replayed] = json.loads(out.read_text())
    by = {c["config"]: c for c in replayed["configs"]}
    assert by["1x0"]["signed_error"] == pytest.approx(0.0, abs=1e-9)  # no all-reduce in it
    assert by["1x0"]["implied_allreduce_s"] is None
    # The law at 4 ms predicts fewer rows/s than measured at 1.5 ms ...
    assert by["2x1"]["signed_error"] < -0.01
    # ... and the bisection finds the 1.5 ms back.
    assert by["2x1"]["implied_allreduce_s"] == pytest.approx(1.5e-3, rel=1e-3)
    assert by["3x1"]["implied_allreduce_s"] is None
    assert replayed["validation_error"] == pytest.approx(
        max(abs(c["signed_error"]) for c in replayed["configs"])
    )


def test_pool_multi_puts_the_multi_process_figures_at_their_median(tmp_path: Path) -> None:
    runs = []
    for i, (allreduce, dense) in enumerate(((2e-3, 10e-3), (4e-3, 20e-3), (9e-3, 30e-3))):
        costs = simple_costs(allreduce_s_per_step=allreduce, dense_s_per_row=dense / 1024)
        validation = [
            {
                "config": "2x1",
                "trainers": 2,
                "ps_shards": 1,
                "measured_rows_per_s": 50_000.0,
                "measured_rounds": [50_000.0],
                "cores_1": [1.0],
                "cores_n": [2.0],
            }
        ]
        path = tmp_path / f"sim{i}.json"
        path.write_text(json.dumps({"costs": costs.to_dict(), "validation": validation}))
        runs.append(str(path))
    out = tmp_path / "replay.json"
    script = ROOT / "bench" / "law_replay.py"
    argv = [sys.executable, str(script), *runs, "--pool-multi", "--json", str(out)]
    subprocess.run(argv, capture_output=True, text=True, check=True)
    replayed = json.loads(out.read_text())
    # The all-reduce is each run's median (4 ms); the dense step stays each run's own.
    assert [r["allreduce_s_per_step"] for r in replayed] == [4e-3] * 3
    rates = [r["configs"][0]["predicted"] for r in replayed]
    assert rates[0] > rates[1] > rates[2]
