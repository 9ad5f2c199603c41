"""Benchmark: mixture training against one-model baselines under drift.

    python bench/mixture.py [--json PATH] [--seeds 3] [--rows-per-hour 3000]
                            [--hours 8] [--datasets abrupt,gradual,recurring,avazu]
                            [--batch-size 100] [--no-river] [--no-surge]
                            [--surge-seeds 10] [--no-surge-traffic]
                            [--no-surge-keep-pace]
                            [--evidence-rows 200] [--memory-new-ids-frozen]

Each dataset is a **history** followed by a **stream**, cut into event-time
windows; every stream row is scored before it is trained on (progressive
evaluation), and each variant's figure is its windowed progressive AUC (the mean
over the stream's windows, AUC per window):

  batch_only   one model trained on the history, then frozen (scores only)
  stream_only  one model trained on everything in time order
  naive_mix    one model; in the stream, each stream batch is followed by a
               replayed history batch (history and stream interleaved)
  mixture      ``model.type: mixture`` (estuary.nn.mixture) with its update
               rules from the batch origin: history rows train the memory tower
               (and its embedding columns); stream rows train the adapt tower and
               the gate, memory tower and the memory columns of history ids
               frozen. One configuration for all four datasets: split tables
               8 + 8, gate, ``evidence_rows: 200`` (the adapt term weighted by
               the posterior of "memory + adapt" against "memory alone" from
               their log losses over the last ~200 stream rows) and
               ``memory_learns_new_ids: true`` (stream rows train the memory
               columns of ids no history row had); ``--evidence-rows 0`` and
               ``--memory-new-ids-frozen`` turn them off
  river_fm     river's ``facto.FMClassifier`` (an online factorization machine),
               learnt row by row over the history, then scored on each stream
               window with ``river.evaluate.progressive_val_score``

Datasets (in memory, nothing written):

  abrupt / gradual / recurring   ``estuary synth``'s drift scenarios: ``--hours``
                 hours, the first half history, concept B from the first stream
                 hour (gradual: over 2 hours; recurring: B and A alternate every
                 hour), a burst of new ids in the second stream hour; seed = the
                 run's seed. Windows: the stream's hours.
  avazu          ../shared/data/avazu_sample_42k.csv.gz: its first hour
                 (14102100, 32,490 rows) is the history, its last hour (14103023,
                 10,000 rows) the stream, in file order, cut into 5 windows.

``forgetting.<dataset>``: after the stream, AUC of each variant on the replayed
last history window (scored, not trained), and ``mixture - batch_only`` (the floor:
>= -0.002). The mixture scores replayed history as history rows (memory tower:
``MixtureModel.score_as``).

Floors: mixture's mean windowed progressive AUC >= the best other variant + 0.003
on each synthetic scenario, and >= the best - 0.001 on Avazu. Times are wall
clock on a shared machine: noisy.

``surge`` (``surge_run``): the mixture over a scenario's stream (abrupt; and
``surge_<scenario>`` for the others of ``--surge-scenarios``) through
a ``MixedBuffer`` of ``--surge-buffer-rows`` rows, one step a tick, rows
arriving at 0.8x the training rate and at 10x through stream window 1; every
arriving row (dropped or not) scored on arrival under every policy; fifo's
overflow waits in the producer's backlog (backpressure: its lag grows, shown
per window). ``surge.surge_window``: the surge window scored by the model as it
enters it (no step) and the drop that alone implies. ``surge_steady``: the same
surge in a window hours after the drift (a longer run; beside ``surge``, its
own no-surge runs). ``surge_traffic``: a traffic surge, not a faster replay: the
same window with 12.5x its rows (more draws of the same hour, the window's own
rows among them), arriving at 10x the training rate for as many ticks as the
window lasts without the surge, against ``surge``'s no-surge runs.
``<key>.keep_pace`` (``--no-surge-keep-pace`` skips it): the reference, not a
policy: a trainer with the compute to keep pace with the surge (it trains every
row that came each tick, in the no-surge run's 80-row steps, through a fifo
buffer that sheds nothing), scored on arrival as the policies are. Its drop is
what the surge costs with nothing shed and no step skipped; a policy with one
step a tick takes about a twelfth of its steps in the replayed hour.
``--surge-seeds`` (10) seeds; each policy's ``priority_minus_it``: priority's
AUC minus its, paired by seed (mean, sd, seeds priority is ahead).
Priority's buffer: recency order, ``--surge-label-weight`` (1),
``--surge-max-age`` (the buffer's rows; 0: no bound). ``--surge-importance``,
``--surge-shed``, ``--surge-order``, ``--surge-high-water``,
``--surge-min-keep``, ``--surge-raw-weights`` change the priority buffer too
(what was tried: docs/mixture.md).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from river import evaluate, facto, metrics, optim

from estuary.config import JobSpec, job_from_dict
from estuary.data.synthetic import SyntheticSpec, generate_chunks
from estuary.data.types import Batch, JaggedIds
from estuary.metrics.evaluation import evaluate_predictions
from estuary.train.build import build_engine, build_tables, seed_everything
from estuary.train.engine import Engine
from estuary.train.mixed_buffer import BufferPolicy, MixedBuffer, Policy, row_bytes
from estuary.train.mixture import find_mixture, mixture_plan_for
from estuary.train.plan import TrainPlan

AVAZU = Path(__file__).resolve().parents[2] / "shared" / "data" / "avazu_sample_42k.csv.gz"
START = datetime(2026, 1, 1, tzinfo=UTC)
VARIANTS = ("batch_only", "stream_only", "naive_mix", "mixture")
SYNTHETIC = ("abrupt", "gradual", "recurring")


@dataclass
class Data:
    """History batches, the stream's windows of batches, the replay window."""

    features: list[str]
    num_dense: int
    history: list[Batch]
    windows: list[list[Batch]]
    replay: list[Batch]
    rows: dict[str, int] = field(default_factory=dict)


