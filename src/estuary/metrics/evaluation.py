"""Offline ranking metrics: ROC AUC, log loss, calibration.

All take numpy arrays: ``labels`` (R,) in {0, 1} and ``scores`` (R,) probabilities
(AUC only needs an order, so logits work there too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]


def roc_auc(labels: FloatArray, scores: FloatArray) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied scores given their
    average rank). O(R log R). NaN when only one class is present."""
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    positives = float(labels.sum())
    negatives = float(labels.shape[0]) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Average rank per run of tied scores: ranks are 1-based.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg_rank_per_run = first + (counts + 1) / 2.0
    ranks = np.repeat(avg_rank_per_run, counts)
    positive_rank_sum = float(ranks[labels[order] == 1].sum())
    u = positive_rank_sum - positives * (positives + 1) / 2.0
    return u / (positives * negatives)


def log_loss(labels: FloatArray, probabilities: FloatArray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy; probabilities clipped to ``[eps, 1 - eps]``."""
    y = np.asarray(labels, dtype=np.float64)
    p = np.clip(np.asarray(probabilities, dtype=np.float64), eps, 1.0 - eps)
    if y.shape[0] == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


@dataclass(frozen=True)
class EvalResult:
    """Metrics over one evaluation pass.

    Args:
        auc: ROC AUC.
        logloss: mean binary cross-entropy.
        rows: rows evaluated.
        label_mean: observed click rate.
        prediction_mean: mean predicted probability (calibration = prediction_mean / label_mean).
    """

    auc: float
    logloss: float
    rows: int
    label_mean: float
    prediction_mean: float

    @property
    def calibration(self) -> float:
        return self.prediction_mean / self.label_mean if self.label_mean else float("nan")


def evaluate_predictions(labels: FloatArray, probabilities: FloatArray) -> EvalResult:
    """AUC, log loss and calibration of ``probabilities`` against ``labels``."""
    rows = int(np.asarray(labels).shape[0])
    return EvalResult(
        auc=roc_auc(labels, probabilities),
        logloss=log_loss(labels, probabilities),
        rows=rows,
        label_mean=float(np.mean(labels)) if rows else float("nan"),
        prediction_mean=float(np.mean(probabilities)) if rows else float("nan"),
    )
