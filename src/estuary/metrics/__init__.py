"""Evaluation metrics and run reporting."""

from estuary.metrics.evaluation import EvalResult, evaluate_predictions, log_loss, roc_auc

__all__ = ["EvalResult", "evaluate_predictions", "log_loss", "roc_auc"]
