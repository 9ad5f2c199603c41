"""``train.mixed_buffer``: a data.dataset job's rows through the MixedBuffer."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from estuary.config import ConfigError, JobSpec, job_from_dict
from estuary.data.graph import Progress
from estuary.data.synthetic import SyntheticSpec, SynthOutput, write_synthetic
from estuary.data.types import Batch, JaggedIds
from estuary.metrics.progressive import NEW_IDS
from estuary.train import Trainer
from estuary.train.arrival import ArrivalScorer
from estuary.train.callbacks import Callback, LoopState
from estuary.train.checkpoint import load_checkpoint
from estuary.train.checkpointer import Checkpointer
from estuary.train.feeds import GraphFeed
from estuary.train.mixed_feed import StreamWeights
from estuary.train.result import TrainingStopped

START = datetime(2026, 1, 1, tzinfo=UTC)
HOURS, ROWS, BATCH = 4, 300, 50
SPEC = SyntheticSpec(
    rows_per_hour=ROWS,
    hours=HOURS,
    start=START,
    num_dense=2,
    vocab_sizes=(40,) * 3,
    num_interactions=0,
    diurnal_amplitude=0.0,
    missing_rate=0.0,
    seed=5,
)
COLUMNS = ["label", "I1", "I2", "C1", "C2", "C3"]
FEATURES = COLUMNS[3:]
# 4 + 4 + 2 x 4 + 3 x 16 = 64 bytes a row (one id per feature)
ROW_BYTES = 64


def job_for(root: Path, buffer: dict[str, Any] | None, **over: Any) -> JobSpec:
    """Hours [0, 2) in stream ``hist``, [2, 4) in stream ``live``, a small DLRM."""

    def source(name: str, start: int, end: int) -> dict[str, Any]:
        return {
            "name": name,
            "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
            "columns": COLUMNS,
            "start": f"2026-01-01T{start:02d}",
            "end": f"2026-01-01T{end:02d}",
        }

    train: dict[str, Any] = {
        "batch_size": BATCH,
        "threads": 1,
        "dense_optimizer": {"name": "sgd", "lr": 0.1},
        "progressive_eval": True,
        **({"mixed_buffer": buffer} if buffer is not None else {}),
    }
    if "train_mode" in over:
        train["mode"] = over.pop("train_mode")
    if "sparse_placement" in over:
        train["sparse_placement"] = over.pop("sparse_placement")
    output = {"dir": "out", "progress": False, **over.pop("output", {})}
    return job_from_dict(
        {
            "data": {
                "schema": {"dense": ["I1", "I2"], "sparse": ["C1", "C2", "C3"]},
                "dataset": {
                    "streams": {
                        "hist": {"sources": [source("synth", 0, 2)]},
                        "live": {"sources": [source("feed", 2, HOURS)]},
                    },
                    "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 2},
                },
            },
            "model": {
                "type": "dlrm",
                "params": {"bottom_mlp": [4], "top_mlp": [4]},
                "embedding": {"default": {"dim": 4, "optimizer": {"name": "sgd", "lr": 0.5}}},
            },
            "train": train,
            "output": output,
            **over,
        },
        base_dir=root,
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed_feed")
    write_synthetic(SPEC, root / "data", SynthOutput(format="criteo_tsv"))
    return root


SURGE = {
    "policy": "priority",
    "capacity_bytes": 4 * BATCH * ROW_BYTES,
    "offer_per_take": 3,
    "source_weights": {"live": 2.0},
    "normalize_weights": False,
}


class WatchMetrics(Callback):
    """The exported mixed-buffer counts after the last step."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.taken, self.dropped = trainer, 0.0, 0.0

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        metrics = self.trainer.metrics
        self.taken = sum(
            metrics.value("estuary_mixed_rows_total", source=s, what="taken") or 0.0
            for s in ("hist/synth", "live/feed")
        )
        self.dropped = sum(
            metrics.value("estuary_mixed_rows_total", source=s, what=w) or 0.0
            for s in ("hist/synth", "live/feed")
            for w in ("sampled_out", "evicted")
        )


