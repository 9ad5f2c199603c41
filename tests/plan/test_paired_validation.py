"""bench/simulate.py's paired validation: each round predicted from the
calibration made just before it (hand-made costs and rounds; nothing is timed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from estuary.plan.costs import Costs
from estuary.plan.model import Layout, predict_shared

from .conftest import simple_costs

ROOT = Path(__file__).resolve().parents[2]


def _simulate() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))  # as the script itself does, for simulate_real
    spec = importlib.util.spec_from_file_location("simulate", ROOT / "bench" / "simulate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rate(costs: Costs, w: int, s: int, cores_1: float = 1.0) -> float:
    layout = Layout(w, s, 0, 1024, trainer_cpus=1.0, ps_cpus=1.0, preloaded=True)
    return predict_shared(costs, layout, cores_1=cores_1, cores_n=2.0).rows_per_s


# Three calibrations of a machine whose speed drifts: the dense step 8, 10, 16 ms;
# and the core one process got in each round (another job held half of it in the
# second), so no one calibration, not even the median one, predicts the median round.
SLOW = [simple_costs(dense_s_per_row=ms * 1e-3 / 1024) for ms in (8, 10, 16)]
CORES_1 = (1.0, 0.5, 1.0)


def _real(configs: tuple[tuple[int, int], ...], allreduce_s: float = 0.0) -> list[dict[str, Any]]:
    """Each round measured at what its own calibration predicts, with the
    all-reduce at ``allreduce_s`` (the calibrations read 0)."""
    out = []
    for w, s in configs:
        rounds = [
            {
                "rows_per_s": _rate(replace(c, allreduce_s_per_step=allreduce_s), w, s, cores),
                "cores_1": cores,
                "cores_n": 2.0,
            }
            for c, cores in zip(SLOW, CORES_1, strict=True)
        ]
        out.append(
            {
                "trainers": w,
                "ps_shards": s,
                "batch_rows": 1024,
                "rows_per_s": sorted(r["rows_per_s"] for r in rounds)[1],
                "rounds": rounds,
            }
        )
    return out


def test_each_round_is_predicted_from_its_own_calibration() -> None:
    sim = _simulate()
    real = _real(((1, 0), (2, 1)))
    paired = sim.validate(SLOW[0], real, SLOW)
    for v, cfg in zip(paired, real, strict=True):
        assert v["predicted_rounds"] == pytest.approx([r["rows_per_s"] for r in cfg["rounds"]])
        assert v["relative_error"] == pytest.approx(0.0, abs=1e-12)
    # One calibration for every round (the calibrate-once design) misses the drift.
    once = sim.validate(SLOW[0], real)
    assert max(v["relative_error"] for v in once) > 0.1
    assert once[0]["predicted_rounds"] == pytest.approx(
        [_rate(SLOW[0], 1, 0, cores) for cores in CORES_1]
    )


def test_median_costs_takes_each_figure_at_its_median() -> None:
    sim = _simulate()
    a = replace(SLOW[0], allreduce_s_per_step=9e-3, cores=2, machine={"host": "a"})
    b = replace(SLOW[1], allreduce_s_per_step=1e-3, cores=4)
    c = replace(SLOW[2], allreduce_s_per_step=3e-3, cores=8)
    pooled = sim.median_costs([a, b, c])
    assert pooled.dense_s_per_row == SLOW[1].dense_s_per_row
    assert pooled.allreduce_s_per_step == 3e-3
    assert pooled.cores == 4 and isinstance(pooled.cores, int)
    assert pooled.machine == {"host": "a", "calibrations": 3}
    two = sim.median_costs([a, b])  # an even count: the lower middle of the counts
    assert two.cores == 2 and two.allreduce_s_per_step == pytest.approx(5e-3)


def test_the_law_replay_replays_a_paired_run_round_by_round(tmp_path: Path) -> None:
    sim = _simulate()
    real = _real(((1, 0), (2, 1)), allreduce_s=2e-3)
    validation = sim.validate(SLOW[0], real, SLOW)
    run = tmp_path / "paired.json"
    run.write_text(
        json.dumps(
            {
                "costs": sim.median_costs(SLOW).to_dict(),
                "calibrations": [c.to_dict() for c in SLOW],
                "validation": validation,
            }
        )
    )
    out = tmp_path / "replay.json"
    script = ROOT / "bench" / "law_replay.py"
    argv = [sys.executable, str(script), str(run), "--json", str(out)]
    subprocess.run(argv, capture_output=True, text=True, check=True)
    [replayed] = json.loads(out.read_text())
    by = {c["config"]: c for c in replayed["configs"]}
    # Replayed as validated: each round from its own calibration, so 1x0 (no
    # all-reduce in it) is exact; the median calibration alone would miss it.
    assert by["1x0"]["signed_error"] == pytest.approx(0.0, abs=1e-9)
    median = sim.validate(sim.median_costs(SLOW), real)
    assert median[0]["relative_error"] > 0.1
    assert by["2x1"]["signed_error"] > 0.01  # the calibrations left the all-reduce out
    # The bisection, applied to every round's calibration, finds the 2 ms back.
    assert by["2x1"]["implied_allreduce_s"] == pytest.approx(2e-3, rel=1e-3)


def test_the_speed_index_scales_each_round_by_its_core_speed() -> None:
    sim = _simulate()
    calibration_loops = [4e6, 5e6, 3e6]

    def config(processes: int, loops_1: list[float], loops_n: list[float]) -> dict[str, Any]:
        return {
            "processes": processes,
            "measured_rows_per_s": 100.0,
            "predicted_rounds": [120.0, 120.0, 120.0],
            "loops_1": loops_1,
            "loops_n": loops_n,
        }

    # Every run's cores 5/6 as fast as at its calibration: the 20% over-prediction
    # is the drift, and the index takes it out; one process reads loops_1, several
    # loops_n.
    slowed = [c * 5 / 6 for c in calibration_loops]
    one = config(1, slowed, calibration_loops)
    several = config(3, calibration_loops, slowed)
    assert sim.speed_index_error([one, several], calibration_loops) == pytest.approx(0.0)
    # The same cores as at the calibration leave the error as it was.
    same = config(3, slowed, calibration_loops)
    assert sim.speed_index_error([same], calibration_loops) == pytest.approx(0.2)
