from __future__ import annotations

import itertools
import os
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from estuary.config import load_job
from estuary.plan.calibration import calibrate
from estuary.plan.costs import Costs, load_costs, save_costs

from .conftest import simple_costs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "criteo.yaml"
# The first 10,000 lines of the DAC training data: the example's model and
# tables on a third of its sample's rows (the timed fits and loads shrink with
# the rows; the multi-process probes time fixed step counts either way).
HEAD_10K = EXAMPLE.parents[2] / "shared" / "data" / "criteo_dac_head10k.txt.gz"


@pytest.mark.slow
def test_calibration_of_the_real_code_round_trips(tmp_path: Path) -> None:
    """One repeat of every timed run on the Criteo example's job over 10,000 rows
    (under a minute): every figure is positive where the code does work, the file reads
    back equal, and the job's run folder is left alone."""
    out = tmp_path / "run"
    overrides = ["train.batch_size=512", f"output.dir={out}", f"data.sources[0].path={HEAD_10K}"]
    job = load_job(EXAMPLE, overrides)
    others: dict[str, Costs] = {}
    costs = calibrate(job, repeats=1, others=others)
    assert not out.exists()  # its fits write nothing into the job's run folder
    assert costs.sparse_features == 26 and costs.embedding_dim == 16
    for name in ("parse_s_per_row", "dense_s_per_row", "bytes_per_row", "net_bytes_per_s"):
        assert getattr(costs, name) > 0, name
    assert costs.lookup_s_per_id + costs.lookup_s_per_call > 0
    assert costs.collection_s_per_row > 0
    assert 0 < costs.chain_utilisation <= 1
    assert 0 < costs.unique_exp <= 1
    assert costs.machine["distinct_ids"] > 1000
    path = tmp_path / "costs.json"
    save_costs(costs, path)
    assert load_costs(path) == costs
    # One round: its least is its median, so the variant is the same calibration.
    assert others["least_rounds"] == costs


