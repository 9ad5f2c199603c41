import numpy as np
import pytest

from estuary.metrics import evaluate_predictions, log_loss, roc_auc


def brute_force_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    pos = scores[labels == 1]
    neg = scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_pairwise_definition_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=300).astype(np.float32)
    scores = np.round(rng.random(300) + 0.3 * labels, 1)  # coarse -> many ties
    assert roc_auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_auc_extremes_and_single_class() -> None:
    labels = np.array([0, 0, 1, 1], dtype=np.float32)
    assert roc_auc(labels, np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert roc_auc(labels, np.array([0.9, 0.8, 0.2, 0.1])) == 0.0
    assert roc_auc(labels, np.full(4, 0.5)) == 0.5
    assert np.isnan(roc_auc(np.ones(3), np.array([0.1, 0.2, 0.3])))


def test_logloss_matches_formula_and_clips() -> None:
    y = np.array([1.0, 0.0, 1.0])
    p = np.array([0.9, 0.2, 0.6])
    expected = -np.mean(np.log([0.9, 0.8, 0.6]))
    assert log_loss(y, p) == pytest.approx(expected)
    assert np.isfinite(log_loss(np.array([1.0]), np.array([0.0])))


def test_eval_result_reports_calibration() -> None:
    result = evaluate_predictions(np.array([1.0, 0.0, 0.0, 0.0]), np.array([0.5, 0.5, 0.5, 0.5]))
    assert result.rows == 4
    assert result.label_mean == 0.25
    assert result.calibration == pytest.approx(2.0)
