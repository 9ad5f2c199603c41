"""Progressive evaluation (``train.progressive_eval``): each batch scored before it
is trained on, reported per event-time window and origin, with the lag."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from estuary.config import ConfigError, JobSpec, job_from_dict
from estuary.data.synthetic import SyntheticSpec, SynthOutput, generate_chunks, write_synthetic
from estuary.data.types import Batch, JaggedIds
from estuary.metrics.evaluation import evaluate_predictions
from estuary.metrics.progressive import format_report, weighted_quantiles
from estuary.train import Trainer
from estuary.train.callbacks import Callback, LoopState
from estuary.train.progressive import SeenIds

START = datetime(2026, 1, 1, tzinfo=UTC)
HOURS, ROWS, BATCH = 6, 2000, 50
DRIFT = SyntheticSpec(
    rows_per_hour=ROWS,
    hours=HOURS,
    start=START,
    num_dense=2,
    vocab_sizes=(50,) * 4,
    num_interactions=0,
    drift=1.5,
    drift_fraction=1.0,
    diurnal_amplitude=0.0,
    missing_rate=0.0,
    signal_scale=2.0,
    drift_kind="abrupt",
    drift_at=START + timedelta(hours=3),
    seed=1,
)
# The same click model with its change out of range (concept A throughout), and
# a burst of new ids in hour 4.
STEADY = replace(
    DRIFT,
    drift_at=START + timedelta(days=365),
    burst_at=START + timedelta(hours=4),
    burst_share=0.3,
)


def test_seen_ids_flags_rows_holding_an_id_never_seen_before() -> None:
    seen = SeenIds(bits=16)
    #   row:      0       1       2
    #   f1:     [7]     [8]     [7]        one id a row
    #   f2:     [1, 2]  []      [3]        bags (CSR offsets 0 2 2 3)
    batch = Batch(
        labels=np.zeros(3, np.float32),
        dense=np.zeros((3, 0), np.float32),
        sparse={
            "f1": JaggedIds.single(np.array([7, 8, 7], np.int64)),
            "f2": JaggedIds(values=np.array([1, 2, 3], np.int64), offsets=np.array([0, 2, 2, 3])),
        },
    )
    assert seen.new_rows(batch).tolist() == [True, True, True]  # all new, 7 twice included
    assert seen.new_rows(batch).tolist() == [False, False, False]
    batch.sparse["f2"] = JaggedIds(
        values=np.array([1, 9], np.int64), offsets=np.array([0, 1, 1, 2])
    )
    assert seen.new_rows(batch).tolist() == [False, False, True]  # only 9 is new


def test_weighted_quantiles_count_each_value_its_weight() -> None:
    values, weights = np.array([3.0, 1.0, 2.0]), np.array([1, 98, 1], np.int64)
    assert weighted_quantiles(values, weights, (0.5, 0.985, 0.995)) == [1.0, 2.0, 3.0]


class StepScores(Callback):
    """The training step's own logits and labels, step by step (what the loop
    hands progressive evaluation, read independently of it)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.probs: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        self.probs.append(torch.sigmoid(self.engine.last_logits).numpy())
        self.labels.append(self.engine.last_labels.numpy())


def job_for(root: Path, hours: int = HOURS, **train: Any) -> JobSpec:
    """A ``data.dataset`` job over the synthetic hours under ``root/data``
    (``train``: more ``train`` settings)."""
    source = {
        "name": "synth",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
        "columns": ["label", "I1", "I2", "C1", "C2", "C3", "C4"],
        "start": "2026-01-01T00",
        "end": f"2026-01-01T{hours:02d}",
    }
    return job_from_dict(
        {
            "data": {
                "schema": {"dense": ["I1", "I2"], "sparse": ["C1", "C2", "C3", "C4"]},
                "dataset": {
                    "streams": {"hist": {"sources": [source]}},
                    "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 2},
                },
            },
            "model": {
                "type": "dlrm",
                "params": {"bottom_mlp": [4], "top_mlp": [4]},
                "embedding": {"default": {"dim": 4, "optimizer": {"name": "adagrad", "lr": 2.0}}},
            },
            "train": {
                "batch_size": BATCH,
                "threads": 1,
                "dense_optimizer": {"name": "adam", "lr": 0.02},
                "progressive_eval": True,
                **train,
            },
            "output": {"dir": "out", "progress": False},
        },
        base_dir=root,
    )


def train(root: Path, spec: SyntheticSpec) -> tuple[dict[str, Any], StepScores, Trainer]:
    write_synthetic(spec, root / "data", SynthOutput(format="criteo_tsv"))
    job = job_for(root)
    scores = StepScores()
    trainer = Trainer(job, callbacks=[scores])
    scores.engine = trainer.engine
    result = trainer.fit()
    return result.extra["progressive"], scores, trainer


