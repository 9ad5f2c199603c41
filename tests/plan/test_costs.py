from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from estuary.config import ConfigError
from estuary.plan.costs import Costs, load_costs, save_costs


def test_calibration_file_round_trips(tmp_path: Path, costs: Costs) -> None:
    path = tmp_path / "costs.json"
    save_costs(costs, path)
    assert load_costs(path) == costs
    assert not list(tmp_path.glob(".costs.json.*"))  # the temp file was renamed


def test_unknown_key_names_file_and_key(tmp_path: Path, costs: Costs) -> None:
    data = costs.to_dict() | {"dense_s_per_rwo": 1.0}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"c\.json\.dense_s_per_rwo: unknown key"):
        load_costs(path)


def test_missing_and_negative_values_name_the_field(tmp_path: Path, costs: Costs) -> None:
    data = costs.to_dict()
    del data["bytes_per_row"]
    with pytest.raises(ConfigError, match=r"costs\.bytes_per_row: missing"):
        Costs.from_dict(data)
    with pytest.raises(ConfigError, match=r"costs\.lookup_s_per_id: must be >= 0"):
        Costs.from_dict(costs.to_dict() | {"lookup_s_per_id": -1.0})


def test_unique_ids_follow_the_fitted_power_law(costs: Costs) -> None:
    from dataclasses import replace

    c = replace(costs, sparse_features=2, ids_per_row=2.0, unique_coef=4.0, unique_exp=0.5)
    assert c.unique_ids(100) == pytest.approx(2 * 4.0 * 10)  # F * coef * b ** exp
    assert c.unique_ids(4) == pytest.approx(2 * 4)  # never more ids than the batch has


def test_speedup_extends_the_two_thread_figure(costs: Costs) -> None:
    from dataclasses import replace

    c = replace(costs, dense_speedup_2=1.5)  # Amdahl p = 2/3
    assert c.speedup(2) == pytest.approx(1.5)
    assert c.speedup(4) == pytest.approx(1 / (1 / 3 + (2 / 3) / 4))
    assert replace(costs, dense_speedup_2=1.0).speedup(8) == pytest.approx(1.0)


def test_concurrent_efficiency_runs_from_one_alone_to_the_measured_figure(costs: Costs) -> None:
    from dataclasses import replace

    c = replace(costs, cores=4, parallel_efficiency=0.7)
    assert c.concurrent_efficiency(1) == 1.0
    assert c.concurrent_efficiency(4) == pytest.approx(0.7)  # every core busy
    assert c.concurrent_efficiency(9) == pytest.approx(0.7)  # no more cores to fill
    assert c.concurrent_efficiency(2.5) == pytest.approx(1 - 0.3 * 1.5 / 3)
    assert replace(c, cores=1).concurrent_efficiency(3) == 1.0


def test_parallel_efficiency_out_of_range_names_the_field(tmp_path: Path, costs: Costs) -> None:
    data = costs.to_dict() | {"parallel_efficiency": 1.5}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"parallel_efficiency.*\(0, 1\]"):
        load_costs(path)
    path.write_text(json.dumps(costs.to_dict() | {"chain_utilisation": 0.0}))
    with pytest.raises(ConfigError, match=r"chain_utilisation.*\(0, 1\]"):
        load_costs(path)


def test_a_costs_file_from_before_the_chain_figure_is_refused(tmp_path: Path, costs: Costs) -> None:
    data = costs.to_dict() | {"version": 4}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"version: expected 6 \(or 5\), got 4"):
        load_costs(path)
    data.pop("chain_utilisation")
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="chain_utilisation: missing"):
        load_costs(path)


def test_a_version_5_costs_file_loads_with_the_law_before_the_ddp_stretch(
    tmp_path: Path, costs: Costs
) -> None:
    """A file from before the DDP group's stretch (version 5) loads with both
    figures at 1.0, the law it was saved under; a version-6 file needs both, and
    neither may be below 1."""
    data = costs.to_dict() | {"version": 5}
    for name in ("ddp_stretch", "ddp_stretch_oversubscribed"):
        data.pop(name)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    old = load_costs(path)
    assert old.ddp_stretch == old.ddp_stretch_oversubscribed == 1.0 and old.version == 5
    path.write_text(json.dumps(data | {"version": 6}))
    with pytest.raises(ConfigError, match="ddp_stretch: missing"):
        load_costs(path)
    path.write_text(json.dumps(costs.to_dict() | {"ddp_stretch_oversubscribed": 0.9}))
    with pytest.raises(ConfigError, match=r"ddp_stretch_oversubscribed.*>= 1, got 0.9"):
        load_costs(path)
    saved = replace(costs, ddp_stretch=1.2, ddp_stretch_oversubscribed=1.35)
    path.write_text(json.dumps(saved.to_dict()))
    assert load_costs(path) == saved
