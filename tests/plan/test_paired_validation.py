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
    bench = str(ROOT / "bench")
    if bench not in sys.path:  # as the script itself does, for simulate_real
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location("simulate", ROOT / "bench" / "simulate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rate(costs: Costs, w: int, s: int, cores_1: float = 1.0) -> float:
    layout = Layout(w, s, 0, 1024, trainer_cpus=1.0, ps_cpus=1.0, preloaded=True)
    return predict_shared(costs, layout, cores_1=cores_1, cores_n=2.0).rows_per_s


# Three calibrations of a machine whose speed drifts: the dense step 8, 10, 16 ms;
# and the core one process got in each round (other jobs held some of it in the
# second and third), so no one calibration, not even the median one, predicts the
# median round, and the calibrations in another order would not either.
SLOW = [simple_costs(dense_s_per_row=ms * 1e-3 / 1024) for ms in (8, 10, 16)]
CORES_1 = (1.0, 0.5, 0.8)


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
    paired = sim.validate(SLOW, real)
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
    validation = sim.validate(SLOW, real)
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


def test_the_pooled_figures_go_into_every_round_of_a_paired_run(tmp_path: Path) -> None:
    sim = _simulate()
    # A paired run whose calibrations differ only in the all-reduce (1, 2, 9 ms),
    # its top-level costs deliberately off (20 ms), and a calibrate-once run at 4 ms.
    base = simple_costs()
    rounds = [replace(base, allreduce_s_per_step=ms * 1e-3) for ms in (1, 2, 9)]
    top = replace(base, allreduce_s_per_step=20e-3)
    real = [
        {
            "trainers": 2,
            "ps_shards": 1,
            "batch_rows": 1024,
            "rows_per_s": 50_000.0,
            "rounds": [{"rows_per_s": 50_000.0, "cores_1": 1.0, "cores_n": 2.0}] * 3,
        }
    ]
    paired = tmp_path / "paired.json"
    paired.write_text(
        json.dumps(
            {
                "costs": top.to_dict(),
                "calibrations": [c.to_dict() for c in rounds],
                "validation": sim.validate(rounds, real),
            }
        )
    )
    once = tmp_path / "once.json"
    single = replace(base, allreduce_s_per_step=4e-3)
    validation = sim.validate(single, real)
    once.write_text(json.dumps({"costs": single.to_dict(), "validation": validation}))
    out = tmp_path / "replay.json"
    script = ROOT / "bench" / "law_replay.py"
    argv = [sys.executable, str(script), str(paired), str(once), "--pool-multi", "--json", str(out)]
    subprocess.run(argv, capture_output=True, text=True, check=True)
    replayed = json.loads(out.read_text())
    # The median over the four calibrations (1, 2, 4, 9 ms: 3 ms), not over the
    # runs' top-level costs (20 and 4 ms: 12 ms) ...
    assert [r["allreduce_s_per_step"] for r in replayed] == pytest.approx([3e-3, 3e-3])
    assert [r["calibrations"] for r in replayed] == [3, 1]
    # ... and in every round of the paired run, not only in its top-level costs.
    pooled = _rate(replace(base, allreduce_s_per_step=3e-3), 2, 1)
    assert replayed[0]["configs"][0]["predicted"] == pytest.approx(pooled)


def test_each_round_is_calibrated_just_before_its_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulate()
    events: list[str] = []

    def calibrate(job: object, others: dict[str, Costs]) -> Costs:
        events.append("calibrate")
        i = events.count("calibrate") - 1
        others["least_rounds"] = SLOW[2 - i]  # a stand-in: told apart from the median
        return SLOW[i]

    def run_once(trainers: int, shards: int, epochs: int) -> dict[str, Any]:
        events.append(f"{trainers}x{shards}")
        return {"rows_per_s": 1.0, "load_avg_1m": 0.0, "cores_1": 1.0, "cores_n": 2.0}

    probes = iter(range(1, 100))
    monkeypatch.setattr(sim, "calibrate", calibrate)
    monkeypatch.setattr(sim.simulate_real, "run_once", run_once)
    monkeypatch.setattr(sim.simulate_real, "probe", lambda n: (1.0, float(next(probes))))
    paired, least_rounds, loops, real = sim.measure_paired(None, [(1, 0), (2, 1)], 3, 1)
    assert events == ["calibrate", "1x0", "2x1"] * 3
    assert paired == SLOW
    assert least_rounds == SLOW[::-1]  # each round's own least-rounds variant
    assert loops == [1.5, 3.5, 5.5]  # the probe's loops before and after each calibration
    assert [len(c["rounds"]) for c in real] == [3, 3]


def test_bias_is_each_configs_median_ratio_over_its_rounds() -> None:
    """predicted / measured per round, median over rounds: 1.2, 0.9, 1.1 -> 1.1."""
    sim = _simulate()
    validation = [
        {"config": "1x0", "predicted_rounds": [12.0, 9.0, 11.0], "measured_rounds": [10.0] * 3}
    ]
    assert sim.bias(validation) == {"1x0": pytest.approx(1.1)}


def test_the_error_after_each_rounds_count_takes_the_median_of_those_rounds() -> None:
    """One calibration predicts every round of 1x0 at p; the rounds measure p,
    1.3 p and 0.9 p: after 1 round 0, after 2 |p - 1.15 p| / 1.15 p, after 3 0."""
    sim = _simulate()
    p = _rate(SLOW[0], 1, 0)
    rounds = [{"rows_per_s": p * f, "cores_1": 1.0, "cores_n": 2.0} for f in (1.0, 1.3, 0.9)]
    real = [{"trainers": 1, "ps_shards": 0, "batch_rows": 1024, "rows_per_s": p, "rounds": rounds}]
    assert sim.error_by_rounds(SLOW[0], real) == pytest.approx([0.0, 0.15 / 1.15, 0.0])
    assert sim.error_by_rounds(SLOW[0], real)[-1] == sim.worst_error(sim.validate(SLOW[0], real))


def test_a_paired_runs_error_by_rounds_predicts_round_i_from_calibration_i() -> None:
    """Paired: each round measured at its own calibration's prediction, so every
    count of rounds reads 0; the calibrations reversed read the drift from the
    first round on, and the last entry is the run's ``validation_error``."""
    sim = _simulate()
    real = _real(((1, 0), (2, 1)))
    assert sim.error_by_rounds(SLOW, real) == pytest.approx([0.0] * 3, abs=1e-12)
    reversed_ = sim.error_by_rounds(SLOW[::-1], real)
    assert len(reversed_) == 3 and reversed_[0] > 0.1
    assert reversed_[-1] == sim.worst_error(sim.validate(SLOW[::-1], real))


def test_the_law_without_the_ddp_stretch_is_judged_on_the_same_runs() -> None:
    """``without_ddp_stretch`` sets both stretches to 1.0 and nothing else: a
    stretched calibration predicts 3x1 slower than without, 1x0 the same."""
    sim = _simulate()
    stretched = [replace(c, ddp_stretch=1.2, ddp_stretch_oversubscribed=1.3) for c in SLOW]
    plain = [sim.without_ddp_stretch(c) for c in stretched]
    assert plain == SLOW
    real = _real(((1, 0), (3, 1)))
    with_it, without = sim.validate(stretched, real), sim.validate(plain, real)
    assert with_it[0]["predicted_rounds"] == pytest.approx(without[0]["predicted_rounds"])
    # Slower where the 3 trainers' phase on 2 cores binds (round 0, a whole core
    # each); never faster (rounds 1-2: a process got half and 0.8 of a core,
    # and the step alone at that share binds instead).
    slower, plain_3x1 = with_it[1]["predicted_rounds"], without[1]["predicted_rounds"]
    assert slower[0] < plain_3x1[0]
    assert all(a <= b + 1e-9 for a, b in zip(slower, plain_3x1, strict=True))
    assert without[1]["relative_error"] == pytest.approx(0.0, abs=1e-12)


def test_a_paired_validation_needs_one_calibration_per_round() -> None:
    sim = _simulate()
    with pytest.raises(ValueError, match="config 1x0: 3 rounds but 2 calibrations"):
        sim.validate(SLOW[:2], _real(((1, 0),)))


def test_saved_runs_read_back_with_every_rounds_figures(tmp_path: Path) -> None:
    """``read_real`` of a bench/simulate.py JSON keeps each round's rows/s, cores,
    loops and steady window (a file from before the loops were recorded reads
    without them), so ``--real`` re-validates them as they were measured."""
    sim = _simulate()
    rounds = [
        {
            "rows_per_s": 40_000.0 + i,
            "cores_1": 1.0,
            "cores_n": 1.9 + i / 100,
            "loops_1": 3e7 + i,
            "loops_n": 2.9e7 + i,
            "steady_window_s": 2.5 + i,
        }
        for i in range(3)
    ]
    real = [
        {
            "trainers": 2,
            "ps_shards": 1,
            "batch_rows": 1024,
            "rows_per_s": 40_001.0,
            "rounds": rounds,
        }
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"validation": sim.validate(SLOW[0], real)}))
    (back,) = sim.pool([sim.read_real(path)])  # as --real reads them
    assert back["rounds"] == rounds and (back["trainers"], back["ps_shards"]) == (2, 1)
    assert sim.validate(SLOW[0], [back]) == sim.validate(SLOW[0], real)
    old = {
        "validation": [
            {k: v for k, v in x.items() if not k.startswith(("loops", "steady"))}
            for x in sim.validate(SLOW[0], real)
        ]
    }
    path.write_text(json.dumps(old))
    (back,) = sim.read_real(path)
    assert [set(r) for r in back["rounds"]] == [{"rows_per_s", "cores_1", "cores_n"}] * 3
    old["validation"][0]["cores_n"] = old["validation"][0]["cores_n"][:2]
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"config 2x1: cores_n has 2 entries for 3 rounds"):
        sim.read_real(path)
