"""What a training run returns: ``FitResult`` (written as ``summary.json``), or
``TrainingStopped`` when a stop was asked of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from estuary.metrics.evaluation import EvalResult

__all__ = ["FitResult", "TrainingStopped"]


class TrainingStopped(Exception):
    """``fit`` stopped early on ``Trainer.request_stop`` (e.g. SIGTERM), after the
    step in progress and a checkpoint of it: ``--resume`` continues from there.

    Args:
        reason: what asked for the stop (e.g. ``SIGTERM``).
        step: the global step the run stopped after.
        checkpoint: the checkpoint written (None when the job writes none).
    """

    def __init__(self, reason: str, step: int, checkpoint: Path | None) -> None:
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
        super().__init__(f"stopped by {reason} after step {step}; {where}")
        self.reason, self.step, self.checkpoint = reason, step, checkpoint

    def __reduce__(self) -> tuple[type[TrainingStopped], tuple[str, int, Path | None]]:
        return TrainingStopped, (self.reason, self.step, self.checkpoint)  # crosses processes


@dataclass
class FitResult:
    """What a training run produced (also written as ``summary.json``).

    Args:
        eval: metrics on the eval split (``None`` when ``eval_fraction`` is 0).
        train_rows: training rows processed (over all epochs).
        eval_rows: rows in the eval split.
        bad_rows: malformed input rows skipped.
        samples_per_s: training rows per second of training-loop wall time.
        wall_s: whole run, data loading included.
        mode: ``train.mode``.
        checkpoint: the checkpoint folder written, if any.
        profile: per-stage seconds.
        extra: more figures (epochs, steps, table stats).
    """

    eval: EvalResult | None
    train_rows: int
    eval_rows: int
    bad_rows: int
    samples_per_s: float
    wall_s: float
    mode: str
    checkpoint: Path | None = None
    profile: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def auc(self) -> float:
        return self.eval.auc if self.eval else float("nan")

    @property
    def logloss(self) -> float:
        return self.eval.logloss if self.eval else float("nan")

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (NaN written as null)."""

        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        out: dict[str, Any] = {
            "auc": clean(self.auc),
            "logloss": clean(self.logloss),
            "train_rows": self.train_rows,
            "eval_rows": self.eval_rows,
            "bad_rows": self.bad_rows,
            "samples_per_s": self.samples_per_s,
            "wall_s": self.wall_s,
            "mode": self.mode,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
        }
        if self.eval is not None:
            out["calibration"] = clean(self.eval.calibration)
            out["label_mean"] = clean(self.eval.label_mean)
        out["profile"] = self.profile
        out.update(self.extra)
        return out
