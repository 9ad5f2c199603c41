"""The scaling policies are pure: snapshots in, decisions out."""

from __future__ import annotations

import pytest

from estuary.config import job_from_dict
from estuary.config.errors import ConfigError
from estuary.config.scaling import ScalingSpec
from estuary.runtime.scaling import (
    Bounds,
    Decision,
    DLRoverRules,
    EstuaryPolicy,
    ExecutorMemory,
    Hysteresis,
    ShardMetrics,
    Snapshot,
    reversed_actions,
)

DATA = {"sources": [{"path": "x.tsv"}], "schema": {"sparse": ["C1"], "dense": ["I1"]}}
SPEC = ScalingSpec(enabled=True)
BOUNDS = Bounds(min_executors=1, max_executors=8, max_threads=2)


def snap(
    t: float, executors: int, wait: float | None, busy: float, rows: float, **kw: object
) -> Snapshot:
    return Snapshot(t, executors, wait, busy, 0, rows, **kw)  # type: ignore[arg-type]


def test_a_starved_trainer_gets_the_executors_its_demand_needs_in_one_move() -> None:
    # 1 executor, always busy, delivers 100 rows/s; the trainer waits 80% of the
    # time, so it would take 500 rows/s: 5 executors, x1.15 headroom -> 6.
    history = [snap(5, 1, 0.8, 1.0, 100.0), snap(10, 1, 0.8, 1.0, 100.0)]
    (d,) = EstuaryPolicy(SPEC, BOUNDS).decide(history)
    assert (d.knob, d.old, d.new) == ("executors", 1, 6)
    assert d.metrics["trainer_wait"] == 0.8


def test_no_decision_on_an_interval_that_held_a_change() -> None:
    history = [snap(5, 1, 0.8, 1.0, 100.0), snap(10, 6, 0.8, 1.0, 100.0)]
    assert EstuaryPolicy(SPEC, BOUNDS).decide(history) == []


def test_idle_executors_shrink_and_a_busy_fed_job_is_left_alone() -> None:
    idle = [snap(5, 8, 0.01, 0.3, 400.0), snap(10, 8, 0.01, 0.3, 400.0)]
    (d,) = EstuaryPolicy(SPEC, BOUNDS).decide(idle)
    assert (d.knob, d.old, d.new) == ("executors", 8, 3)  # ceil(1.15 x 8 x 0.3)
    fed = [snap(5, 4, 0.01, 0.9, 400.0), snap(10, 4, 0.01, 0.9, 400.0)]
    assert EstuaryPolicy(SPEC, BOUNDS).decide(fed) == []


def test_at_max_executors_the_policy_scales_threads() -> None:
    history = [snap(5, 8, 0.5, 1.0, 100.0), snap(10, 8, 0.5, 1.0, 100.0)]
    (d,) = EstuaryPolicy(SPEC, BOUNDS).decide(history)
    assert (d.knob, d.old, d.new) == ("executor_threads", 1, 2)


def test_a_latency_bound_source_gets_more_reads_per_executor_not_more_processes() -> None:
    # Reads cost 0.01 CPU-s per second (they wait on the source): one process
    # holds all 6 reads the demand needs (Little's law, as above), none started.
    bounds = Bounds(1, 8, max_threads=8, max_reads=8)
    history = [snap(t, 1, 0.8, 1.0, 100.0, executor_cpu=0.01) for t in (5, 10)]
    (d,) = EstuaryPolicy(SPEC, bounds).decide(history)
    assert (d.knob, d.old, d.new) == ("executor_threads", 1, 6)
    assert (d.metrics["reads_needed"], d.metrics["executor_cpu"]) == (6, 0.01)


def test_a_cpu_bound_source_gets_more_executors() -> None:
    bounds = Bounds(1, 8, max_threads=8, max_reads=8)
    history = [snap(t, 1, 0.8, 1.0, 100.0, executor_cpu=0.6) for t in (5, 10)]
    (d,) = EstuaryPolicy(SPEC, bounds).decide(history)
    assert (d.knob, d.old, d.new) == ("executors", 1, 6)


def test_reads_past_one_process_cpu_spread_over_executors_in_one_move() -> None:
    # 0.2 CPU-s per read-second: 2 reads per process (0.5 of a core), 3 executors.
    bounds = Bounds(1, 8, max_threads=8, max_reads=8)
    history = [snap(t, 1, 0.8, 1.0, 100.0, executor_cpu=0.2) for t in (5, 10)]
    moves = EstuaryPolicy(SPEC, bounds).decide(history)
    assert [(d.knob, d.old, d.new) for d in moves] == [
        ("executor_threads", 1, 2),  # first: the executors added open at 2 reads
        ("executors", 1, 3),
    ]