def batches_of(
    labels: np.ndarray,
    dense: np.ndarray,
    sparse: np.ndarray,
    features: list[str],
    size: int,
    origin: str,
) -> list[Batch]:
    out = []
    for lo in range(0, len(labels), size):
        hi = min(lo + size, len(labels))
        out.append(
            Batch(
                labels=labels[lo:hi].astype(np.float32),
                dense=dense[lo:hi].astype(np.float32),
                sparse={f: JaggedIds.single(sparse[lo:hi, j]) for j, f in enumerate(features)},
                origin=origin,
            )
        )
    return out


def synthetic_spec(kind: str, seed: int, rows_per_hour: int, hours: int) -> SyntheticSpec:
    half = hours // 2
    return SyntheticSpec(
        rows_per_hour=rows_per_hour,
        hours=hours,
        start=START,
        num_dense=2,
        vocab_sizes=(300, 300, 100, 100, 50, 50),
        num_interactions=2,
        drift=1.5,
        drift_fraction=1.0,
        drift_kind=kind,  # type: ignore[arg-type]
        drift_at=START + timedelta(hours=half),
        drift_span_hours=2.0,
        drift_period_hours=1.0,
        burst_at=START + timedelta(hours=half + 1),
        burst_share=0.3,
        diurnal_amplitude=0.0,
        missing_rate=0.0,
        signal_scale=2.0,
        seed=seed,
    )


