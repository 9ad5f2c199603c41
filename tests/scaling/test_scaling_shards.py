"""The PS shard count as a memory knob (``ps_shards``): a shard forecast to
cross its budget gets a new shard while ``Bounds.max_shards`` allows (row caps
only past it); two shards far under budget and cold are merged (down to
``min_shards``); room left by rows moved away is not read as growth; a change
is not reversed within the hold (``Hysteresis``)."""

from __future__ import annotations

from typing import Any

from estuary.config.scaling import ScalingSpec
from estuary.runtime.scaling import Bounds, EstuaryPolicy, Hysteresis, ShardMetrics, Snapshot
from estuary.runtime.scaling.policy import forecast_crossing

BUDGET = 1_000_000
SPEC = ScalingSpec(enabled=True, interval_s=1.0, memory_horizon_s=4.0)


def snap(t: float, *shards: tuple[int, int, float], allocated: int | None = None) -> Snapshot:
    """Shards as (rows, bytes, load)."""
    return Snapshot(
        t,
        0,
        None,
        1.0,
        0,
        0.0,
        shards=tuple(
            ShardMetrics(p, load, rows, nbytes, BUDGET, None, allocated)
            for p, (rows, nbytes, load) in enumerate(shards)
        ),
    )


def growing(count: int) -> list[Snapshot]:
    # Shard 0 grows 2,000 rows a second at 50 B a row: 4 s ahead crosses 1 MB at ~9,000 rows.
    return [snap(float(t), *[(2000 * t, 100_000 * t, 10.0)] * count) for t in range(1, 6)]


def test_a_shard_forecast_over_budget_gets_a_new_shard_while_max_allows() -> None:
    decisions = EstuaryPolicy(SPEC, Bounds(max_shards=2)).decide(growing(1))
    assert [(d.knob, d.old, d.new) for d in decisions] == [("ps_shards", 1, 2)]
    d = decisions[0]
    assert d.metrics["memory_bytes"] < BUDGET < d.metrics["forecast_bytes"]
    assert d.metrics["shard"] == 0


def test_at_max_shards_or_without_bounds_the_rows_are_capped() -> None:
    for bounds in (Bounds(max_shards=1), Bounds()):
        decisions = EstuaryPolicy(SPEC, bounds).decide(growing(1))
        assert [d.knob for d in decisions] == ["shard_rows:0"]


def test_with_the_row_cap_a_shard_counting_admissions_has_its_min_count_doubled() -> None:
    """At max shards a shard forecast over budget is capped; when its tables
    count sightings (``admission.min_count`` 3) the rule is doubled too, and
    before the cap (a split is still possible) it is left alone."""
    from dataclasses import replace

    history = [
        replace(h, shards=tuple(replace(m, admission_min_count=3) for m in h.shards))
        for h in growing(1)
    ]
    decisions = EstuaryPolicy(SPEC, Bounds(max_shards=1)).decide(history)
    d = decisions[0]
    assert (d.knob, d.old, d.new) == ("shard_admission:0", 3, 6)
    assert [d.knob for d in decisions] == ["shard_admission:0", "shard_rows:0"]
    assert "admit only ids seen 6 times" in decisions[0].trigger
    split = EstuaryPolicy(SPEC, Bounds(max_shards=2)).decide(history)
    assert [d.knob for d in split] == ["ps_shards"]


def test_no_shard_decision_in_the_interval_after_the_count_changed() -> None:
    history = [*growing(1), snap(6.0, (6000, 500_000, 10.0), (4000, 200_000, 10.0))]
    assert EstuaryPolicy(SPEC, Bounds(max_shards=3)).decide(history) == []


def test_room_left_by_moved_rows_is_not_read_as_growth() -> None:
    # After a split: 6,000 rows in arrays that hold 10,000; 500 rows/s for 4 s fit.
    series = [(1.0, 5000, 600_000), (2.0, 5500, 600_000), (3.0, 6000, 600_000)]
    _, ahead = forecast_crossing(series, 4.0, None, 10_000)
    assert ahead == 600_000
    _, without = forecast_crossing(series, 4.0)  # no room known: every new row costs
    assert without > 600_000


def test_two_cold_shards_far_under_budget_are_merged_down_to_min() -> None:
    steady = [snap(float(t), (1000, 100_000, 5.0), (900, 90_000, 1.0)) for t in range(1, 4)]
    decisions = EstuaryPolicy(SPEC, Bounds(max_shards=4)).decide(steady)
    assert [(d.knob, d.old, d.new) for d in decisions] == [("ps_shards", 2, 1)]
    assert decisions[0].metrics["retire"] == 1 and decisions[0].metrics["into"] == 0
    assert EstuaryPolicy(SPEC, Bounds(min_shards=2, max_shards=4)).decide(steady) == []
    assert EstuaryPolicy(SPEC, Bounds()).decide(steady) == []  # shards fixed: no merge
    # The smaller shard is the hot one: no merge.
    hot = [snap(float(t), (1000, 100_000, 1.0), (900, 90_000, 50.0)) for t in range(1, 4)]
    assert EstuaryPolicy(SPEC, Bounds(max_shards=4)).decide(hot) == []
    # Together above merge_below of one budget: no merge.
    big = [snap(float(t), (3000, 200_000, 1.0), (2000, 150_000, 1.0)) for t in range(1, 4)]
    assert EstuaryPolicy(SPEC, Bounds(max_shards=4)).decide(big) == []