def test_reads_in_flight_stop_at_the_driver_readers() -> None:
    history = [snap(t, 1, 0.8, 1.0, 100.0, executor_cpu=0.01) for t in (5, 10)]
    (d,) = EstuaryPolicy(SPEC, Bounds(1, 8, max_threads=8, max_reads=4)).decide(history)
    assert (d.knob, d.new) == ("executor_threads", 4)
    full = [snap(t, 1, 0.8, 1.0, 100.0, executor_cpu=0.01, executor_threads=4) for t in (5, 10)]
    assert EstuaryPolicy(SPEC, Bounds(1, 8, max_threads=8, max_reads=4)).decide(full) == []
    at_max = [snap(t, 8, 0.8, 1.0, 100.0) for t in (5, 10)]  # no doubling past the readers
    assert EstuaryPolicy(SPEC, Bounds(1, 8, max_threads=8, max_reads=8)).decide(at_max) == []


def test_a_scale_up_never_lowers_the_reads_per_executor() -> None:
    # 4 reads per executor, now CPU-heavier (cap 1): more executors, reads kept.
    bounds = Bounds(1, 8, max_threads=8, max_reads=32)
    kw = {"executor_cpu": 0.4, "executor_threads": 4}
    history = [snap(t, 1, 0.5, 1.0, 100.0, **kw) for t in (5, 10)]  # type: ignore[arg-type]
    (d,) = EstuaryPolicy(SPEC, bounds).decide(history)
    assert (d.knob, d.old, d.new) == ("executors", 1, 3)  # ceil(ceil(1.15 x 8) / 4)


def test_idle_reads_of_one_executor_are_lowered_then_executors_retired_first() -> None:
    bounds = Bounds(1, 8, max_threads=8)
    one = [snap(t, 1, 0.01, 0.3, 400.0, executor_threads=8) for t in (5, 10)]
    (d,) = EstuaryPolicy(SPEC, bounds).decide(one)
    assert (d.knob, d.old, d.new) == ("executor_threads", 8, 3)  # ceil(1.15 x 8 x 0.3)
    two = [snap(t, 2, 0.01, 0.3, 400.0, executor_threads=4) for t in (5, 10)]
    (d,) = EstuaryPolicy(SPEC, bounds).decide(two)
    assert (d.knob, d.old, d.new) == ("executors", 2, 1)


MB = 2**20


def test_an_executor_over_its_memory_target_reads_fewer_splits_at_once() -> None:
    # base 100 MB + 4 reads x 50 MB = 300 MB against a 300 MB budget (target 240):
    # 2 reads fit (200 MB), so 4 -> 2, and the throughput rule waits its turn.
    memory = ExecutorMemory(100 * MB, 300 * MB, 300 * MB)
    starved = {"executor_threads": 4, "executor_memory": memory}
    history = [snap(5, 8, 0.5, 1.0, 100.0, **starved), snap(10, 8, 0.5, 1.0, 100.0, **starved)]
    (d,) = EstuaryPolicy(SPEC, Bounds(1, 8, 8)).decide(history)
    assert (d.knob, d.old, d.new) == ("executor_threads", 4, 2)
    assert d.metrics["executor_peak_bytes"] == 300 * MB


def test_threads_are_raised_only_as_far_as_the_memory_budget_holds() -> None:
    # At max executors and starved: 1 -> 2 threads wanted, but one more read
    # (80 MB over a 100 MB base) would pass 0.8 x 200 MB.
    tight = ExecutorMemory(100 * MB, 180 * MB, 200 * MB)
    history = [snap(t, 8, 0.5, 1.0, 100.0, executor_memory=tight) for t in (5, 10)]
    assert EstuaryPolicy(SPEC, BOUNDS).decide(history) == []
    roomy = ExecutorMemory(100 * MB, 130 * MB, 400 * MB)
    history = [snap(t, 8, 0.5, 1.0, 100.0, executor_memory=roomy) for t in (5, 10)]
    (d,) = EstuaryPolicy(SPEC, BOUNDS).decide(history)
    assert (d.knob, d.new) == ("executor_threads", 2)