def hour_rows(spec: SyntheticSpec, hour: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, log1p dense, sparse ids) of one epoch hour."""
    chunks = list(generate_chunks(spec, hour))
    labels = np.concatenate([c.labels for c in chunks])
    dense = np.log1p(np.concatenate([c.dense for c in chunks]).astype(np.float32))
    sparse = np.concatenate([c.sparse for c in chunks]).astype(np.int64)
    return labels, dense, sparse


def synthetic(kind: str, seed: int, rows_per_hour: int, hours: int, size: int) -> Data:
    half = hours // 2
    spec = synthetic_spec(kind, seed, rows_per_hour, hours)
    features = [f"C{j + 1}" for j in range(len(spec.vocab_sizes))]
    per_hour = [hour_rows(spec, hour) for hour in spec.epoch_hours()]
    history = [b for h in per_hour[:half] for b in batches_of(*h, features, size, "history/synth")]
    windows = [batches_of(*h, features, size, "stream/synth") for h in per_hour[half:]]
    replay = batches_of(*per_hour[half - 1], features, size, "history/synth")
    return Data(features, 2, history, windows, replay)


def traffic_window(
    kind: str, seed: int, rows_per_hour: int, hours: int, window: int, factor: float
) -> tuple[Batch, np.ndarray]:
    """Stream window ``window`` with ``factor`` x its traffic: the same event hour
    with ``round(factor * rows_per_hour)`` rows. A synthetic row is a hash of
    (seed, hour, row index), so rows ``0..R-1`` are the no-surge window's own
    rows and the others are more draws of the same hour. The R own rows are
    spread evenly among the others in arrival order. Returns the rows and the
    positions of the R own rows (in their order)."""
    base = synthetic_spec(kind, seed, rows_per_hour, hours)
    total = round(factor * rows_per_hour)
    spec = replace(base, rows_per_hour=total)
    hour = list(spec.epoch_hours())[hours // 2 + window]
    labels, dense, sparse = hour_rows(spec, hour)
    extra = total - rows_per_hour
    at = np.concatenate(
        [
            (np.arange(rows_per_hour) + 0.5) / rows_per_hour,
            (np.arange(extra) + 0.5) / max(1, extra),
        ]
    )
    order = np.argsort(at, kind="stable")
    features = [f"C{j + 1}" for j in range(len(spec.vocab_sizes))]
    rows = Batch.concatenate(
        batches_of(labels[order], dense[order], sparse[order], features, total, "stream/synth")
    )
    own = np.flatnonzero(order < rows_per_hour)
    return rows, own


def avazu(size: int, windows: int = 5) -> Data:
    with gzip.open(AVAZU, "rt") as f:
        header = f.readline().rstrip("\n").split(",")
        rows = [line.rstrip("\n").split(",") for line in f]
    features = [c for c in header if c not in ("id", "click", "hour")]
    cols = [header.index(c) for c in features]
    labels = np.array([int(r[1]) for r in rows], np.int8)
    hours = np.array([int(r[2]) for r in rows])
    sparse = np.array(  # a stable 63-bit hash of (column, value)
        [
            [zlib.crc32(f"{j}:{r[c]}".encode()) | (j << 40) for j, c in enumerate(cols)]
            for r in rows
        ],
        np.int64,
    )
    dense = np.zeros((len(rows), 0), np.float32)
    first = hours == hours.min()
    hist = batches_of(labels[first], dense[first], sparse[first], features, size, "history/avazu")
    last = ~first
    s_labels, s_dense, s_sparse = labels[last], dense[last], sparse[last]
    cuts = np.linspace(0, len(s_labels), windows + 1).astype(int)
    stream = [
        batches_of(s_labels[a:b], s_dense[a:b], s_sparse[a:b], features, size, "stream/avazu")
        for a, b in itertools.pairwise(cuts)
    ]
    tail = max(1, len(hist) // 8)  # the last eighth of the history hour
    return Data(features, 0, hist, stream, hist[-tail:])


# --- models ------------------------------------------------------------------

TOWER = {"type": "dlrm", "params": {"bottom_mlp": [16, 8], "top_mlp": [32, 16]}}
TOWER_NO_DENSE = {"type": "dlrm", "params": {"bottom_mlp": [8], "top_mlp": [32, 16]}}


def job(data: Data, seed: int, mixture: bool, args: argparse.Namespace) -> JobSpec:
    tower = TOWER if data.num_dense else TOWER_NO_DENSE
    dim = 8
    model: dict[str, Any] = {"type": tower["type"], "params": tower["params"]}
    if mixture:
        dim = 8 + args.adapt_dim
        adapt: dict[str, Any] = {"type": "logreg", "params": {}} if args.adapt_dim == 1 else tower
        if args.adapt_reads == "all":  # its rows: the memory's 8 columns, then its own
            adapt = {"type": "dcnv2", "params": {"cross_layers": 1, "mlp": [32, 16]}}
        model = {
            "type": "mixture",
            "params": {
                "memory": tower,
                "adapt": adapt,
                "combine": args.combine,
                "embeddings": "split",
                "memory_dim": 8,
                "adapt_reads": args.adapt_reads,
                "evidence_rows": args.evidence_rows,
                "memory_learns_new_ids": not args.memory_new_ids_frozen,
                "update": {
                    "history_streams": ["history"],
                    "history": {"memory": 1, "adapt": 0, "gate": 0, "embeddings": 1},
                    "stream": {
                        "memory": 0,
                        "adapt": args.adapt_lr_scale,
                        "gate": args.gate_lr_scale,
                        "embeddings": args.stream_embedding_scale,
                    },
                },
            },
        }
    return job_from_dict(
        {
            "data": {
                "sources": [{"path": "unused.csv", "format": "csv"}],
                "schema": {
                    "dense": [f"I{i}" for i in range(data.num_dense)],
                    "sparse": data.features,
                },
            },
            "model": {
                **model,
                "embedding": {
                    "default": {
                        "dim": dim,
                        "optimizer": {"name": "adagrad", "lr": args.sparse_lr},
                        # A column's initial value depends on (seed, id, column) only,
                        # so the mixture's memory columns start as batch_only's rows.
                        "initializer": {"name": "uniform", "scale": 8**-0.5},
                    }
                },
            },
            "train": {
                "seed": seed,
                "threads": 1,
                "batch_size": args.batch_size,
                "dense_optimizer": {"name": "adam", "lr": args.dense_lr},
            },
        },
        base_dir=Path.cwd(),
    )


@dataclass
class Run:
    engine: Engine
    step: Callable[[Batch], np.ndarray]  # train on a batch; its pre-update probabilities


def build(data: Data, seed: int, mixture: bool, args: argparse.Namespace) -> Run:
    spec = job(data, seed, mixture, args)
    seed_everything(seed)
    plan = TrainPlan.from_job(spec, data.features)
    tables = build_tables(plan, None)
    engine = build_engine(
        spec, plan, tables, external=False, num_dense=data.num_dense, jagged=(), model=None
    )
    updater = engine.sparse_updater()
    plan_for = mixture_plan_for(engine.model, plan.tables, engine.embeddings.features)

    def step(batch: Batch) -> np.ndarray:
        looked_up = engine.lookup(batch)
        engine.step(batch, looked_up, updater, plan_for(batch) if plan_for else None)
        assert engine.last_logits is not None
        return torch.sigmoid(engine.last_logits).numpy()

    return Run(engine, step)


def auc(batches: list[Batch], probs: list[np.ndarray]) -> float:
    labels = np.concatenate([b.labels for b in batches])
    return float(evaluate_predictions(labels, np.concatenate(probs)).auc)


def run_variant(variant: str, data: Data, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    run = build(data, seed, variant == "mixture", args)
    for batch in data.history:
        run.step(batch)
    replayed: Iterator[Batch] = iter(())
    window_aucs = []
    for window in data.windows:
        probs = []
        for batch in window:
            if variant == "batch_only":
                probs.append(run.engine.predict(batch))
                continue
            probs.append(run.step(batch))
            if variant == "naive_mix":
                nxt = next(replayed, None)
                if nxt is None:
                    replayed = iter(data.history)
                    nxt = next(replayed)
                run.step(nxt)
        window_aucs.append(auc(window, probs))
    mixture = find_mixture(run.engine.model)
    if mixture is not None:
        mixture.score_as("history")
    replay = auc(data.replay, [run.engine.predict(b) for b in data.replay])
    return {"windows": window_aucs, "mean": float(np.mean(window_aucs)), "replay_auc": replay}


def river_fm(data: Data, seed: int) -> dict[str, Any]:
    def rows(batches: list[Batch]) -> Iterator[tuple[dict[str, Any], bool]]:
        for b in batches:
            for i in range(b.num_rows):
                x: dict[str, Any] = {f"{f}={b.sparse[f].values[i]}": 1.0 for f in data.features}
                x.update({f"I{j}": float(b.dense[i, j]) for j in range(b.dense.shape[1])})
                yield x, bool(b.labels[i])

    model = facto.FMClassifier(
        n_factors=8, weight_optimizer=optim.SGD(0.05), latent_optimizer=optim.SGD(0.05), seed=seed
    )
    for x, y in rows(data.history):
        model.learn_one(x, y)
    window_aucs = []
    for window in data.windows:
        metric = evaluate.progressive_val_score(rows(window), model, metrics.ROCAUC())
        window_aucs.append(float(metric.get()))
    return {"windows": window_aucs, "mean": float(np.mean(window_aucs))}


# --- surge -------------------------------------------------------------------

POLICIES: tuple[Policy, ...] = ("priority", "uniform", "fifo")


def max_age(args: argparse.Namespace) -> float | None:
    """The priority buffer's ``max_age_rows``: ``--surge-max-age`` rows, the
    buffer's rows when negative (the default), no bound when 0."""
    if args.surge_max_age < 0:
        return float(args.surge_buffer_rows)
    return args.surge_max_age or None