def test_a_surge_through_the_buffer_trains_and_accounts_for_every_row(data_root: Path) -> None:
    trainer = Trainer(job_for(data_root, SURGE))
    watch = WatchMetrics(trainer)
    trainer.callbacks.append(watch)
    result = trainer.fit()
    extra = result.extra
    stats = extra["mixed_buffer"]
    sources = stats["sources"]
    assert set(sources) == {"hist/synth", "live/feed"}
    total = HOURS * ROWS
    assert sum(c["offered"] for c in sources.values()) == total
    dropped = sum(c["sampled_out"] + c["evicted"] for c in sources.values())
    taken = sum(c["taken"] for c in sources.values())
    assert dropped > 0 and taken > 0  # offered 3x faster than trained: rows were shed
    # Exactly once: every row trained once or counted dropped once, none lost.
    assert extra["rows_committed"] == taken == result.train_rows
    assert extra["rows_dropped"] == stats["rows_dropped"] == dropped
    assert taken + dropped == total
    assert extra["duplicate_rows"] == 0
    assert stats["peak_bytes"] <= SURGE["capacity_bytes"]
    assert stats["rows"] == 0 and stats["bytes"] == 0  # drained at the end
    for counts in sources.values():
        assert counts["kept"] + counts["sampled_out"] == counts["offered"]
        assert counts["taken"] + counts["evicted"] == counts["kept"]
    # The same counts on the Prometheus registry while training.
    assert watch.taken == taken and watch.dropped == dropped
    # Rows are scored on arrival, before the buffer: the dropped ones too.
    progressive = extra["progressive"]
    assert progressive["rows"] == total
    assert sum(o["rows"] for n, o in progressive["origins"].items() if "/" in n) == total
    assert progressive["lag_s"]["p50"] is not None  # filed per trained step
    assert progressive["lag_s"]["by_origin"]["live/feed"]["p50"] is not None


def test_importance_weights_reach_the_loss(data_root: Path) -> None:
    trainer = Trainer(job_for(data_root, SURGE))
    engine = trainer.engine
    inner = engine.step
    seen: list[tuple[np.ndarray, float, float]] = []
    differs: list[bool] = []

    def step(batch: Batch, *args: Any, **kwargs: Any) -> float:
        loss = inner(batch, *args, **kwargs)
        assert batch.weights is not None and engine.last_logits is not None
        logits = engine.last_logits.detach().float()
        labels = torch.from_numpy(batch.labels)
        weight = torch.from_numpy(batch.weights)
        reference = F.binary_cross_entropy_with_logits(logits, labels, weight=weight)
        plain = F.binary_cross_entropy_with_logits(logits, labels)
        seen.append((batch.weights.copy(), loss, float(reference)))
        if not np.allclose(batch.weights, batch.weights[0]):  # the weights matter here
            differs.append(abs(loss - float(plain)) > 1e-6)
        return loss

    engine.step = step  # type: ignore[method-assign]
    trainer.fit()
    weights = np.concatenate([w for w, _, _ in seen])
    assert weights.max() > 1.0  # sampled-down rows weigh 1 / q > 1
    assert weights.max() <= 1 / 0.05 + 1e-4  # min_keep 0.05
    for _, loss, reference in seen:
        assert loss == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert differs and all(differs)  # not the unweighted mean


def test_a_buffer_that_keeps_pace_drops_nothing(data_root: Path) -> None:
    buffer = {"capacity_bytes": 4 * BATCH * ROW_BYTES, "policy": "uniform"}
    result = Trainer(job_for(data_root, buffer)).fit()
    stats = result.extra["mixed_buffer"]
    assert result.train_rows == HOURS * ROWS
    assert result.extra["rows_dropped"] == 0 and result.extra["duplicate_rows"] == 0
    assert all(c["taken"] == c["offered"] for c in stats["sources"].values())


def test_fifo_waits_instead_of_dropping(data_root: Path) -> None:
    buffer = {"capacity_bytes": 2 * BATCH * ROW_BYTES, "policy": "fifo", "offer_per_take": 4}
    result = Trainer(job_for(data_root, buffer)).fit()
    stats = result.extra["mixed_buffer"]
    assert result.train_rows == HOURS * ROWS and result.extra["rows_dropped"] == 0
    assert stats["peak_bytes"] <= buffer["capacity_bytes"]


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        if state.step == self.step:
            state.stop.request("test")