def test_a_merge_right_after_a_split_is_dropped_by_the_hysteresis() -> None:
    hold = Hysteresis(2)
    split = EstuaryPolicy(SPEC, Bounds(max_shards=2)).decide(growing(1))[0]
    assert hold.allow(split, 5)
    steady = [snap(float(t), (1000, 100_000, 5.0), (900, 90_000, 1.0)) for t in range(6, 9)]
    merge = EstuaryPolicy(SPEC, Bounds(max_shards=2)).decide(steady)[0]
    assert merge.knob == "ps_shards" and merge.direction == -1
    assert not hold.allow(merge, 7)
    assert hold.allow(merge, 8)


def test_shards_may_change_only_with_a_budget_and_a_max_on_either_plane(tmp_path: Any) -> None:
    from estuary.config import load_job
    from estuary.runtime.ray.scaling import elastic_shards, spare_shard_cpus

    from ..distributed.conftest import write_job

    path = write_job(tmp_path)
    on = [
        "runtime.backend=ray",
        "runtime.roles.ps.max=3",
        "runtime.ray.ps.memory_mb=64",
        "runtime.ray.ps.cpus=0.5",
        "runtime.scaling.enabled=true",
    ]
    job = load_job(path, on)
    assert elastic_shards(job) and spare_shard_cpus(job) == 1.0  # 2 more shards x 0.5
    actor = load_job(path, [*on, "runtime.ray.data_plane=actor"])
    assert elastic_shards(actor) and spare_shard_cpus(actor) == 1.0
    for off in ("runtime.roles.ps.max=1", "runtime.scaling.enabled=false"):
        job = load_job(path, [*on, off])
        assert not elastic_shards(job) and spare_shard_cpus(job) == 0.0, off


def test_a_shard_range_the_manager_cannot_use_fails_at_load(tmp_path: Any) -> None:
    """With the scaling manager on, a PS range (max above min) without a PS
    memory budget is an error at load naming ``runtime.roles.ps.max`` and what
    is missing, not a range silently kept at its count (on either data plane);
    without the manager, the same range loads (renderers read it)."""
    import pytest

    from estuary.config import ConfigError, load_job

    from ..distributed.conftest import write_job

    path = write_job(tmp_path)
    on = ["runtime.backend=ray", "runtime.roles.ps.max=3", "runtime.scaling.enabled=true"]
    with pytest.raises(ConfigError, match=r"runtime\.roles\.ps\.max.*roles\.ps\.memory_mb"):
        load_job(path, on)
    with pytest.raises(ConfigError, match=r"runtime\.roles\.ps\.max.*roles\.ps\.memory_mb"):
        load_job(path, [*on, "runtime.ray.data_plane=actor"])
    actor = load_job(path, [*on, "runtime.ray.ps.memory_mb=64", "runtime.ray.data_plane=actor"])
    assert actor.runtime.ray.data_plane == "actor"
    assert load_job(path, [*on, "runtime.ray.ps.memory_mb=64"]).runtime.scaling.enabled
    assert (
        load_job(path, [*on[:2], "runtime.scaling.enabled=false"]).runtime.ray.ps.memory_mb is None
    )


def test_a_job_built_in_code_with_an_unusable_range_keeps_its_shards(tmp_path: Any) -> None:
    """A job built in code skips load's validation: the same rule
    (``RuntimeSpec.shard_range_needs``) keeps ``elastic_shards`` off and names
    what is missing: a PS memory budget (the data plane does not matter)."""
    from dataclasses import replace

    from estuary.config import load_job
    from estuary.runtime.ray.scaling import elastic_shards, spare_shard_cpus

    from ..distributed.conftest import write_job

    on = ["runtime.backend=ray", "runtime.roles.ps.max=3", "runtime.ray.ps.memory_mb=64"]
    job = load_job(write_job(tmp_path), [*on, "runtime.scaling.enabled=true"])
    assert job.runtime.shard_range_needs() is None and elastic_shards(job)

    def built(**ray: Any) -> Any:
        return replace(job, runtime=replace(job.runtime, ray=replace(job.runtime.ray, **ray)))

    no_budget = built(ps=replace(job.runtime.ray.ps, memory_mb=None))
    assert "runtime.roles.ps.memory_mb" in (no_budget.runtime.shard_range_needs() or "")
    assert not elastic_shards(no_budget) and spare_shard_cpus(no_budget) == 0.0
    actor = built(data_plane="actor")
    assert actor.runtime.shard_range_needs() is None and elastic_shards(actor)
    neither = built(ps=replace(job.runtime.ray.ps, memory_mb=None), data_plane="actor")
    assert "runtime.roles.ps.memory_mb" in (neither.runtime.shard_range_needs() or "")
    assert not elastic_shards(neither)


def test_the_manager_warns_of_an_unusable_range_even_when_it_does_not_run(
    tmp_path: Any, caplog: Any
) -> None:
    """A job built in code with a range but no PS memory budget on one shard
    starts no manager, and the log still says the range is kept and why."""
    import logging
    from dataclasses import replace

    from estuary.config import load_job
    from estuary.runtime.ray.scaling import ps_scaling_manager

    from ..distributed.conftest import write_job

    on = ["runtime.backend=ray", "runtime.roles.ps.max=3", "runtime.ray.ps.memory_mb=64"]
    job = load_job(write_job(tmp_path), [*on, "runtime.scaling.enabled=true"])
    ray = replace(job.runtime.ray, ps=replace(job.runtime.ray.ps, memory_mb=None))
    built = replace(job, runtime=replace(job.runtime, ray=ray))
    with caplog.at_level(logging.WARNING, logger="estuary.runtime.ray.scaling"):
        assert ps_scaling_manager(built, [object()]) is None
    assert "(runtime.roles.ps.memory_mb); the job keeps its 1 shard(s)" in caplog.text
    caplog.clear()
    off = replace(
        built, runtime=replace(built.runtime, scaling=replace(built.runtime.scaling, enabled=False))
    )
    assert ps_scaling_manager(off, [object()]) is None and not caplog.text