def test_at_one_read_the_memory_ask_is_raised_to_its_maximum_at_most() -> None:
    over = ExecutorMemory(100 * MB, 180 * MB, 200 * MB)  # 0.9 of the budget
    history = [snap(t, 2, 0.01, 0.9, 400.0, executor_memory=over) for t in (5, 10)]
    assert EstuaryPolicy(SPEC, BOUNDS).decide(history) == []  # no maximum: nothing to raise
    raising = ScalingSpec(enabled=True, max_executor_memory_mb=1024)
    (d,) = EstuaryPolicy(raising, BOUNDS).decide(history)
    assert (d.knob, d.old, d.new) == ("executor_memory", 200, 300)  # 1.5 x the ask
    capped = ScalingSpec(enabled=True, max_executor_memory_mb=210)
    (d,) = EstuaryPolicy(capped, BOUNDS).decide(history)
    assert d.new == 210
    far_over = ExecutorMemory(100 * MB, 400 * MB, 200 * MB)
    history = [snap(t, 2, 0.01, 0.9, 400.0, executor_memory=far_over) for t in (5, 10)]
    (d,) = EstuaryPolicy(raising, BOUNDS).decide(history)
    assert d.new == 500  # the peak at 0.8 of it: ceil(400 / 0.8)
    unbudgeted = ExecutorMemory(100 * MB, 180 * MB, None)
    history = [snap(t, 2, 0.01, 0.9, 400.0, executor_memory=unbudgeted) for t in (5, 10)]
    assert EstuaryPolicy(raising, BOUNDS).decide(history) == []


LOWERING = ScalingSpec(enabled=True, max_executor_memory_mb=1024, hold_intervals=2)
FLOORED = Bounds(min_executors=1, max_executors=8, max_threads=2, min_executor_memory_mb=100)


def quiet(t: float, peak_mb: int, budget_mb: int, starting: int = 0) -> Snapshot:
    """A fed job (no executor resize due) whose executors peak at ``peak_mb``."""
    memory = ExecutorMemory(50 * MB, peak_mb * MB, budget_mb * MB)
    return snap(t, 2, 0.01, 0.9, 400.0, executor_memory=memory, executors_starting=starting)


def test_a_raised_memory_ask_is_lowered_after_a_quiet_stretch() -> None:
    # Ask raised to 600 MB; the peak stays at 120 MB (< 0.4 x 600) for
    # hold_intervals + 1 = 3 intervals: lowered to put it at 0.75 x 0.8 = 0.6.
    policy = EstuaryPolicy(LOWERING, FLOORED)
    history = [quiet(t, 120, 600) for t in (5, 10)]
    assert policy.decide(history) == []  # 2 quiet intervals: not yet
    history.append(quiet(15, 110, 600))
    (d,) = policy.decide(history)
    assert (d.knob, d.old, d.new) == ("executor_memory", 600, 200)  # ceil(120 / 0.6)
    assert d.trigger == "executor memory peak below 0.4 of its budget for 3 intervals"
    assert d.metrics["executor_peak_bytes"] == 120 * MB
    # One interval of the stretch above 0.4 of the ask (240 MB): no quiet stretch.
    assert policy.decide([*history[:-1], quiet(15, 250, 600)]) == []
    # An executor starting in the stretch (a swap in progress): not measured whole.
    assert policy.decide([*history[:-1], quiet(15, 110, 600, starting=1)]) == []
    # Without a configured ask (no floor) the ask is never lowered.
    assert EstuaryPolicy(LOWERING, BOUNDS).decide(history) == []


def test_a_memory_ask_is_never_lowered_below_the_configured_one() -> None:
    policy = EstuaryPolicy(LOWERING, FLOORED)
    tiny = [quiet(t, 10, 300) for t in (5, 10, 15)]
    (d,) = policy.decide(tiny)
    assert (d.old, d.new) == (300, 100)  # ceil(10 / 0.6) = 17 MB, floored at 100
    at_floor = [quiet(t, 10, 100) for t in (5, 10, 15)]
    assert policy.decide(at_floor) == []


def test_no_lowering_right_after_a_raise() -> None:
    # Raised 200 -> 300 at interval 1; the next intervals run at 300 MB. The
    # peak fell (a split of small rows) but the stretch at the new ask is only
    # as long as the hold at interval 3: nothing; at interval 4 it may lower.
    policy = EstuaryPolicy(LOWERING, FLOORED)
    history = [quiet(5, 180, 200), quiet(10, 180, 200)]  # 0.9 of the ask
    (raise_,) = policy.decide(history)
    assert (raise_.old, raise_.new) == (200, 300)
    history += [quiet(15, 100, 300, starting=2), quiet(20, 100, 300), quiet(25, 100, 300)]
    assert policy.decide(history) == []  # the swap's interval is not quiet
    history.append(quiet(30, 100, 300))
    (d,) = policy.decide(history)
    assert (d.old, d.new) == (300, 167)


