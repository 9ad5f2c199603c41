"""Progressive-evaluation figures in bounded memory: histogram AUC against the
exact one, memory that does not grow with rows, folded windows, lag quantiles,
and the checkpoint state's round trip."""

from __future__ import annotations

import numpy as np
import pytest

from estuary.metrics.evaluation import roc_auc
from estuary.metrics.histograms import (
    SCORE_BINS,
    LagHistogram,
    ScoreHistogram,
    weighted_quantiles,
)
from estuary.metrics.progressive import ProgressiveStats
from estuary.metrics.progressive_groups import EXACT_ROWS, FOLDED_BINS, OPEN_WINDOWS
from estuary.metrics.progressive_state import restore_stats, stats_arrays

HOUR = 3600


def scored(rows: int, click_rate: float, spread: float, seed: int) -> tuple[np.ndarray, ...]:
    """labels int8 (rows,), probabilities float32 (rows,): logits normal around
    the click rate's, ``spread`` wide, positives shifted up by half of it."""
    rng = np.random.default_rng(seed)
    labels = (rng.random(rows) < click_rate).astype(np.int8)
    base = np.log(click_rate / (1 - click_rate))
    logits = base + spread * (rng.standard_normal(rows) + 0.5 * labels)
    return labels, (1 / (1 + np.exp(-logits))).astype(np.float32)


@pytest.mark.parametrize(
    ("click_rate", "spread"),
    [(0.5, 1.0), (0.01, 0.5)],  # balanced; skewed: 1% positives, logits packed 2x tighter
)
def test_histogram_auc_is_within_its_bound_of_the_exact_auc(
    click_rate: float, spread: float
) -> None:
    labels, probs = scored(400_000, click_rate, spread, seed=3)
    histogram = ScoreHistogram()
    for part in range(4):  # in parts, as steps add them
        rows = slice(part * 100_000, (part + 1) * 100_000)
        histogram.add(labels[rows], probs[rows])
    exact = roc_auc(labels.astype(np.float64), probs)
    bound = histogram.auc_bound()
    assert abs(histogram.auc() - exact) <= bound
    assert abs(histogram.auc() - exact) < 1e-4 and bound < 2e-4
    assert histogram.counts.shape == (2, SCORE_BINS)


def test_histogram_auc_orders_distinct_bins_exactly() -> None:
    #   scores:    0.1  0.2  0.8  0.9     in four far-apart bins
    #   labels:     0    1    0    1      3 of 4 (pos, neg) pairs ordered: 0.75
    histogram = ScoreHistogram()
    histogram.add(np.array([0, 1, 0, 1], np.int8), np.array([0.1, 0.2, 0.8, 0.9], np.float32))
    assert histogram.auc() == 0.75 and histogram.auc_bound() == 0.0
    assert histogram.coarsened(2).auc() == 0.5  # two bins: (0.1, 0.2) and (0.8, 0.9) tie


