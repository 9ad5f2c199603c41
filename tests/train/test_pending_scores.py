"""PendingScores: arrival scores held by row id until the rows are committed."""

from __future__ import annotations

import numpy as np

from estuary.train.pending_scores import PendingScores


def test_rows_come_back_once_with_what_they_were_held_with() -> None:
    pending = PendingScores(capacity_rows=4)  # grows past its first arrays
    rng = np.random.default_rng(0)
    ids = rng.choice(np.iinfo(np.int64).max, 1000, replace=False).astype(np.int64)
    ids[0] = -7  # any int64 is a row id
    labels = rng.integers(0, 2, 1000).astype(np.int8)
    probs = rng.random(1000).astype(np.float32)
    new = rng.random(1000) < 0.3
    pending.hold(ids[:600], labels[:600], probs[:600], new[:600])
    pending.hold(ids[600:], labels[600:], probs[600:], new[600:])
    assert len(pending) == 1000
    asked = np.concatenate([ids[::-3], np.array([12345], np.int64)])  # one never held
    taken = pending.take(asked)
    order = {int(i): k for k, i in enumerate(ids)}
    at = np.array([order[int(i)] for i in taken.row_ids])
    assert taken.rows == ids[::-3].size and np.array_equal(taken.row_ids, ids[::-3])
    assert np.array_equal(taken.labels, labels[at]) and np.array_equal(taken.probs, probs[at])
    assert np.array_equal(taken.new, new[at])
    assert len(pending) == 1000 - taken.rows
    assert pending.take(ids[::-3]).rows == 0  # taken once only


def test_a_row_held_again_keeps_its_latest_score_and_slots_are_reused() -> None:
    pending = PendingScores(capacity_rows=8)
    ids = np.arange(8, dtype=np.int64)
    pending.hold(ids, np.zeros(8, np.int8), np.full(8, 0.1, np.float32), np.zeros(8, bool))
    pending.hold(ids[:2], np.ones(2, np.int8), np.full(2, 0.9, np.float32), np.ones(2, bool))
    taken = pending.take(ids[:3])
    assert taken.labels.tolist() == [1, 1, 0] and taken.new.tolist() == [True, True, False]
    assert np.allclose(taken.probs, [0.9, 0.9, 0.1])
    before = pending.nbytes
    for step in range(50):  # rows come and go: memory follows the rows waiting
        more = np.arange(100 + 8 * step, 108 + 8 * step, dtype=np.int64)
        pending.hold(more, np.zeros(8, np.int8), np.zeros(8, np.float32), np.zeros(8, bool))
        assert pending.take(more).rows == 8
    assert len(pending) == 5 and pending.nbytes <= 2 * before