def test_a_stop_and_resume_neither_loses_nor_repeats_a_row(data_root: Path, tmp_path: Path) -> None:
    out = {"output": {"dir": str(tmp_path / "out"), "checkpoint": True}}
    with pytest.raises(TrainingStopped) as stopped:
        Trainer(job_for(data_root, SURGE, **out), callbacks=[StopAt(5)]).fit()
    assert stopped.value.checkpoint is not None
    manifest = load_checkpoint(stopped.value.checkpoint).manifest
    before = manifest["metadata"]["data_progress"]
    assert before["rows_trained"] == 5 * BATCH
    resumed = Trainer(job_for(data_root, SURGE, **out))
    resumed.load_checkpoint(tmp_path / "out")
    extra = resumed.fit().extra
    assert extra["duplicate_rows"] == 0
    # Rows waiting in the buffer at the stop were read again; none was lost.
    assert extra["rows_committed"] + extra["rows_dropped"] == HOURS * ROWS
    assert extra["rows_dropped"] > before["rows_dropped"]  # the resumed run shed rows too
    # The progressive figures went on from the checkpoint's, which held the rows
    # its data progress counted (trained or dropped): the rows waiting in the
    # buffer at the stop were scored again when read again, and each row counts once.
    assert extra["progressive"]["rows"] == HOURS * ROWS
    # Read again, a row that waited at the stop finds its ids marked seen by its
    # first arrival; it still counts as holding a new id if it did then.
    whole = Trainer(job_for(data_root, SURGE)).fit().extra["progressive"]["origins"]
    assert extra["progressive"]["origins"][NEW_IDS]["rows"] == whole[NEW_IDS]["rows"] > 0


