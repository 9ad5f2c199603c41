"""The figures of one progressive-evaluation group (a window, an origin) in
bounded memory, and the run's windows, the recent ones at full resolution.

``GroupScores`` keeps every row (float32 probability + int8 label, 5 bytes)
while it has at most ``EXACT_ROWS``, so its AUC is exact; past that it bins them
into a ``ScoreHistogram`` (``SCORE_BINS`` bins, 1 MiB) and drops them. Rows and
the log-loss sum are exact float64 running sums throughout. ``Windows`` keeps
the ``OPEN_WINDOWS`` most recently recorded windows so; an older one is *folded*:
its figures are computed once, its rows or histogram replaced by a
``FOLDED_BINS`` histogram (4 KiB), kept in case a late row still arrives.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from estuary.metrics.evaluation import roc_auc
from estuary.metrics.histograms import SCORE_BINS, ScoreHistogram

__all__ = [
    "EXACT_ROWS",
    "FOLDED_BINS",
    "OPEN_WINDOWS",
    "GroupScores",
    "Windows",
    "log_loss_sum",
]

EXACT_ROWS = 1 << 18
"""Rows a group keeps one by one (1.25 MiB) before it turns to a histogram."""

OPEN_WINDOWS = 8
"""Windows kept at full resolution: the most recently recorded ones."""

FOLDED_BINS = 1 << 8
"""Bins of a folded window's histogram (2 x 256 int64 = 4 KiB)."""

LOGLOSS_EPS = 1e-7  # as metrics.evaluation.log_loss clips

Window = tuple[int, int]  # (start_s, end_s)


def log_loss_sum(labels: npt.NDArray[np.int8], probs: npt.NDArray[np.float32]) -> float:
    """Sum of the rows' binary cross-entropies, probabilities clipped as
    ``metrics.evaluation.log_loss`` does (float64)."""
    p = np.clip(np.asarray(probs, np.float64), LOGLOSS_EPS, 1.0 - LOGLOSS_EPS)
    y = labels > 0
    return float(-(np.log(p[y]).sum() + np.log1p(-p[~y]).sum()))


class GroupScores:
    """Rows, AUC and log loss of one group, in at most ~1.25 MiB.

    Args:
        bins: bins of the histogram it turns to past ``EXACT_ROWS`` rows.
    """

    def __init__(self, bins: int = SCORE_BINS) -> None:
        self.bins = bins
        self.rows = 0
        self.loss_sum = 0.0  # float64: sum of the rows' log losses
        self.labels: list[npt.NDArray[np.int8]] = []  # exact phase: the rows, in parts
        self.probs: list[npt.NDArray[np.float32]] = []
        self.histogram: ScoreHistogram | None = None  # past EXACT_ROWS (or folded)
        self.auc_at: tuple[int, float] | None = None  # (rows, auc) last computed

    @property
    def exact(self) -> bool:
        """Whether every row is still kept (the AUC is exact)."""
        return self.histogram is None

    @property
    def size_bytes(self) -> int:
        """Bytes of its arrays (rows kept, or histogram counts)."""
        kept = sum(a.nbytes for a in self.labels) + sum(a.nbytes for a in self.probs)
        return kept + (self.histogram.size_bytes if self.histogram is not None else 0)

    def add(
        self,
        labels: npt.NDArray[np.int8],
        probs: npt.NDArray[np.float32],
        loss_sum: float | None = None,
    ) -> None:
        """Rows ``labels`` (N,) in {0, 1} and their probabilities ``probs`` (N,);
        ``loss_sum``: their ``log_loss_sum`` when the caller has it already."""
        n = int(labels.shape[0])
        if n == 0:
            return
        self.rows += n
        self.loss_sum += log_loss_sum(labels, probs) if loss_sum is None else loss_sum
        if self.histogram is not None:
            self.histogram.add(labels, probs)
            return
        self.labels.append(labels)
        self.probs.append(np.asarray(probs, np.float32))
        if self.rows > EXACT_ROWS:
            self._to_histogram(self.bins)
        elif len(self.labels) > 64:  # few parts: a part's overhead is ~100 bytes
            self._merge()

    def _merge(self) -> None:
        if len(self.labels) > 1:
            self.labels = [np.concatenate(self.labels)]
            self.probs = [np.concatenate(self.probs)]

    def _to_histogram(self, bins: int) -> None:
        histogram = ScoreHistogram(bins)
        for labels, probs in zip(self.labels, self.probs, strict=True):
            histogram.add(labels, probs)
        self.labels, self.probs, self.histogram = [], [], histogram

    def auc(self) -> float:
        """Exact while every row is kept, else from the histogram (within its
        ``auc_bound``); computed again only when rows were added since."""
        if self.auc_at is not None and self.auc_at[0] == self.rows:
            return self.auc_at[1]
        if self.histogram is not None:
            auc = self.histogram.auc()
        elif self.rows:
            self._merge()  # one array to sort, now and next time
            auc = roc_auc(self.labels[0].astype(np.float64), self.probs[0])
        else:
            auc = math.nan
        self.auc_at = (self.rows, auc)
        return auc

    def logloss(self) -> float:
        return self.loss_sum / self.rows if self.rows else math.nan

    def fold(self, bins: int) -> None:
        """Keep the figures as they are now, in a ``bins``-bin histogram (a row
        added later is counted there, and the AUC then read from it)."""
        self.auc()  # at full resolution, kept until a row is added
        if self.histogram is None:
            self._to_histogram(bins)
        elif self.histogram.bins > bins:
            self.histogram = self.histogram.coarsened(bins)
        self.bins = bins


class Windows:
    """Event-time window -> ``GroupScores``: the ``OPEN_WINDOWS`` most recently
    recorded at full resolution, older ones folded (``FOLDED_BINS``).

    Memory: at most ``OPEN_WINDOWS`` x ~1.25 MiB, plus ~4.3 KiB a folded window.
    """

    def __init__(self) -> None:
        self.open: OrderedDict[Window, GroupScores] = OrderedDict()  # oldest record first
        self.folded: dict[Window, GroupScores] = {}
        self.newest_key: Window | None = None

    def get(self, window: Window) -> GroupScores:
        """The window's scores, marked as the most recently recorded (the least
        recent open one is folded when there are more than ``OPEN_WINDOWS``)."""
        scores = self.folded.get(window)
        if scores is not None:  # a late row: counted in the folded histogram
            return scores
        scores = self.open.get(window)
        if scores is None:
            scores = self.open[window] = GroupScores()
            if self.newest_key is None or window > self.newest_key:
                self.newest_key = window
        self.open.move_to_end(window)
        while len(self.open) > OPEN_WINDOWS:
            old, oldest = self.open.popitem(last=False)
            oldest.fold(FOLDED_BINS)
            self.folded[old] = oldest
        return scores

    def items(self) -> Iterator[tuple[Window, GroupScores]]:
        """Every window, in time order."""
        merged = {**self.folded, **self.open}
        for key in sorted(merged):
            yield key, merged[key]

    def newest(self) -> tuple[Window, GroupScores] | None:
        """The window with the latest start (ties: the latest end)."""
        key = self.newest_key
        if key is None:
            return None
        return key, self.open.get(key) or self.folded[key]

    def __len__(self) -> int:
        return len(self.open) + len(self.folded)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.open.values()) + sum(s.rows for s in self.folded.values())
