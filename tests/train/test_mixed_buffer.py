"""The mixed buffer: bounded bytes, importance-weighted sampling (unbiased),
priority order, fifo backpressure, per-source counts and metrics."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from estuary.data.types import Batch, JaggedIds
from estuary.train.mixed_buffer import BufferPolicy, MixedBuffer, MixedBufferCollector, row_bytes


def make_batch(rng: np.random.Generator, n: int, ctr: float = 0.2, start: int = 0) -> Batch:
    return Batch(
        labels=(rng.random(n) < ctr).astype(np.float32),
        dense=np.arange(start, start + n, dtype=np.float32)[:, None],  # row number
        sparse={"c": JaggedIds.single(rng.integers(0, 100, n))},
    )


def test_row_bytes_count_labels_dense_ids_and_offsets() -> None:
    batch = Batch(
        labels=np.zeros(2, np.float32),
        dense=np.zeros((2, 3), np.float32),
        sparse={"a": JaggedIds(values=np.arange(3), offsets=np.array([0, 2, 3]))},
    )
    assert row_bytes(batch).tolist() == [4 + 4 + 12 + 8 + 16, 4 + 4 + 12 + 8 + 8]


@pytest.mark.parametrize("policy", ["priority", "uniform"])
def test_a_surge_stays_within_capacity_and_every_row_is_accounted_for(policy: str) -> None:
    rng = np.random.default_rng(0)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    buffer = MixedBuffer(BufferPolicy(capacity_bytes=500 * per_row, policy=policy))  # type: ignore[arg-type]
    taken = 0
    for step in range(100):
        buffer.offer(make_batch(rng, 1000 if 20 <= step < 40 else 50), "stream")
        batch = buffer.take(100)
        taken += batch.num_rows if batch is not None else 0
        assert buffer.bytes <= 500 * per_row
    c = buffer.counts["stream"]
    assert buffer.peak_bytes <= 500 * per_row
    assert c["offered"] == 80 * 50 + 20 * 1000
    assert c["offered"] == c["kept"] + c["sampled_out"]
    assert c["kept"] == c["taken"] + c["evicted"] + buffer.rows
    assert c["taken"] == taken and c["sampled_out"] > 10_000  # shed, not stalled


def test_importance_weights_keep_the_weighted_label_sum_unbiased() -> None:
    """Sampled with q_i (positives 4x as important), kept rows weigh 1 / q_i:
    the weighted sum of kept labels estimates the offered one (no evictions)."""
    rng = np.random.default_rng(1)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    buffer = MixedBuffer(
        BufferPolicy(
            capacity_bytes=3000 * per_row,
            label_weight=4.0,
            high_water=0.2,
            normalize_weights=False,
            seed=3,
        )
    )
    offered = weighted = 0.0
    kept_pos = kept_neg = off_pos = off_neg = 0
    for _ in range(300):
        batch = make_batch(rng, 1000)
        offered += float(batch.labels.sum())
        off_pos += int(batch.labels.sum())
        off_neg += int((batch.labels == 0).sum())
        buffer.offer(batch, "s")
        out = buffer.take(700)  # slower than the offers: the buffer fills
        assert out is not None and out.weights is not None
        weighted += float((out.weights * out.labels).sum())
        kept_pos += int(out.labels.sum())
        kept_neg += int((out.labels == 0).sum())
    while (out := buffer.take(1000)) is not None:
        assert out.weights is not None
        weighted += float((out.weights * out.labels).sum())
    assert buffer.counts["s"]["evicted"] == 0
    assert kept_neg / off_neg < 0.9  # sampled down ...
    assert kept_pos / off_pos > kept_neg / off_neg + 0.1  # ... positives less
    assert weighted == pytest.approx(offered, rel=0.03)


def test_take_scales_a_batch_s_weights_to_mean_one_by_default() -> None:
    rng = np.random.default_rng(5)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    buffer = MixedBuffer(BufferPolicy(capacity_bytes=1500 * per_row, label_weight=3.0))
    for _ in range(5):
        buffer.offer(make_batch(rng, 1000), "s")
        out = buffer.take(300)
        assert out is not None and out.weights is not None
        assert float(out.weights.mean()) == pytest.approx(1.0, rel=1e-5)
    assert buffer.counts["s"]["sampled_out"] > 0


def test_priority_takes_important_and_recent_rows_first_and_counts_the_delayed() -> None:
    rng = np.random.default_rng(2)
    buffer = MixedBuffer(
        BufferPolicy(capacity_bytes=10**6, source_weights={"history": 0.25}, half_life_rows=100)
    )
    buffer.offer(make_batch(rng, 50, start=0), "history")
    buffer.offer(make_batch(rng, 50, start=1000), "stream")
    first = buffer.take(50)
    assert first is not None and first.origin == "stream"  # the stream outranks history
    assert first.dense[:, 0].min() >= 1000
    assert buffer.counts["history"]["delayed"] == 50
    second = buffer.take(50)
    assert second is not None and second.origin == "history"
    assert buffer.take(10) is None


def test_fifo_never_drops_and_pushes_back_when_full() -> None:
    rng = np.random.default_rng(3)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    buffer = MixedBuffer(BufferPolicy(capacity_bytes=120 * per_row, policy="fifo"))
    assert buffer.offer(make_batch(rng, 100), "s") == 100
    assert buffer.offer(make_batch(rng, 100, start=100), "s") == 20  # the rest waits
    out = buffer.take(50)
    assert out is not None and out.dense[:, 0].tolist() == list(range(50))  # oldest first
    assert out.weights is not None and np.all(out.weights == 1)
    c = buffer.counts["s"]
    assert c["sampled_out"] == c["evicted"] == 0 and c["offered"] == 120


def test_metrics_export_the_counts_per_source() -> None:
    rng = np.random.default_rng(4)
    buffer = MixedBuffer(BufferPolicy(capacity_bytes=10**6))
    buffer.offer(make_batch(rng, 30), "stream")
    buffer.take(10)
    registry = CollectorRegistry()
    registry.register(MixedBufferCollector(buffer))
    value = registry.get_sample_value
    assert value("estuary_mixed_rows_total", {"source": "stream", "what": "offered"}) == 30
    assert value("estuary_mixed_rows_total", {"source": "stream", "what": "taken"}) == 10
    assert value("estuary_mixed_buffer_bytes", {"kind": "now"}) == buffer.bytes > 0


def test_bad_policies_name_their_field() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        BufferPolicy(capacity_bytes=0)
    with pytest.raises(ValueError, match="policy"):
        BufferPolicy(capacity_bytes=1, policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"source_weights\['x'\]"):
        BufferPolicy(capacity_bytes=1, source_weights={"x": 0})


def test_loss_importance_keeps_the_rows_the_model_gets_wrong_and_stays_unbiased() -> None:
    """``importance_from="loss"``: q_i grows with |y_i - p_i| (p_i: the row's
    score on arrival); the kept rows' 1 / q weights keep the weighted label sum
    unbiased, and rows scored near their label are kept less often."""
    rng = np.random.default_rng(6)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    buffer = MixedBuffer(
        BufferPolicy(
            capacity_bytes=3000 * per_row,
            importance_from="loss",
            high_water=0.2,
            normalize_weights=False,
            seed=4,
        )
    )
    offered = weighted = 0.0
    kept_easy = kept_hard = off_easy = off_hard = 0
    for _ in range(150):
        batch = make_batch(rng, 1000)
        hard = rng.random(1000) < 0.3  # the model gets these wrong
        scores = np.where(hard, 1 - batch.labels, batch.labels) * 0.9 + 0.05
        batch = Batch(batch.labels, hard[:, None].astype(np.float32), batch.sparse)
        offered += float(batch.labels.sum())
        off_hard += int(hard.sum())
        off_easy += int((~hard).sum())
        buffer.offer(batch, "s", scores)
        out = buffer.take(700)
        assert out is not None and out.weights is not None
        weighted += float((out.weights * out.labels).sum())
        kept_hard += int(out.dense[:, 0].sum())
        kept_easy += int((out.dense[:, 0] == 0).sum())
    while (out := buffer.take(1000)) is not None:
        assert out.weights is not None
        weighted += float((out.weights * out.labels).sum())
    assert buffer.counts["s"]["evicted"] == 0
    assert kept_hard / off_hard > kept_easy / off_easy + 0.2
    assert weighted == pytest.approx(offered, rel=0.03)


def test_loss_importance_needs_the_scores() -> None:
    rng = np.random.default_rng(7)
    buffer = MixedBuffer(BufferPolicy(capacity_bytes=10**6, importance_from="loss"))
    with pytest.raises(ValueError, match=r"scores=\) of shape \(10,\), got None"):
        buffer.offer(make_batch(rng, 10), "s")
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        buffer.offer(make_batch(rng, 10), "s", np.zeros(3))


def test_shed_evict_admits_every_row_and_evicts_the_oldest_over_capacity() -> None:
    """Delay before drop: nothing is sampled out, rows weigh 1, the buffer never
    exceeds its bytes, and what a surge overflows is the oldest rows."""
    rng = np.random.default_rng(8)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    buffer = MixedBuffer(BufferPolicy(capacity_bytes=300 * per_row, shed="evict"))
    buffer.offer(make_batch(rng, 250, start=0), "s")
    assert buffer.counts["s"]["sampled_out"] == 0 and buffer.rows == 250
    buffer.offer(make_batch(rng, 250, start=250), "s")  # 500 rows, room for 300
    c = buffer.counts["s"]
    assert c["sampled_out"] == 0 and c["evicted"] == 200
    assert buffer.bytes <= 300 * per_row and buffer.peak_bytes <= 300 * per_row
    rows = []
    while (out := buffer.take(100)) is not None:
        assert out.weights is not None and np.all(out.weights == 1)
        rows.extend(out.dense[:, 0].tolist())
    assert sorted(rows) == list(range(200, 500))  # the oldest 200 went
    assert rows[:100] == list(range(400, 500))  # the newest first (priority)


def test_bad_loss_and_shed_settings_name_their_field() -> None:
    with pytest.raises(ValueError, match="importance_from"):
        BufferPolicy(capacity_bytes=1, importance_from="gradient")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_floor"):
        BufferPolicy(capacity_bytes=1, loss_floor=0)
    with pytest.raises(ValueError, match="shed"):
        BufferPolicy(capacity_bytes=1, shed="drop")  # type: ignore[arg-type]


def test_max_age_drops_rows_that_waited_too_long_instead_of_training_them_late() -> None:
    rng = np.random.default_rng(3)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    policy = BufferPolicy(capacity_bytes=10_000 * per_row, max_age_rows=250)
    buffer = MixedBuffer(policy)
    first = make_batch(rng, 100)
    first = Batch(first.labels, first.dense, first.sparse, np.arange(100, dtype=np.int64))
    buffer.offer(first, "stream")  # nothing taken: these 100 rows wait
    later = make_batch(rng, 200, start=100)
    later = Batch(later.labels, later.dense, later.sparse, np.arange(100, 300, dtype=np.int64))
    buffer.offer(later, "stream")
    # rows 0..49 had 250+ rows offered after them: expired at the take
    batch = buffer.take(400)
    assert batch is not None and batch.row_ids is not None
    assert sorted(batch.row_ids.tolist()) == list(range(50, 300))
    assert sorted(buffer.pop_dropped().tolist()) == list(range(50))
    c = buffer.counts["stream"]
    assert c["expired"] == 50 and c["taken"] == 250
    assert c["kept"] == c["taken"] + c["expired"] + c["evicted"] + buffer.rows


def test_a_kept_rows_age_counts_the_rows_sampled_out_after_it_in_its_offer() -> None:
    """Under pressure most of an offer is sampled out; a kept row near its start
    has the rest of the offer after it, so it expires before one near its end."""
    rng = np.random.default_rng(4)
    per_row = int(row_bytes(make_batch(rng, 1))[0])
    buffer = MixedBuffer(
        BufferPolicy(capacity_bytes=200 * per_row, high_water=0.0, max_age_rows=500, seed=1)
    )
    surge = make_batch(rng, 1000)
    surge = Batch(surge.labels, surge.dense, surge.sparse, np.arange(1000, dtype=np.int64))
    buffer.offer(surge, "stream")  # sampled down: a few rows of each part of the offer kept
    batch = buffer.take(1000)
    assert batch is not None and batch.row_ids is not None
    assert batch.row_ids.min() >= 500  # the kept rows of the first half expired
    assert (buffer.pop_dropped() < 500).any()
    assert buffer.counts["stream"]["expired"] > 0


def test_max_age_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_age_rows"):
        BufferPolicy(capacity_bytes=1, max_age_rows=0)