def test_in_hybrid_mode_a_checkpoint_takes_the_position_and_the_figures_together(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hybrid: the buffer drops rows on the read-ahead thread while the step runs
    (their scores filed, then recorded in the data position). Both happen under
    the feed's commit lock, and a checkpoint takes the position and the
    progressive figures under it, so neither holds a drop the other lacks and a
    resume from any of them counts every row once."""
    feeds: list[GraphFeed] = []
    init = GraphFeed.__init__

    def made(self: GraphFeed, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        feeds.append(self)

    def lock_held() -> bool:
        assert feeds[-1].mixed is not None
        return feeds[-1].mixed.commit_lock.locked()

    drops: list[tuple[str, bool]] = []  # (thread, lock held) of each recorded drop
    record = Progress.record

    def recorded(self: Progress, row_ids: Any, dropped: bool = False) -> None:
        if dropped:
            drops.append((threading.current_thread().name, lock_held()))
        record(self, row_ids, dropped=dropped)

    captures: list[bool] = []
    capture = Checkpointer.capture_extras

    def captured(self: Checkpointer) -> Any:
        captures.append(lock_held())
        return capture(self)

    monkeypatch.setattr(GraphFeed, "__init__", made)
    monkeypatch.setattr(Progress, "record", recorded)
    monkeypatch.setattr(Checkpointer, "capture_extras", captured)
    out = {
        "output": {"dir": str(tmp_path / "out"), "checkpoint": True, "checkpoint_every_steps": 2}
    }
    # background: the read-ahead thread even on a one-core machine (auto would run inline)
    job = job_for(data_root, SURGE, train_mode="hybrid", sparse_placement="background", **out)
    with pytest.raises(TrainingStopped):
        Trainer(job, callbacks=[StopAt(7)]).fit()
    resumed = Trainer(job)
    resumed.load_checkpoint(tmp_path / "out")
    extra = resumed.fit().extra
    assert captures and all(captures)  # every checkpoint, under the lock
    assert drops and all(held for _, held in drops)
    assert {thread for thread, _ in drops} != {threading.current_thread().name}  # read-ahead
    assert extra["duplicate_rows"] == 0
    assert extra["rows_committed"] + extra["rows_dropped"] == HOURS * ROWS
    assert extra["progressive"]["rows"] == HOURS * ROWS


@pytest.mark.parametrize(
    ("buffer", "path", "words"),
    [
        ({"capacity_bytes": 1000}, "train.mixed_buffer.capacity_bytes", "at least 6400"),
        ({"capacity_bytes": 10**6, "policy": "lifo"}, "train.mixed_buffer.policy", ""),
        ({"capacity_bytes": 10**6, "offer_per_take": 0.5}, "train.mixed_buffer.offer_per_take", ""),
        ({"capacity_bytes": 10**6, "min_keep": 0}, "train.mixed_buffer.min_keep", ""),
        ({"capacity_bytes": 10**6, "importance": "grad"}, "train.mixed_buffer.importance", ""),
        ({"capacity_bytes": 10**6, "shed": "drop"}, "train.mixed_buffer.shed", ""),
        ({"capacity_bytes": 10**6, "loss_floor": 2}, "train.mixed_buffer.loss_floor", ""),
        ({"policy": "fifo"}, "train.mixed_buffer.capacity_bytes", "required"),
    ],
)
def test_bad_settings_name_their_field(
    data_root: Path, buffer: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        job_for(data_root, buffer)
    assert err.value.path == path
    assert words in str(err.value)


def test_source_weights_match_a_stream_or_a_stream_and_source() -> None:
    weights = StreamWeights({"live": 2.0, "live/feed2": 3.0})
    assert weights.get("live/feed", 1.0) == 2.0
    assert weights.get("live/feed2", 1.0) == 3.0
    assert weights.get("hist/synth", 1.0) == 1.0


def test_the_buffer_needs_a_dataset_job() -> None:
    with pytest.raises(ConfigError) as err:
        job_from_dict(
            {
                "data": {
                    "sources": [{"path": "x.tsv"}],
                    "schema": {"dense": ["I1"], "sparse": ["C1"]},
                },
                "train": {"mixed_buffer": {"capacity_bytes": 10**6}},
            }
        )
    assert err.value.path == "train.mixed_buffer"


def test_loss_importance_scores_rows_on_arrival_and_keeps_the_wrong_ones(data_root: Path) -> None:
    """``importance: loss``: each batch is scored by the model before the buffer
    takes it; rows kept are those the model gets wrong more often."""
    buffer = {**SURGE, "importance": "loss", "source_weights": {}}
    trainer = Trainer(job_for(data_root, buffer))
    predict = trainer.engine.predict
    offered: list[tuple[Batch, np.ndarray]] = []

    def scored(batch: Batch) -> np.ndarray:
        probs = predict(batch)
        offered.append((batch, probs))
        return probs

    trainer.engine.predict = scored  # type: ignore[method-assign]
    trained = record_trained(trainer)
    result = trainer.fit()
    assert_loss_importance(offered, trained, result, margin=0.01)  # 0.018 here; ~0 without


def record_trained(trainer: Trainer) -> set[int]:
    """The row ids the trainer's steps train (filled as it fits)."""
    trained: set[int] = set()
    inner = trainer.engine.step

    def step(batch: Batch, *args: Any, **kwargs: Any) -> float:
        assert batch.row_ids is not None
        trained.update(batch.row_ids.tolist())
        return inner(batch, *args, **kwargs)

    trainer.engine.step = step  # type: ignore[method-assign]
    return trained


def assert_loss_importance(
    offered: list[tuple[Batch, np.ndarray]], trained: set[int], result: Any, margin: float
) -> None:
    """Every row was scored once on arrival; those kept (trained) are the ones
    the model got wrong more often than those dropped, by ``margin`` in |y - p|."""
    assert sum(b.num_rows for b, _ in offered) == HOURS * ROWS  # every row, once
    ids = np.concatenate([b.row_ids for b, _ in offered if b.row_ids is not None])
    loss = np.concatenate([np.abs(b.labels - p) for b, p in offered])
    kept = np.isin(ids, np.fromiter(trained, np.int64))
    assert 0 < kept.sum() < kept.size and result.extra["rows_dropped"] == (~kept).sum()
    assert loss[kept].mean() > loss[~kept].mean() + margin
    assert result.extra["progressive"]["rows"] == HOURS * ROWS


def test_in_hybrid_mode_rows_are_scored_on_arrival_beside_the_step(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hybrid: rank 0 reads ahead on the prefetch thread while the step runs, and
    an ``ArrivalScorer`` scores each batch there with an eval twin bound to the
    live dense weights (the step's state untouched: the next test), every row is scored once,
    and ``importance: loss`` keeps the rows the model gets wrong."""
    buffer = {**SURGE, "importance": "loss", "source_weights": {}}
    trainer = Trainer(job_for(data_root, buffer, train_mode="hybrid"))
    offered: list[tuple[Batch, np.ndarray]] = []
    threads: set[str] = set()
    score = ArrivalScorer.__call__

    def scored(self: ArrivalScorer, batch: Batch) -> np.ndarray:
        probs = score(self, batch)
        offered.append((batch, probs))
        threads.add(threading.current_thread().name)
        return probs

    monkeypatch.setattr(ArrivalScorer, "__call__", scored)
    trained = record_trained(trainer)
    result = trainer.fit()
    assert threading.current_thread().name not in threads  # beside the step
    assert_loss_importance(offered, trained, result, margin=0.005)


def test_loss_importance_takes_several_trainers(data_root: Path) -> None:
    """Rank 0 holds the buffer for every rank and scores each row as it arrives."""
    job = job_for(data_root, {"capacity_bytes": 10**6, "importance": "loss"})
    feed = object.__new__(GraphFeed)  # only the settings check
    feed.progress = Progress()
    assert feed._mixed_source(job, 0, 2, False) is not None
    assert feed._mixed_source(job, 1, 2, False) is None


def test_an_arrival_score_leaves_the_step_in_progress_alone(data_root: Path) -> None:
    """Between a step's forward and its gradients (where the read-ahead thread
    may score a batch in hybrid mode) an ``ArrivalScorer`` call changes neither
    the live model's mode nor the gradients the step hands over; its scores are
    ``Engine.predict``'s."""
    trainer = Trainer(job_for(data_root, SURGE, train_mode="hybrid"))
    engine = trainer.engine
    rng = np.random.default_rng(0)

    def batch(low: int) -> Batch:  # ids of [low, low + 30) in every feature
        return Batch(
            labels=(rng.random(BATCH) < 0.3).astype(np.float32),
            dense=rng.random((BATCH, 2)).astype(np.float32),
            sparse={f: JaggedIds.single(rng.integers(low, low + 30, BATCH)) for f in FEATURES},
        )

    first, second = batch(0), batch(1000)
    # Rows for the second batch's ids exist (a lookup that trains inserts them).
    engine.lookup(second)
    scorer = ArrivalScorer(engine)
    engine.model.train()
    engine.embeddings.train()
    pooled, _ = engine.embeddings.embed(engine.lookup(first))  # a step's forward
    (pooled * 2.0).sum().backward()
    probs = scorer(second)
    assert engine.model.training and engine.embeddings.training
    grads = list(engine.embeddings.gradients())
    assert grads  # the first batch's ids, each with its gradient
    ids = np.unique(np.concatenate([g.ids for g in grads]))
    want = np.unique(np.concatenate([first.sparse[f].values for f in FEATURES]))
    np.testing.assert_array_equal(ids, want)
    assert all(np.all(g.grads != 0) for g in grads)
    np.testing.assert_allclose(probs, engine.predict(second), rtol=1e-6, atol=1e-7)


def test_an_arrival_scorer_reads_the_live_weights_without_copying_them(data_root: Path) -> None:
    """Each score uses the live dense tensors themselves (no per-batch copy of the
    model), so an optimizer step, or a restore that replaces the tensors, shows in
    the next score."""
    trainer = Trainer(job_for(data_root, SURGE, train_mode="hybrid"))
    engine = trainer.engine
    rng = np.random.default_rng(1)
    batch = Batch(
        labels=(rng.random(BATCH) < 0.3).astype(np.float32),
        dense=rng.random((BATCH, 2)).astype(np.float32),
        sparse={f: JaggedIds.single(rng.integers(0, 30, BATCH)) for f in FEATURES},
    )
    engine.lookup(batch)
    scorer = ArrivalScorer(engine)
    before = scorer(batch)
    live = dict(engine.model.named_parameters())
    twin = dict(scorer.model.named_parameters())
    assert twin and all(twin[n].data_ptr() == p.data_ptr() for n, p in live.items())
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # what an optimizer step does: in place
    stepped = scorer(batch)
    assert not np.allclose(stepped, before)
    np.testing.assert_allclose(stepped, engine.predict(batch), rtol=1e-6, atol=1e-7)
    replaced = {n: p.detach().clone() * 0.5 for n, p in engine.model.state_dict().items()}
    engine.model.load_state_dict(replaced, assign=True)  # new tensors, not in place
    np.testing.assert_allclose(scorer(batch), engine.predict(batch), rtol=1e-6, atol=1e-7)
    assert all(p.requires_grad for p in engine.model.parameters())
    assert not any(p.requires_grad for p in scorer.model.parameters())