def surge_run(
    data: Data,
    seed: int,
    args: argparse.Namespace,
    policy: Policy | None,
    at: int = 1,
    traffic: tuple[Batch, np.ndarray] | None = None,
    keep_pace: bool = False,
) -> dict[str, Any]:
    """The mixture over the stream through a ``MixedBuffer``, one training step
    (``batch_size`` rows) per tick. Rows arrive at 0.8x the training rate, and
    at 10x it during stream window ``at`` (``policy``; ``None``: no surge,
    priority buffer). Every row is scored when it arrives (before any training
    on it, dropped or not, under every policy); AUC per window of arrival. Lag:
    ticks from a row's arrival to its step (fifo: the wait in the producer's
    backlog included), p99 also per window of the step.

    ``traffic`` (``traffic_window``): a traffic surge instead of a faster
    replay. Window ``at`` arrives as those rows (12.5x its rows at 10x the
    training rate, so it lasts as many ticks as without the surge); its AUC is
    over all of them, and ``surge_window_own_rows_auc`` over the no-surge
    window's own rows among them.

    ``keep_pace`` (with a ``policy``): a reference, not a policy. Each tick the
    trainer trains every row that came, in steps of the no-surge run's (0.8x
    ``batch_size`` rows: what arrives in a tick), through a fifo buffer large
    enough to shed nothing, so during the replay it takes the steps the
    no-surge run takes for the same rows (13 a tick where the no-surge run
    takes 12.5); rows are still scored on arrival. Its drop is what the surge
    costs when nothing is shed and no step is skipped: the cost of the rows
    arriving faster than event time, scored before they can be trained."""
    if keep_pace and policy is None:
        raise ValueError("keep_pace is a surge run: give it a policy (its buffer is fifo)")
    run = build(data, seed, True, args)
    for batch in data.history:
        run.step(batch)
    size = args.batch_size
    per_row = int(row_bytes(data.windows[0][0]).max())
    prio = policy in (None, "priority")
    capacity_rows = args.surge_buffer_rows
    if keep_pace:
        policy, prio = "fifo", False
        capacity_rows = sum(b.num_rows for w in data.windows for b in w) * 13
    buffer = MixedBuffer(
        BufferPolicy(
            capacity_bytes=capacity_rows * per_row,
            policy=policy or "priority",
            label_weight=args.surge_label_weight if prio else 2.0,
            half_life_rows=args.surge_buffer_rows,
            importance_from=args.surge_importance if prio else "none",
            order_by_importance=args.surge_order if prio else 0.0,
            shed=args.surge_shed if prio else "sample",
            high_water=args.surge_high_water if prio else 0.5,
            normalize_weights=not args.surge_raw_weights if prio else True,
            min_keep=args.surge_min_keep if prio else 0.05,
            max_age_rows=max_age(args) if prio else None,
            seed=seed,
        )
    )
    backlog: list[tuple[Batch, np.ndarray]] = []  # fifo: rows the full buffer pushed back
    frozen_auc = float("nan")
    lags: list[np.ndarray] = []
    lag_windows: list[list[np.ndarray]] = [[] for _ in data.windows]
    tick = 0
    window_aucs = []

    steps = 0
    pace = size * 4 // 5  # keep_pace's step: a no-surge tick's rows

    def train_one(rows: int = size) -> None:
        nonlocal steps
        batch = buffer.take(rows)
        if batch is not None:
            steps += 1
            run.step(batch)
            assert batch.row_ids is not None
            lags.append(tick - batch.row_ids)
            lag_windows[w].append(lags[-1])

    own_auc = float("nan")
    for w, window in enumerate(data.windows):
        rows = Batch.concatenate(window)
        own = np.arange(rows.num_rows)
        if traffic is not None and policy is not None and w == at:
            rows, own = traffic
        rate = size * 10 if (policy is not None and w == at) else size * 4 // 5
        if w == at:  # the surge window scored by the model as it enters it (0 steps)
            frozen_auc = float(evaluate_predictions(rows.labels, run.engine.predict(rows)).auc)
        probs = []
        for lo in range(0, rows.num_rows, rate):
            arriving = rows.slice(lo, lo + rate)
            arriving = Batch(
                arriving.labels,
                arriving.dense,
                arriving.sparse,
                np.full(arriving.num_rows, tick, np.int64),
                "stream/synth",
            )
            probs.append(run.engine.predict(arriving))
            backlog.append((arriving, probs[-1]))
            while backlog:
                rest, scores = backlog[0]
                taken = buffer.offer(rest, "stream", scores)
                if taken < rest.num_rows:  # fifo only: the rest waits
                    backlog[0] = (rest.slice(taken, rest.num_rows), scores[taken:])
                    break
                backlog.pop(0)
            if keep_pace:  # every row that came, in the no-surge run's steps
                while buffer.rows:
                    train_one(pace)
            else:
                train_one()
            tick += 1
        scored = np.concatenate(probs)
        window_aucs.append(float(evaluate_predictions(rows.labels, scored).auc))
        if w == at:
            own_auc = float(evaluate_predictions(rows.labels[own], scored[own]).auc)
    lag = np.concatenate(lags) if lags else np.zeros(1)
    stats = buffer.stats()["sources"]["stream"]
    return {
        "windows": window_aucs,
        "mean": float(np.mean(window_aucs)),
        "steps": steps,
        "kept_fraction": (stats["taken"])
        / max(1, stats["offered"] + sum(b.num_rows for b, _ in backlog)),
        "lag_p50_ticks": float(np.percentile(lag, 50)),
        "lag_p99_ticks": float(np.percentile(lag, 99)),
        "lag_p99_ticks_by_window": [
            float(np.percentile(np.concatenate(ls), 99)) if ls else 0.0 for ls in lag_windows
        ],
        "backlog_rows_at_end": sum(b.num_rows for b, _ in backlog),
        "surge_window_frozen_auc": frozen_auc,
        "surge_window_own_rows_auc": own_auc,
        "buffer_peak_bytes": buffer.peak_bytes,
        "buffer_capacity_bytes": buffer.policy.capacity_bytes,
        "counts": stats,
    }