def test_probes_time_the_runs_steady_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PS request probes warm up over at least one pass of the batches they
    cycle, so no timed step inserts an id the server has not seen (the real
    runs' figure starts after their first epoch); the dense probes keep theirs.
    The all-reduce is timed at the runs' batch size, the PS client between dense
    steps (their CPU taken off). Each figure comes from interleaved rounds at
    two request sizes, fitted (one round reading 3x slow moves nothing); the
    all-reduce is the median of its rounds' differences. The probes are
    stand-ins here: nothing is timed."""
    from estuary.config.tables import TableSpec
    from estuary.plan import calibration, probes

    seen: dict[str, list[int]] = {
        "ps": [],
        "dense": [],
        "dense_rows": [],
        "ids": [],
        "layouts": [],
    }

    def fake_ps(
        tables: Any, streams: list[Any], features: Any, trainers: int, shards: int, **kw: int
    ) -> list[list[probes.LayoutTiming]]:
        steps, warmup, rounds = kw["steps"], kw["warmup"], kw["rounds"]
        assert all(len(s) == 40 for s in streams) and kw["compute_s"] == 0.005
        seen["ps"].append(warmup)
        seen["layouts"].append(trainers * 10 + shards)
        sizes = [float(np.mean([sum(a.size for a in b) for b in s])) for s in streams]
        if trainers == 1:  # the request probes (the chain probe takes the full stream)
            seen["ids"] = [int(n) for n in sizes]
        out = []
        for r in range(rounds):
            # The client's CPU includes the stand-in dense step's 5 ms; the
            # server's is 1 ms a request (2 a step) + 10 us an id; round 0 is
            # a hiccup, 3x slow.
            slow = 3.0 if r == 0 else 1.0
            out.append(
                [
                    probes.LayoutTiming(
                        trainers,
                        shards,
                        0.01,
                        0.005 + slow * (0.0004 + 1e-6 * n),
                        slow * (0.002 + 1e-5 * n),
                        steps,
                    )
                    for n in sizes
                ]
            )
        return out

    added = iter([0.004, 0.002, 0.0021])  # the rounds' DDP cost: one slow round

    def fake_dense(job: Any, trainers: int, batch_rows: int, **kw: int) -> probes.LayoutTiming:
        seen["dense"].append(kw["warmup"])
        seen["dense_rows"].append(batch_rows)
        cpu = 0.01 + (next(added) if trainers == 2 else 0.0)
        return probes.LayoutTiming(trainers, 0, 0.01, cpu, 0.0, kw["steps"])

    class Job:
        def table_spec(self, name: str) -> TableSpec:
            return TableSpec(dim=4)

    monkeypatch.setattr(probes, "ps_layout_rounds", fake_ps)
    monkeypatch.setattr(probes, "dense_layout", fake_dense)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    rng = np.random.default_rng(0)
    unique = [{"a": np.unique(rng.integers(0, 99, 20))} for _ in range(40)]
    got = calibration._layout_costs(
        Job(), unique, 512, steps=3, warmup=10, rounds=3, compute_s=0.005, ps_rounds=3
    )
    assert seen["ps"] == [40, 40, 40]  # 1x1 and 1x2, each every stream; the 2x2 chain
    assert seen["layouts"] == [11, 12, 22]
    assert len(seen["ids"]) == 2 and seen["ids"][-1] == 1  # full, one id a table
    assert seen["dense"] == [10] * 9  # 1, 2 and 3 (the cores + 1) processes a round
    assert seen["dense_rows"] == [512] * 9  # DDP's cost at the runs' batch size
    assert got["ps_s_per_request"] == pytest.approx(0.001)
    assert got["ps_s_per_id"] == pytest.approx(1e-5)
    assert got["allreduce_s_per_step"] == pytest.approx(0.0021)
    assert calibration._ps_warmup(50, 40) == 50
    # The client's requests are timed between dense steps; that step's CPU is not theirs.
    assert got["rpc_s_per_request"] == pytest.approx(0.0002)


@pytest.mark.parametrize("cores", [1, 2, 4, 16])
def test_the_ddp_groups_wall_over_their_cpu(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    """``ddp_stretch``: the 2-process DDP group's wall per step over its CPU;
    ``ddp_stretch_oversubscribed``: a group of cores + 1 processes' wall over the
    2-process CPU shared perfectly over the cores; each the median of the rounds
    (one round's hiccup moves neither) and never below 1. The group of cores + 1
    is timed only on 2-8 cores; on one core the 2-process group is itself
    oversubscribed, so neither figure is taken. The probes are stand-ins."""
    from estuary.config.tables import TableSpec
    from estuary.plan import calibration, probes

    groups: list[int] = []
    slow = iter([3.0, 1.0, 1.0])  # the 2-process group's first round: a hiccup

    def fake_ps(
        tables: Any, streams: list[Any], features: Any, trainers: int, shards: int, **kw: int
    ) -> list[list[probes.LayoutTiming]]:
        return [
            [
                probes.LayoutTiming(trainers, shards, 0.02, 0.006, 0.003, kw["steps"])
                for _ in streams
            ]
            for _ in range(kw["rounds"])
        ]

    def fake_dense(job: Any, trainers: int, batch_rows: int, **kw: int) -> probes.LayoutTiming:
        groups.append(trainers)
        if trainers == 1:
            return probes.LayoutTiming(1, 0, 0.010, 0.010, 0.0, kw["steps"])
        if trainers == 2:  # 12 ms of CPU a step, 14.4 ms of wall: 1.2
            return probes.LayoutTiming(2, 0, 0.0144 * next(slow), 0.012, 0.0, kw["steps"])
        # cores + 1 processes: 1.25 x what (cores + 1) / cores x 12 ms would take
        return probes.LayoutTiming(trainers, 0, 1.25 * 0.012 * trainers / cores, 0.013, 0.0, 3)

    class Job:
        def table_spec(self, name: str) -> TableSpec:
            return TableSpec(dim=4)

    monkeypatch.setattr(probes, "ps_layout_rounds", fake_ps)
    monkeypatch.setattr(probes, "dense_layout", fake_dense)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    rng = np.random.default_rng(0)
    unique = [{"a": np.unique(rng.integers(0, 99, 20))} for _ in range(8)]
    got = calibration._layout_costs(Job(), unique, 512, steps=3, warmup=2, rounds=3, ps_rounds=1)
    if cores == 1:
        assert got["ddp_stretch"] == got["ddp_stretch_oversubscribed"] == 1.0
        assert groups == [1, 2] * 3
        return
    assert got["ddp_stretch"] == pytest.approx(1.2)
    if cores <= calibration.OVERSUBSCRIBED_MAX_CORES:
        assert groups == [1, 2, cores + 1] * 3
        assert got["ddp_stretch_oversubscribed"] == pytest.approx(1.25)
    else:
        assert groups == [1, 2] * 3
        assert got["ddp_stretch_oversubscribed"] == 1.0


def test_chain_utilisation_is_the_chains_cpu_over_its_wall_and_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 clients x 2 servers: each window's clients' own CPU (the dense step's
    busy loop taken off) and servers' CPU over the chain's wall (the step less
    the busy loop) over the cores; the median of the rounds, so one round
    reading 3x slow moves nothing. A stand-in probe: nothing is timed."""
    from estuary.plan import calibration, probes

    def fake_ps(
        tables: Any, streams: list[Any], features: Any, trainers: int, shards: int, **kw: Any
    ) -> list[list[probes.LayoutTiming]]:
        assert (trainers, shards) == (2, 2) and len(streams) == 1
        compute = kw["compute_s"]
        out = []
        for r in range(kw["rounds"]):
            slow = 3.0 if r == 0 else 1.0
            # chain 16 ms of wall; clients 4 ms each and servers 16.8 ms of CPU
            t = probes.LayoutTiming(2, 2, compute + 0.016, compute + 0.004 * slow, 0.0168, 30)
            out.append([t])
        return out

    monkeypatch.setattr(probes, "ps_layout_rounds", fake_ps)
    monkeypatch.setattr(calibration.os, "cpu_count", lambda: 2)
    got = calibration._chain_utilisation({}, [[]], [], 30, 10, 3, 0.014)
    assert got == pytest.approx((2 * 0.004 + 0.0168) / 0.016 / 2)  # 0.775
    monkeypatch.setattr(calibration.os, "cpu_count", lambda: 8)  # 4 processes: 4 cores
    assert calibration._chain_utilisation({}, [[]], [], 30, 10, 3, 0.014) == pytest.approx(
        (2 * 0.004 + 0.0168) / 0.016 / 4
    )


def test_epoch_window_marks_where_the_timed_epochs_begin(tmp_path: Path) -> None:
    """A real fit of 3 epochs over 10,000 rows (9,000 trained, the rest held out)
    at 1,000 a step: the window opens when epoch 1 starts, so its mark holds
    exactly the first epoch's steps and the profile minus the mark the last two
    epochs'; it closes when the steps end."""
    from estuary.train import Trainer
    from estuary.train.callbacks import EpochWindow

    overrides = [
        "train.batch_size=1000",
        "train.epochs=3",
        f"output.dir={tmp_path}",
        f"data.sources[0].path={HEAD_10K}",
        "output.checkpoint=false",
        "output.progress=false",
    ]
    window = EpochWindow(1)
    trainer = Trainer(load_job(EXAMPLE, overrides), callbacks=[window])
    window.times = trainer.engine.times
    end = trainer.fit(progress=False).profile
    assert window.start is not None and window.end is not None
    first, last = window.start[2], window.end[2]
    assert first["steps"] == 9 and end["steps"] == 27
    assert 0 < first["lookup_s"] < end["lookup_s"]
    # The window ends with the last step, before the evaluation: the fit's
    # profile is the same (the evaluation adds to no stage), its clock later.
    assert last == end and window.start[0] < window.end[0]


def _fake_trainer_costs(
    monkeypatch: pytest.MonkeyPatch,
    per_step: Any,
    repeats: int,
    two_thread_share: float = 1.5,
    loop_s: float = 0.0,
    end_s: float = 0.0,
) -> dict[str, float]:
    """``calibration._trainer_costs`` over a stand-in trainer: each fit's steps
    cost ``per_step(rows, epoch, fit)`` of wall time (``fit``: the fit's index,
    0-based; the fits run ``repeats`` rounds of the three sizes, then one on two
    threads), 4 steps an epoch. The clocks are the stand-in's own, not the
    machine's (with the real clocks, a process descheduled during the timed
    window scaled every figure): each step moves the wall clock by its cost and
    the CPU clock by a share of it: all of it in the warm-up epoch, half in the
    timed epochs of a one-thread fit (another job holds the core half the
    time), ``two_thread_share`` in the two-thread fit's. ``loop_s``: wall
    time each step spends outside the profiled stages (the loop's own);
    ``end_s``: wall time after the steps end (the real fit's evaluation)."""
    import estuary.train
    from estuary.plan import calibration
    from estuary.train.callbacks import LoopState
    from estuary.train.pipeline import StageTimes

    fits = itertools.count()
    now = {"wall": 0.0, "cpu": 0.0}

    class FakeTrainer:
        def __init__(self, job: Any, *, dataset: Any, callbacks: Any) -> None:
            self.train, self.callbacks = job.train, callbacks
            self.engine = type("E", (), {"times": StageTimes()})()
            self.fit_index = next(fits)

        def fit(self, progress: bool) -> Any:
            times, state = self.engine.times, LoopState()
            for epoch in range(self.train.epochs):
                state.epoch = epoch
                for c in self.callbacks:
                    c.on_epoch_start(state)
                share = (
                    1.0 if epoch == 0 else (0.5 if self.train.threads == 1 else two_thread_share)
                )
                for _ in range(4):  # 4 steps an epoch
                    cost = per_step(self.train.batch_size, epoch, self.fit_index)
                    for k, v in cost.items():
                        setattr(times, k, getattr(times, k) + v)
                    times.steps += 1
                    now["wall"] += sum(cost.values()) + loop_s
                    now["cpu"] += share * (sum(cost.values()) + loop_s)
            for c in self.callbacks:
                c.on_fit_end(state)
            now["wall"] += end_s  # the eval split's evaluation: not a step
            now["cpu"] += end_s
            return type("R", (), {"profile": times.as_dict()})()

    clock = types.SimpleNamespace(perf_counter=lambda: now["wall"], process_time=lambda: now["cpu"])
    monkeypatch.setattr(calibration, "time", clock)
    monkeypatch.setattr(estuary.train.callbacks, "time", clock)
    monkeypatch.setattr(calibration.os, "cpu_count", lambda: 2)  # the two-thread fit runs
    monkeypatch.setattr(estuary.train, "Trainer", FakeTrainer)
    job = load_job(EXAMPLE)
    return calibration._trainer_costs(job, None, 1024, repeats, lambda b: b / 2)


def _step_cost(rows: int, scale: float) -> dict[str, float]:
    n = rows / 2  # unique ids of a step, as `_fake_trainer_costs`'s `unique_ids` says
    return {
        "forward_backward_s": scale * (0.001 + 1e-5 * rows),
        "dense_step_s": 0.0,
        "lookup_s": scale * (0.002 + 1e-6 * n),
        "sparse_submit_s": scale * (0.003 + 2e-6 * n),
    }


def _assert_figures(got: dict[str, float], scale: float) -> None:
    expected = {
        "dense_s_per_step": 0.001,
        "dense_s_per_row": 1e-5,
        "lookup_s_per_step": 0.002,
        "lookup_s_per_id": 1e-6,
        "update_s_per_step": 0.003,
        "update_s_per_id": 2e-6,
    }
    for key, value in expected.items():
        # `StageTimes.as_dict` rounds each total to 0.1 ms: up to ~2% of a per-id slope here
        assert got[key] == pytest.approx(scale * value, rel=0.02), key


def test_the_training_loop_figures_leave_the_warm_up_epoch_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The training loop's figures come from the epochs after the first only: a
    stand-in trainer whose first epoch costs 10x a step (the real first epoch
    counts admission sightings and inserts ids) yields the later epochs' per-step
    and per-id figures, not a blend; they are CPU seconds: the profile's wall
    seconds times the process's CPU share over those epochs (half here; all of
    the warm-up's, so a share taken over the whole fit reads more)."""

    def per_step(rows: int, epoch: int, fit: int) -> dict[str, float]:
        return _step_cost(rows, 10.0 if epoch == 0 else 1.0)

    _assert_figures(_fake_trainer_costs(monkeypatch, per_step, repeats=1), 0.5)


def test_the_training_loop_figures_are_the_median_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three rounds of the three sizes cost 2x, 4x and 1x: the figures are the
    median round's (2x; the runs they predict are read as the median of
    theirs), not the least (1x) nor the mean (2.33x)."""

    def per_step(rows: int, epoch: int, fit: int) -> dict[str, float]:
        return _step_cost(rows, (2.0, 4.0, 1.0)[fit // 3] if fit < 9 else 1.0)

    _assert_figures(_fake_trainer_costs(monkeypatch, per_step, repeats=3), 0.5 * 2.0)


def test_the_training_loop_figures_also_come_from_the_least_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same three rounds (2x, 4x, 1x) give, under ``LEAST_ROUNDS``, the
    figures of the least round (1x): what ``calibrate(others=...)`` hands
    bench/simulate.py to judge beside the median on the same runs."""
    from estuary.plan.calibration import LEAST_ROUNDS

    def per_step(rows: int, epoch: int, fit: int) -> dict[str, float]:
        return _step_cost(rows, (2.0, 4.0, 1.0)[fit // 3] if fit < 9 else 1.0)

    got = _fake_trainer_costs(monkeypatch, per_step, repeats=3)
    least = {k[len(LEAST_ROUNDS) :]: v for k, v in got.items() if k.startswith(LEAST_ROUNDS)}
    _assert_figures(least, 0.5 * 1.0)


def test_the_two_thread_speed_up_is_one_threads_cpu_over_two_threads_wall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dense_speedup_2``: the median one-thread round's dense CPU per step
    over the two-thread fit's dense wall time per step (its CPU share, 1.5 of a
    core here, is not applied: that would read the two threads' CPU, never less
    than one thread's, so every speed-up would read 1). The two-thread fit's
    dense step takes 1 / 1.6 of the median round's CPU: 1.6 (the least round
    would give 0.8, clipped to 1; the mean 1.87); clipped to [1, 2]."""

    def per_step(rows: int, epoch: int, fit: int) -> dict[str, float]:
        if fit < 9:  # the one-thread rounds: CPU per step 1x (the median), 2x, 0.5x
            return _step_cost(rows, (2.0, 4.0, 1.0)[fit // 3])
        return _step_cost(rows, 1.0 / 1.6)  # the two-thread fit's wall per step

    got = _fake_trainer_costs(monkeypatch, per_step, repeats=3)
    assert got["dense_speedup_2"] == pytest.approx(1.6, rel=0.01)

    def faster(rows: int, epoch: int, fit: int) -> dict[str, float]:
        return _step_cost(rows, 1.0 if fit < 9 else 0.1)

    assert _fake_trainer_costs(monkeypatch, faster, repeats=3)["dense_speedup_2"] == 2.0


def test_the_loops_own_time_counts_with_the_dense_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step's wall time outside the profiled stages (the loop's batches,
    callbacks and bookkeeping) is the trainer's serial work: it lands in the
    dense per-step figure, CPU seconds like the rest, and leaves the table
    figures alone. What the fit does after its last step (0.5 s here: the real
    fit evaluates the eval split) is in no figure."""

    def per_step(rows: int, epoch: int, fit: int) -> dict[str, float]:
        return _step_cost(rows, 1.0)

    got = _fake_trainer_costs(monkeypatch, per_step, repeats=1, loop_s=0.004, end_s=0.5)
    assert got["dense_s_per_step"] == pytest.approx(0.5 * (0.001 + 0.004), rel=0.02)
    assert got["dense_s_per_row"] == pytest.approx(0.5 * 1e-5, rel=0.02)
    assert got["lookup_s_per_step"] == pytest.approx(0.5 * 0.002, rel=0.02)
    assert got["update_s_per_id"] == pytest.approx(0.5 * 2e-6, rel=0.02)


def test_the_two_thread_speed_up_counts_the_loops_own_time_on_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dense_speedup_2`` compares the same sum on one thread and on two: the
    dense stages plus the loop's own time (1 ms a step, not sped up). One
    thread: 0.5 x (d + 1 ms) of CPU a step; two: d x 0.5 / 1.6 + 1 ms of wall
    (d: the stand-in's dense step at 1024 rows), so 1.356, not 1.742 (the loop's
    time on one side only) nor 1.245 (on the other only)."""

    def per_step(rows: int, epoch: int, fit: int) -> dict[str, float]:
        return _step_cost(rows, 1.0 if fit < 9 else 0.5 / 1.6)

    got = _fake_trainer_costs(monkeypatch, per_step, repeats=3, loop_s=0.001)
    d = 0.001 + 1e-5 * 1024
    assert got["dense_speedup_2"] == pytest.approx(
        0.5 * (d + 0.001) / (d * 0.5 / 1.6 + 0.001), rel=0.02
    )


def test_the_least_rounds_variant_takes_only_the_least_figures() -> None:
    """``calibrate(others=...)['least_rounds']``: the training loop's figures
    from ``_trainer_costs``' ``LEAST_ROUNDS`` entries (a per-step lookup or
    update over the features: a per-call figure) and the collection's least
    pass; every other figure, the speed-up included, is the calibration's own."""
    from dataclasses import replace

    from estuary.plan.calibration import LEAST_ROUNDS, _least_rounds

    costs = replace(simple_costs(), sparse_features=4)
    loop = {
        "dense_s_per_row": 9.0,  # the median figures: not taken
        "dense_speedup_2": 1.7,
        LEAST_ROUNDS + "dense_s_per_row": 1e-6,
        LEAST_ROUNDS + "dense_s_per_step": 2e-4,
        LEAST_ROUNDS + "lookup_s_per_id": 3e-8,
        LEAST_ROUNDS + "lookup_s_per_step": 4e-4,
        LEAST_ROUNDS + "update_s_per_id": 5e-8,
        LEAST_ROUNDS + "update_s_per_step": 8e-4,
    }
    got = _least_rounds(costs, loop, collection_least=7e-7)
    assert got == replace(
        costs,
        dense_s_per_row=1e-6,
        dense_s_per_step=2e-4,
        lookup_s_per_id=3e-8,
        lookup_s_per_call=1e-4,
        update_s_per_id=5e-8,
        update_s_per_call=2e-4,
        collection_s_per_row=7e-7,
    )


def test_the_collection_figure_is_the_median_pass_and_the_least_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_collection_costs`` returns (median, least) of its timed passes: three
    passes of 3, 1 and 2 s of CPU over the data's rows give 2 s and 1 s a pass."""
    import types

    from estuary.data import TabularDataset
    from estuary.plan import calibration
    from estuary.train.plan import shared_names

    job = load_job(EXAMPLE, [f"data.sources[0].path={HEAD_10K}", "train.batch_size=4096"])
    dataset = TabularDataset(job.data, job.base_dir, hash_names=shared_names(job), threads=1)
    rows = sum(int(b.labels.shape[0]) for b in dataset.batches("all", 4096))
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # (start, end) of each timed pass
    clock = types.SimpleNamespace(process_time=lambda: next(ticks))
    monkeypatch.setattr(calibration, "time", clock)
    median, least = calibration._collection_costs(job, dataset, 4096, repeats=3)
    assert (median, least) == pytest.approx((2.0 / rows, 1.0 / rows))