def test_executor_memory_never_flaps_under_the_controller() -> None:
    """Executors whose peak is steady, or wanders within a band, get at most
    one raise and one lowering; neither is ever undone within the hold, and a
    lowered ask is never raised again by the same peaks."""

    def run(peaks_mb: list[int]) -> list[tuple[float, float]]:
        policy, hold = EstuaryPolicy(LOWERING, FLOORED), Hysteresis(LOWERING.hold_intervals)
        budget, history, moves = 100, [], []
        for i, peak in enumerate(peaks_mb):
            history.append(quiet(5.0 * (i + 1), peak, budget))
            for d in policy.decide(history):
                if d.knob == "executor_memory" and hold.allow(d, i):
                    moves.append((d.old, d.new))
                    budget = int(d.new)
        return moves

    # 90 MB: over 0.8 x 100, raised once to 150 (1.5x); 0.6 of it: stays.
    assert run([90] * 40) == [(100, 150)]
    # A one-off spike to 400 MB, then 90 MB: raised to 500, lowered once to 150
    # (90 / 0.6), then left alone.
    moves = run([400] + [90] * 40)
    assert moves == [(100, 500), (500, 150)]
    # Peaks wandering between 80 and 110 MB after the raise: no move back.
    assert run([90] + [80, 110, 95, 85] * 10) == [(100, 150)]


def test_a_hot_shard_is_reported() -> None:
    shards = tuple(ShardMetrics(p, load, 10, 100) for p, load in enumerate([10.0, 10.0, 100.0]))
    history = [snap(5, 2, 0.0, 0.8, 10.0, shards=shards)]
    decisions = EstuaryPolicy(SPEC, BOUNDS).decide(history)
    assert [d.knob for d in decisions] == ["hot_shard:2"]


def test_hysteresis_refuses_a_reversal_within_the_hold() -> None:
    h = Hysteresis(2)
    assert h.allow(Decision("executors", 1, 6, "up"), 3)
    assert not h.allow(Decision("executors", 6, 3, "down"), 5)
    assert h.allow(Decision("executors", 6, 3, "down"), 6)
    rows = [
        {"interval": 3, "knob": "executors", "old": 1, "new": 6, "applied": True},
        {"interval": 4, "knob": "executors", "old": 6, "new": 3, "applied": True},
    ]
    assert reversed_actions(rows, 2) == 1


def test_dlrover_rules_grow_by_ps_cpu_headroom_at_most_twice_and_double_memory_on_oom() -> None:
    rules = DLRoverRules(BOUNDS)
    over = (ShardMetrics(0, 1.0, 10, 200, budget_bytes=100),)
    history = [snap(5, 2, 0.9, 1.0, 100.0, cpu={"ps": 0.1}, shards=over)]
    grow, oom = rules.decide(history)
    assert (grow.knob, grow.new) == ("executors", 4)
    assert (oom.knob, oom.new) == ("shard_memory:0", 200)
    assert rules.decide([snap(5, 2, 0.9, 1.0, 100.0, cpu={"ps": 0.7})])[0].new == 3


@pytest.mark.parametrize(
    ("key", "value", "path"),
    [
        ("interval_s", 0, "runtime.scaling.interval_s"),
        ("wait_high", 1.5, "runtime.scaling.wait_high"),
        ("hot_ratio", 1.0, "runtime.scaling.hot_ratio"),
        ("bridge_reads", -1, "runtime.scaling.bridge_reads"),
        ("compact_below", 1.5, "runtime.scaling.compact_below"),
        ("bogus", 1, "runtime.scaling.bogus"),
    ],
)
def test_scaling_config_errors_name_the_field(key: str, value: object, path: str) -> None:
    raw = {"data": DATA, "runtime": {"backend": "ray", "scaling": {"enabled": True, key: value}}}
    with pytest.raises(ConfigError) as err:
        job_from_dict(raw)
    assert path in str(err.value)


def test_compact_below_reaches_every_ps_server_and_defaults_to_the_shards() -> None:
    from estuary.embedding.compaction import COMPACT_BELOW
    from estuary.runtime.launcher import ps_server_config
    from estuary.train.plan import TrainPlan

    assert job_from_dict({"data": DATA}).runtime.scaling.compact_below == COMPACT_BELOW
    raw = {"data": DATA, "runtime": {"backend": "ray", "scaling": {"compact_below": 0.5}}}
    job = job_from_dict(raw)
    config = ps_server_config(job, TrainPlan.from_job(job), 2, 2, 30.0)
    assert config.compact_below == 0.5 and config.world_size == 2


def test_scaling_needs_the_ray_runtime() -> None:
    with pytest.raises(ConfigError) as err:
        job_from_dict({"data": DATA, "runtime": {"scaling": {"enabled": True}}})
    assert "runtime.scaling.enabled" in str(err.value) and "ray" in str(err.value)