def test_windows_hold_the_auc_of_the_steps_own_predictions_and_bursts_are_new_ids(
    tmp_path: Path,
) -> None:
    report, scores, trainer = train(tmp_path, STEADY)
    steps_per_hour = ROWS // BATCH  # read order (no shuffle): hour h = these steps
    assert [w["start"] for w in report["windows"]] == [
        f"2026-01-01T{h:02d}:00:00Z" for h in range(HOURS)
    ]
    for h, window in enumerate(report["windows"]):
        part = slice(h * steps_per_hour, (h + 1) * steps_per_hour)
        want = evaluate_predictions(
            np.concatenate(scores.labels[part]), np.concatenate(scores.probs[part])
        )
        assert window["rows"] == ROWS == want.rows
        assert window["auc"] == pytest.approx(want.auc, abs=1e-6)
        assert window["logloss"] == pytest.approx(want.logloss, abs=1e-6)
    everything = evaluate_predictions(np.concatenate(scores.labels), np.concatenate(scores.probs))
    assert report["origins"]["hist/synth"]["auc"] == pytest.approx(everything.auc, abs=1e-6)
    # new_ids: rows holding a (column, id) not met in an earlier batch (read
    # order); the burst's ids (hour 4) are new in the batches that first draw them.
    sparse = np.concatenate(
        [c.sparse for h in STEADY.epoch_hours() for c in generate_chunks(STEADY, h)]
    ).astype(np.int64)  # (rows, F)
    keyed = sparse + (np.arange(sparse.shape[1], dtype=np.int64) << 32)  # (rows, F)
    _, first, inverse = np.unique(keyed, return_index=True, return_inverse=True)
    first_batch = (first // sparse.shape[1]) // BATCH  # per distinct (column, id)
    row_batch = np.arange(sparse.shape[0])[:, None] // BATCH  # (rows, 1)
    new = (first_batch[inverse.reshape(keyed.shape)] == row_batch).any(axis=1)  # (rows,)
    assert report["origins"]["new_ids"]["rows"] == int(new.sum())
    assert new[4 * ROWS : 5 * ROWS].sum() > new[3 * ROWS : 4 * ROWS].sum() + 50  # the burst
    # Steady concept: no drop at hour 3. Lag from the window end: about 11 months here.
    aucs = [w["auc"] for w in report["windows"]]
    assert aucs[3] > aucs[2] - 0.02
    p50, p99 = report["lag_s"]["p50"], report["lag_s"]["p99"]
    assert 0 < p50 <= p99 and p99 - p50 < HOURS * 3600 + 60
    table = format_report(report).splitlines()  # what `estuary train` prints
    assert len(table) == 2 + HOURS + 2 + 1 and table[0].startswith("progressive evaluation")
    assert table[2].split()[:2] == ["2026-01-01T00:00:00Z", f"{ROWS:,}"]
    registry = trainer.metrics.registry
    got = registry.get_sample_value("estuary_progressive_rows_total", {"origin": "hist/synth"})
    assert got == HOURS * ROWS
    assert registry.get_sample_value("estuary_progressive_window_rows") == ROWS
    assert registry.get_sample_value("estuary_progressive_lag_seconds", {"quantile": "0.5"}) > 0


def test_abrupt_drift_shows_as_a_progressive_auc_drop_at_its_window_then_recovers(
    tmp_path: Path,
) -> None:
    report, _, _ = train(tmp_path, DRIFT)
    aucs = [w["auc"] for w in report["windows"]]
    assert aucs[2] > 0.85  # learnt concept A
    assert aucs[3] < aucs[2] - 0.05  # concept B from hour 3: predictions made stale
    assert aucs[5] > aucs[3] + 0.04  # and learnt again


def test_progressive_eval_needs_a_dataset(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("label,I1,C1\n1,2,a\n0,1,b\n")
    job = job_from_dict(
        {
            "data": {
                "sources": [{"path": "d.csv", "format": "csv"}],
                "schema": {"dense": ["I1"], "sparse": ["C1"]},
            },
            "train": {"progressive_eval": True},
            "output": {"dir": "out", "progress": False},
        },
        base_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match=r"train\.progressive_eval: needs data\.dataset"):
        Trainer(job).fit()


def test_two_trainers_report_rank_0s_share_of_each_window(tmp_path: Path) -> None:
    from estuary.runtime.launcher import run_distributed

    spec = replace(STEADY, hours=2, burst_at=None)
    write_synthetic(spec, tmp_path / "data", SynthOutput(format="criteo_tsv"))
    job = job_for(tmp_path, hours=2)
    result = run_distributed(job, trainers=2, startup_timeout_s=60)
    report = result.extra["progressive"]
    assert report["scope"] == "rank 0's share of each step (1 of 2 trainers)"
    # A step is 2 x 50 rows of one hour; rank 0 scores the first 50 of each.
    assert [w["rows"] for w in report["windows"]] == [ROWS // 2, ROWS // 2]
    assert result.train_rows == 2 * ROWS
    assert report["windows"][1]["auc"] > 0.6  # steps of 100 rows: half as many as W=1


def test_two_trainers_with_a_mixed_buffer_score_every_row_on_arrival(tmp_path: Path) -> None:
    """Rank 0's buffer feeds both ranks, so rank 0 scores every row as it arrives."""
    from estuary.runtime.launcher import run_distributed

    spec = replace(STEADY, hours=2, burst_at=None)
    write_synthetic(spec, tmp_path / "data", SynthOutput(format="criteo_tsv"))
    buffer = {"capacity_bytes": 10**6, "importance": "loss"}
    job = job_for(tmp_path, hours=2, mixed_buffer=buffer)
    result = run_distributed(job, trainers=2, startup_timeout_s=60)
    report = result.extra["progressive"]
    assert report["scope"].startswith("all rows, scored on arrival by rank 0")
    assert [w["rows"] for w in report["windows"]] == [ROWS, ROWS]
    assert result.train_rows == 2 * ROWS and result.extra["rows_dropped"] == 0
    assert report["windows"][1]["auc"] > 0.6