def test_memory_does_not_grow_with_rows_and_old_windows_fold() -> None:
    stats = ProgressiveStats("all rows")
    rows_per_window, batch = 40_000, 10_000

    def run_windows(first: int, count: int) -> None:
        for w in range(first, first + count):
            for b in range(rows_per_window // batch):
                labels, probs = scored(batch, 0.2, 1.0, seed=w * 100 + b)
                window = (w * HOUR, (w + 1) * HOUR)
                stats.record(window, ["hist/a"], labels, probs, lag_s=60.0 * w)
                stats.record_origin("new_ids", labels[:5000], probs[:5000])

    run_windows(0, 20)  # 800,000 rows: both origins past EXACT_ROWS
    assert stats.rows == 20 * rows_per_window > EXACT_ROWS
    size = stats.size_bytes
    origin_bytes = 2 * SCORE_BINS * 8
    assert all(
        o.histogram is not None and o.size_bytes == origin_bytes for o in stats.origins.values()
    )
    assert (
        len(stats.windows.open) == OPEN_WINDOWS and len(stats.windows.folded) == 20 - OPEN_WINDOWS
    )
    folded_bytes = 2 * FOLDED_BINS * 8
    assert all(s.size_bytes == folded_bytes for s in stats.windows.folded.values())
    run_windows(20, 20)  # as many rows again: only 20 more folded windows
    assert stats.size_bytes - size == 20 * folded_bytes
    assert stats.lags.counts.shape == LagHistogram().counts.shape
    report = stats.report()
    assert [w["rows"] for w in report["windows"]] == [rows_per_window] * 40
    assert report["origins"]["hist/a"]["rows"] == 40 * rows_per_window


def test_a_folded_window_keeps_its_exact_auc_and_counts_late_rows() -> None:
    stats = ProgressiveStats("all rows")
    labels, probs = scored(5000, 0.3, 1.0, seed=7)
    stats.record((0, HOUR), ["hist/a"], labels, probs, lag_s=None)
    for w in range(1, OPEN_WINDOWS + 1):  # newer windows push the first out
        stats.record((w * HOUR, (w + 1) * HOUR), ["hist/a"], labels[:10], probs[:10], None)
    first = stats.windows.folded[(0, HOUR)]
    assert first.auc() == roc_auc(labels.astype(np.float64), probs)  # exact, as folded
    late_labels, late_probs = scored(1000, 0.3, 1.0, seed=8)
    stats.record((0, HOUR), ["hist/a"], late_labels, late_probs, None)
    assert first.rows == 6000 and first.histogram is not None
    exact = roc_auc(
        np.concatenate([labels, late_labels]).astype(np.float64),
        np.concatenate([probs, late_probs]),
    )
    assert abs(first.auc() - exact) <= first.histogram.auc_bound()


def test_lag_quantiles_are_within_a_bin_of_the_exact_ones() -> None:
    rng = np.random.default_rng(0)
    lags = np.concatenate([rng.exponential(30.0, 500), rng.exponential(3e7, 500), [-4.0]])
    rows = rng.integers(1, 100, lags.shape[0])
    histogram = LagHistogram()
    for lag, n in zip(lags, rows, strict=True):
        histogram.add(float(lag), int(n))
    want = weighted_quantiles(lags, rows, (0.01, 0.5, 0.99))
    for got, exact in zip(histogram.quantiles((0.01, 0.5, 0.99)), want, strict=True):
        assert abs(got - exact) <= 0.0055 * (1 + abs(exact))
    single = LagHistogram()
    single.add(1234.5, 7)
    assert single.quantiles((0.5, 0.99)) == [1234.5, 1234.5]


def test_the_saved_state_restores_the_same_figures_and_goes_on_alike() -> None:
    stats = ProgressiveStats("all rows")
    for w in range(OPEN_WINDOWS + 3):  # folded and open windows
        labels, probs = scored(3000, 0.2, 1.0, seed=w)
        stats.record((w * HOUR, (w + 1) * HOUR), ["hist/a"], labels, probs, lag_s=5.0 * w)
    big_labels, big_probs = scored(EXACT_ROWS + 1, 0.2, 1.0, seed=99)
    stats.record_origin("live/b", big_labels, big_probs)  # a histogram
    stats.record_origin("new_ids", big_labels[:0], big_probs[:0])  # nothing: not created
    stats.record_lag(-2.0, 10, ["live/b"])
    restored = ProgressiveStats("all rows")
    restore_stats(restored, stats_arrays(stats))
    assert restored.report() == stats.report()
    labels, probs = scored(2000, 0.2, 1.0, seed=50)
    for s in (stats, restored):
        s.record((0, HOUR), ["hist/a"], labels, probs, lag_s=1.0)  # a late row, folded
        s.record((20 * HOUR, 21 * HOUR), ["hist/a"], labels, probs, lag_s=1.0)
    assert restored.report() == stats.report()


def test_a_state_of_another_format_is_refused_naming_it() -> None:
    arrays = stats_arrays(ProgressiveStats("all rows"))
    arrays["index"] = np.frombuffer(b'{"format": 99}', np.uint8).copy()
    with pytest.raises(ValueError, match="progressive state: format 99"):
        restore_stats(ProgressiveStats("all rows"), arrays)
    del arrays["index"]
    with pytest.raises(ValueError, match="array 'index' is missing"):
        restore_stats(ProgressiveStats("all rows"), arrays)
