"""Fixed-size histograms for figures over unboundedly many rows: AUC from
per-class score counts, quantiles from counts on a log scale.

Both hold int64 counts whose size is set at construction, never by the rows
added, so memory is constant however long a run lasts (docs/mixture.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

__all__ = [
    "LAG_BINS_PER_OCTAVE",
    "LOGIT_RANGE",
    "SCORE_BINS",
    "LagHistogram",
    "ScoreHistogram",
    "weighted_quantiles",
]

SCORE_BINS = 1 << 16
"""Bins of a full ``ScoreHistogram``: 2 classes x 65,536 int64 counts = 1 MiB."""

LOGIT_RANGE = 16.0
"""Scores are binned on their logit, uniformly over [-16, 16] (a bin is 1/2048 of
a logit wide at ``SCORE_BINS``); rarer logits land in the end bins. A float32
probability below 1 has a logit of at most ~16.6."""

LAG_BINS_PER_OCTAVE = 64
"""``LagHistogram`` resolution: 64 bins per doubling of ``1 + |lag|`` (a bin's
centre is within 0.55% of ``1 + |lag|`` of any lag in it)."""

LAG_OCTAVES = 40
"""Lags up to 2**40 s (~35,000 years) either side of zero; larger ones clip."""


def weighted_quantiles(
    values: npt.NDArray[np.float64], weights: npt.NDArray[np.int64], qs: Iterable[float]
) -> list[float]:
    """Quantiles of ``values`` (N,) each counted ``weights`` (N,) times: the
    smallest value whose cumulative weight reaches ``q`` of the total."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    total = int(cumulative[-1])
    out = []
    for q in qs:
        at = int(np.searchsorted(cumulative, q * total, side="left"))
        out.append(float(values[order][min(at, order.shape[0] - 1)]))
    return out


def _count_into(counts: npt.NDArray[np.int64], index: npt.NDArray[np.intp]) -> None:
    """``counts[i] += 1`` for each ``i`` in ``index`` (repeats counted)."""
    if index.shape[0] * 16 < counts.shape[0]:  # few rows: no (bins,) temporary
        np.add.at(counts, index, 1)
    else:
        counts += np.bincount(index, minlength=counts.shape[0])


class ScoreHistogram:
    """Per-class counts of scores binned on their logit, for AUC.

    ``counts`` is int64 (2, bins): row 0 negatives, row 1 positives; bin ``b``
    holds logits in ``[-R + b w, -R + (b + 1) w)``, ``w = 2 R / bins``,
    ``R = LOGIT_RANGE``. Binning is monotone in the score, so pairs in different
    bins are ordered exactly; pairs within one bin count 1/2 (as ties do).

    Args:
        bins: number of bins (a power of two, so ``coarsened`` nests).
    """

    def __init__(self, bins: int = SCORE_BINS) -> None:
        if bins < 2 or bins & (bins - 1):
            raise ValueError(f"bins: must be a power of two >= 2, got {bins}")
        self.counts = np.zeros((2, bins), np.int64)

    @property
    def bins(self) -> int:
        return int(self.counts.shape[1])

    @property
    def size_bytes(self) -> int:
        return int(self.counts.nbytes)

    def add(self, labels: npt.NDArray[np.int8], probs: npt.NDArray[np.float32]) -> None:
        """Count rows: ``labels`` (N,) in {0, 1}, ``probs`` (N,) probabilities."""
        if probs.shape[0] == 0:
            return
        p = np.asarray(probs, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            logit = np.log(p) - np.log1p(-p)  # (N,) +-inf at 1 and 0
        logit = np.nan_to_num(logit, nan=0.0, posinf=LOGIT_RANGE, neginf=-LOGIT_RANGE)
        scaled = (logit + LOGIT_RANGE) * (self.bins / (2 * LOGIT_RANGE))
        index = np.clip(np.floor(scaled), 0, self.bins - 1).astype(np.intp)  # (N,)
        index += self.bins * (np.asarray(labels) > 0)  # (N,) into counts viewed flat
        _count_into(self.counts.reshape(-1), index)

    def auc(self) -> float:
        """ROC AUC of the counted rows, pairs sharing a bin counted 1/2; NaN with
        one class only. Off the exact AUC by at most ``auc_bound()``."""
        negatives, positives = self.counts.astype(np.float64)
        n, p = float(negatives.sum()), float(positives.sum())
        if n == 0 or p == 0:
            return math.nan
        below = np.cumsum(negatives) - negatives  # (bins,) negatives in lower bins
        return float((positives * (below + 0.5 * negatives)).sum() / (n * p))

    def auc_bound(self) -> float:
        """The most ``auc()`` can differ from the exact AUC: half the share of
        (positive, negative) pairs that fall in one bin. NaN with one class."""
        negatives, positives = self.counts.astype(np.float64)
        n, p = float(negatives.sum()), float(positives.sum())
        if n == 0 or p == 0:
            return math.nan
        return float(0.5 * (positives * negatives).sum() / (n * p))

    def coarsened(self, bins: int) -> ScoreHistogram:
        """The same rows in ``bins`` bins (fewer; each merges whole bins)."""
        if bins > self.bins or self.bins % bins:
            raise ValueError(f"bins: {bins} does not divide {self.bins}")
        out = ScoreHistogram(bins)
        out.counts = self.counts.reshape(2, bins, self.bins // bins).sum(axis=2)
        return out


class LagHistogram:
    """Row counts of lags (seconds, any sign) on a signed log scale, for quantiles.

    A lag ``v`` goes to the bin of ``t = sign(v) log2(1 + |v|)``, ``t`` in
    ``[-LAG_OCTAVES, LAG_OCTAVES]`` cut in ``LAG_BINS_PER_OCTAVE`` bins an octave:
    int64 (2 x 40 x 64,) = 40 KiB. The exact smallest and largest lag are kept,
    and a quantile is clamped to them (so a single lag reads exactly).
    """

    BINS = 2 * LAG_OCTAVES * LAG_BINS_PER_OCTAVE

    def __init__(self) -> None:
        self.counts = np.zeros(self.BINS, np.int64)
        self.low, self.high = math.inf, -math.inf

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def add(self, lag_s: float, rows: int) -> None:
        """``rows`` rows, each ``lag_s`` seconds."""
        t = math.copysign(math.log2(1.0 + abs(lag_s)), lag_s)
        b = math.floor((t + LAG_OCTAVES) * LAG_BINS_PER_OCTAVE)
        self.counts[min(max(b, 0), self.BINS - 1)] += rows
        self.low, self.high = min(self.low, lag_s), max(self.high, lag_s)

    def quantiles(self, qs: Iterable[float]) -> list[float]:
        """Row-weighted quantiles: the centre of the bin where the cumulative
        count reaches ``q`` of the total (clamped to the smallest and largest
        lag); NaN when empty."""
        qs = list(qs)
        filled = np.flatnonzero(self.counts)
        if filled.shape[0] == 0:
            return [math.nan for _ in qs]
        t = (filled + 0.5) / LAG_BINS_PER_OCTAVE - LAG_OCTAVES  # (K,) bin centres
        centres = np.sign(t) * (np.exp2(np.abs(t)) - 1.0)
        got = weighted_quantiles(centres, self.counts[filled], qs)
        return [min(max(v, self.low), self.high) for v in got]