def surge(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """For each of ``--surge-scenarios`` (key suffix ``_<scenario>``, none for
    abrupt): ``surge``, 10x in stream window 1 (the hour after the drift, with
    the burst of new ids; recurring: concept A's first hour back), ``--hours``
    of data; ``surge_traffic``, a traffic surge in the same window (12.5x the
    hour's rows at 10x the training rate, ``traffic_window``) against the same
    no-surge runs. ``surge_steady`` (abrupt only): the faster replay in stream
    window ``--surge-steady-at`` (4) of a ``--surge-steady-hours`` (12) run,
    hours after the drift and the burst, with one window after it; its own
    no-surge runs."""
    placements: dict[str, tuple[str, int, int, bool]] = {}  # scenario, hours, at, traffic
    for scenario in [s for s in args.surge_scenarios.split(",") if s]:
        if scenario not in SYNTHETIC:
            raise SystemExit(f"--surge-scenarios: {scenario!r} is not one of {SYNTHETIC}")
        suffix = "" if scenario == "abrupt" else f"_{scenario}"
        placements[f"surge{suffix}"] = (scenario, args.hours, 1, False)
        if not args.no_surge_traffic:
            placements[f"surge_traffic{suffix}"] = (scenario, args.hours, 1, True)
        if scenario == "abrupt" and args.surge_steady_at >= 0:
            placements["surge_steady"] = (
                scenario,
                args.surge_steady_hours,
                args.surge_steady_at,
                False,
            )
    policies = [p for p in POLICIES if p in args.surge_policies.split(",")]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {} for k in placements}
    factor = 10 * args.batch_size / (args.batch_size * 4 // 5)  # 10x training = 12.5x arrival
    for seed in range(args.surge_seeds):
        base: dict[tuple[str, int], tuple[Data, dict[str, Any]]] = {}  # no-surge runs
        for key, (scenario, hours, at, traffic) in placements.items():
            if (scenario, hours) not in base:
                data = synthetic(scenario, seed, args.rows_per_hour, hours, args.batch_size)
                base[scenario, hours] = (data, surge_run(data, seed, args, None))
            data, no_surge = base[scenario, hours]
            runs[key].setdefault("no_surge", []).append(no_surge)
            rows = (
                traffic_window(scenario, seed, args.rows_per_hour, hours, at, factor)
                if traffic
                else None
            )
            for policy in policies:
                runs[key].setdefault(policy, []).append(
                    surge_run(data, seed, args, policy, at, rows)
                )
            if not args.no_surge_keep_pace:
                runs[key].setdefault("keep_pace", []).append(
                    surge_run(data, seed, args, "fifo", at, rows, keep_pace=True)
                )
    return {
        key: surge_figures(runs[key], policies, at, args, key, scenario)
        for key, (scenario, _, at, _) in placements.items()
    }


def surge_figures(
    runs: dict[str, list[dict[str, Any]]],
    policies: list[Policy],
    at: int,
    args: argparse.Namespace,
    key: str = "surge",
    scenario: str = "abrupt",
) -> dict[str, Any]:
    base = float(np.mean([r["mean"] for r in runs["no_surge"]]))
    base_windows = np.mean([r["windows"] for r in runs["no_surge"]], axis=0)
    out: dict[str, Any] = {
        "no_surge": {
            "auc": base,
            "windows": base_windows.round(4).tolist(),
            "auc_by_seed": [round(r["mean"], 4) for r in runs["no_surge"]],
        }
    }
    print(
        f"\n{key} ({scenario} scenario, 10x in stream window {at}, "
        f"{args.surge_seeds} seeds): "
        f"no-surge AUC {base:.4f} [{' '.join(f'{a:.4f}' for a in base_windows)}]"
    )
    frozen = float(np.mean([r["surge_window_frozen_auc"] for r in runs[policies[0]]]))
    nwin = len(base_windows)
    bound = (base_windows[at] - frozen) / nwin
    out["surge_window"] = {
        "index": at,
        "no_surge_auc": float(base_windows[at]),
        "frozen_model_auc": frozen,
        "drop_bound_at_0_steps": float(bound),
    }
    print(
        f"  the surge window scored by the model entering it (no step): {frozen:.4f} "
        f"(no-surge {base_windows[at]:.4f}): auc_drop >= {bound:.4f} from that window alone "
        "if it trained nothing and every other window matched the no-surge run"
    )
    for policy in policies:
        rs = runs[policy]
        fig = {
            "auc": float(np.mean([r["mean"] for r in rs])),
            "auc_drop": base - float(np.mean([r["mean"] for r in rs])),
            "auc_by_seed": [round(r["mean"], 4) for r in rs],
            "kept_fraction": float(np.mean([r["kept_fraction"] for r in rs])),
            "lag_p50_ticks": float(np.mean([r["lag_p50_ticks"] for r in rs])),
            "lag_p99_ticks": float(np.mean([r["lag_p99_ticks"] for r in rs])),
            "buffer_peak_bytes": int(max(r["buffer_peak_bytes"] for r in rs)),
            "buffer_capacity_bytes": rs[0]["buffer_capacity_bytes"],
            "windows": np.mean([r["windows"] for r in rs], axis=0).round(4).tolist(),
            "drop_by_window": ((base_windows - np.mean([r["windows"] for r in rs], axis=0)) / nwin)
            .round(4)
            .tolist(),
            "lag_p99_ticks_by_window": np.mean(
                [r["lag_p99_ticks_by_window"] for r in rs], axis=0
            ).tolist(),
            "counts_seed0": rs[0]["counts"],
            "surge_window_own_rows_auc": float(
                np.mean([r["surge_window_own_rows_auc"] for r in rs])
            ),
        }
        if policy != "priority" and "priority" in out:  # paired by seed: the same data
            fig["priority_minus_it"] = priority_minus(out["priority"], fig)
        out[policy] = fig
        print(
            f"  {policy:<9} auc_drop {fig['auc_drop']:+.4f}  kept {fig['kept_fraction']:.3f}  "
            f"lag p50/p99 {fig['lag_p50_ticks']:.0f}/{fig['lag_p99_ticks']:.0f} ticks  "
            f"peak {fig['buffer_peak_bytes']:,} of {fig['buffer_capacity_bytes']:,} B  "
            f"[{' '.join(f'{a:.4f}' for a in fig['windows'])}]  lag p99 by window "
            f"[{' '.join(f'{a:.0f}' for a in fig['lag_p99_ticks_by_window'])}]  "
            f"window {at} on its own rows {fig['surge_window_own_rows_auc']:.4f}"
        )
        print_priority_minus(fig, policy)
    if "keep_pace" in runs:
        k = out["keep_pace"] = keep_pace_figures(runs, base, out.get("priority"))
        print(
            f"  keep pace (every row trained, in the no-surge run's steps; a reference): "
            f"auc_drop {k['auc_drop']:+.4f} [{' '.join(f'{a:.4f}' for a in k['windows'])}]; "
            f"drop over 0.003 in {k['seeds_over_0.003']} of {len(k['auc_by_seed'])} seeds"
        )
        print_priority_minus(k, "keep pace")
    return out


def keep_pace_figures(
    runs: dict[str, list[dict[str, Any]]], base: float, priority: dict[str, Any] | None
) -> dict[str, Any]:
    """``surge_run(keep_pace=True)``'s figures: its drop from the no-surge run
    (mean, per window, per seed paired with the no-surge run's seeds), and
    ``priority``'s AUC minus it, paired by seed."""
    rs = runs["keep_pace"]
    means = np.array([r["mean"] for r in rs])
    drops = np.array([r["mean"] for r in runs["no_surge"]]) - means
    windows = np.mean([r["windows"] for r in rs], axis=0)
    out: dict[str, Any] = {
        "auc": float(means.mean()),
        "auc_drop": base - float(means.mean()),
        "auc_by_seed": [round(float(m), 4) for m in means],
        "drop_by_seed": [float(d) for d in drops],
        "seeds_over_0.003": int((drops > 0.003).sum()),
        "windows": windows.round(4).tolist(),
        "kept_fraction": float(np.mean([r["kept_fraction"] for r in rs])),
        "steps": float(np.mean([r["steps"] for r in rs])),
        "no_surge_steps": float(np.mean([r["steps"] for r in runs["no_surge"]])),
    }
    if priority is not None:
        out["priority_minus_it"] = priority_minus(priority, out)
    return out


def priority_minus(priority: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Priority's AUC minus ``other``'s, paired by seed (the same data)."""
    diff = np.array(priority["auc_by_seed"]) - np.array(other["auc_by_seed"])
    return {
        "mean": float(diff.mean()),
        "sd": float(diff.std(ddof=1)) if diff.size > 1 else float("nan"),
        "seeds_priority_ahead": int((diff > 0).sum()),
        "seeds": int(diff.size),
    }


def print_priority_minus(fig: dict[str, Any], name: str) -> None:
    if "priority_minus_it" in fig:
        d = fig["priority_minus_it"]
        print(
            f"            priority - {name}: {d['mean']:+.4f} (sd {d['sd']:.4f} over seeds; "
            f"priority ahead in {d['seeds_priority_ahead']} of {d['seeds']})"
        )


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows-per-hour", type=int, default=3000)
    parser.add_argument("--hours", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--datasets", default=",".join([*SYNTHETIC, "avazu"]))
    parser.add_argument("--no-river", action="store_true")
    parser.add_argument("--dense-lr", type=float, default=0.005)
    parser.add_argument("--sparse-lr", type=float, default=0.3)
    parser.add_argument("--adapt-dim", type=int, default=8)
    parser.add_argument("--combine", default="gate")
    parser.add_argument("--adapt-reads", default="own")
    parser.add_argument("--evidence-rows", type=int, default=200)
    parser.add_argument("--memory-new-ids-frozen", action="store_true")
    parser.add_argument("--gate-lr-scale", type=float, default=2.0)
    parser.add_argument("--surge-buffer-rows", type=int, default=2000)
    parser.add_argument("--no-surge", action="store_true")
    parser.add_argument("--surge-seeds", type=int, default=10)
    parser.add_argument("--surge-scenarios", default=",".join(SYNTHETIC))
    parser.add_argument("--surge-policies", default=",".join(POLICIES))
    parser.add_argument("--surge-importance", default="none", choices=("none", "loss"))
    parser.add_argument("--surge-order", type=float, default=0.0)
    parser.add_argument("--surge-shed", default="sample", choices=("sample", "evict"))
    parser.add_argument("--surge-high-water", type=float, default=0.5)
    parser.add_argument("--surge-min-keep", type=float, default=0.05)
    parser.add_argument("--surge-label-weight", type=float, default=1.0)
    parser.add_argument("--surge-max-age", type=float, default=-1.0)  # -1: the buffer's rows
    parser.add_argument("--surge-raw-weights", action="store_true")
    parser.add_argument("--surge-steady-at", type=int, default=4)
    parser.add_argument("--surge-steady-hours", type=int, default=12)
    parser.add_argument("--no-surge-traffic", action="store_true")
    parser.add_argument("--no-surge-keep-pace", action="store_true")
    parser.add_argument("--adapt-lr-scale", type=float, default=2.0)
    parser.add_argument("--stream-embedding-scale", type=float, default=1.0)
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {"progressive_auc": {}, "forgetting": {}, "windows": {}, "args": {}}
    report["args"] = {k: v for k, v in vars(args).items() if k != "json"}
    floors: dict[str, bool] = {}
    t0 = time.perf_counter()
    for name in [d for d in args.datasets.split(",") if d]:
        per: dict[str, list[dict[str, Any]]] = {}
        for seed in range(args.seeds):
            if name == "avazu":
                data = avazu(args.batch_size)
            else:
                data = synthetic(name, seed, args.rows_per_hour, args.hours, args.batch_size)
            for variant in VARIANTS:
                per.setdefault(variant, []).append(run_variant(variant, data, seed, args))
            if not args.no_river:
                per.setdefault("river_fm", []).append(river_fm(data, seed))
        means = {v: float(np.mean([r["mean"] for r in runs])) for v, runs in per.items()}
        report["progressive_auc"][name] = means
        report["windows"][name] = {
            v: np.mean([r["windows"] for r in runs], axis=0).round(4).tolist()
            for v, runs in per.items()
        }
        replay = {
            v: float(np.mean([r["replay_auc"] for r in runs]))
            for v, runs in per.items()
            if "replay_auc" in runs[0]
        }
        gap = replay["mixture"] - replay["batch_only"]
        report["forgetting"][name] = {**replay, "mixture_minus_batch_only": gap}
        best_other = max(means[v] for v in VARIANTS if v != "mixture")  # river: reported
        margin = 0.003 if name in SYNTHETIC else -0.001
        floors[f"{name}.progressive"] = means["mixture"] >= best_other + margin
        floors[f"{name}.forgetting"] = gap >= -0.002
        print(f"\n{name}: mean windowed progressive AUC over {args.seeds} seeds")
        for v, m in means.items():
            wins = " ".join(f"{a:.4f}" for a in report["windows"][name][v])
            rep = f"  replay {replay[v]:.4f}" if v in replay else ""
            print(f"  {v:<12} {m:.4f}  (mixture - it: {means['mixture'] - m:+.4f})  [{wins}]{rep}")
    if not args.no_surge:
        report.update(surge(args))
    for key in [k for k in report if k.startswith("surge")]:  # with all three policies
        if args.no_surge or key not in report or not set(POLICIES) <= set(report[key]):
            continue
        s = report[key]
        floors[f"{key}.priority.within_0.003"] = s["priority"]["auc_drop"] <= 0.003
        floors[f"{key}.priority_beats_uniform"] = (
            s["priority"]["auc_drop"] < s["uniform"]["auc_drop"]
        )
        floors[f"{key}.priority_beats_fifo"] = s["priority"]["auc_drop"] < s["fifo"]["auc_drop"]
        floors[f"{key}.within_capacity"] = (
            s["priority"]["buffer_peak_bytes"] <= s["priority"]["buffer_capacity_bytes"]
        )
    report["floors_met"] = floors
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"\nfloors met: {floors}\nwall {report['wall_s']} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
