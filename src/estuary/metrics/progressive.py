"""Progressive (predict-then-train) evaluation figures: AUC / logloss per event-time
window and per origin, and the event -> trained lag.

``ProgressiveStats`` only accumulates what the training loop hands it (labels and
the probabilities the model gave each row *before* training on it, grouped by
window and origin); ``estuary.train.progressive`` decides the groups. Memory is
bounded whatever the rows (``progressive_groups``): a group keeps its rows (5
bytes each, exact AUC) up to ``EXACT_ROWS``, then a score histogram (1 MiB, AUC
within ``ScoreHistogram.auc_bound``); windows past the ``OPEN_WINDOWS`` most
recently recorded are folded to their figures; lags go to a log-scale
histogram. ``progressive_state`` saves and restores all of it with checkpoints.

Prometheus (``ProgressiveCollector``, rendered at scrape time from the stats):
``estuary_progressive_rows_total{origin}``, ``estuary_progressive_auc{origin}``
and ``estuary_progressive_logloss{origin}`` (over every row of the origin so far),
``estuary_progressive_window_auc`` / ``_window_rows`` / ``_window_start_timestamp_seconds``
(the newest window), and ``estuary_progressive_lag_seconds{quantile}``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from estuary.metrics.histograms import LagHistogram, weighted_quantiles
from estuary.metrics.progressive_groups import GroupScores, Window, Windows, log_loss_sum

__all__ = [
    "NEW_IDS",
    "ProgressiveCollector",
    "ProgressiveStats",
    "format_report",
    "weighted_quantiles",
]

NEW_IDS = "new_ids"
"""The origin bucket of rows holding an id never seen before (see docs/mixture.md)."""

LAG_QUANTILES = (0.5, 0.99)


def _figures(scores: GroupScores) -> dict[str, Any]:
    return {"rows": scores.rows, "auc": _num(scores.auc()), "logloss": _num(scores.logloss())}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ProgressiveStats:
    """Progressive AUC / logloss per event-time window and per origin, and lag,
    in memory independent of the rows (see module docstring).

    Args:
        scope: a line saying whose rows these are (e.g. rank 0's share).
    """

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.lock = threading.Lock()  # the training thread appends, a scrape reads
        self.windows = Windows()
        self.origins: dict[str, GroupScores] = {}
        self.lags = LagHistogram()  # every row's
        self.origin_lags: dict[str, LagHistogram] = {}

    def record(
        self,
        window: Window,
        origins: Iterable[str],
        labels: npt.NDArray[np.int8],
        probs: npt.NDArray[np.float32],
        lag_s: float | None,
    ) -> None:
        """Rows of one window (B,) predicted before training: counted in the window,
        in each of ``origins``, and in the lag (``lag_s`` for each of them;
        ``None``: not yet trained, ``record_lag`` files it when they are)."""
        origins = list(origins)
        loss = log_loss_sum(labels, probs)  # once for the window and each origin
        with self.lock:
            self.windows.get(window).add(labels, probs, loss)
            for origin in origins:
                self.origins.setdefault(origin, GroupScores()).add(labels, probs, loss)
            if lag_s is not None:
                self._add_lag(lag_s, int(labels.shape[0]), origins)

    def record_lag(self, lag_s: float, rows: int, origins: Iterable[str]) -> None:
        """``rows`` trained rows of ``origins``, each ``lag_s`` after its event time."""
        with self.lock:
            self._add_lag(lag_s, int(rows), list(origins))

    def _add_lag(self, lag_s: float, rows: int, origins: list[str]) -> None:
        for origin in origins:
            self.origin_lags.setdefault(origin, LagHistogram()).add(lag_s, rows)
        self.lags.add(lag_s, rows)

    def record_origin(
        self, origin: str, labels: npt.NDArray[np.int8], probs: npt.NDArray[np.float32]
    ) -> None:
        """Rows counted in one more origin only (e.g. the new-ids bucket)."""
        if labels.shape[0]:
            with self.lock:
                self.origins.setdefault(origin, GroupScores()).add(labels, probs)

    @property
    def rows(self) -> int:
        return self.windows.rows

    @property
    def size_bytes(self) -> int:
        """Bytes of every array held (rows kept, histograms)."""
        groups = [s for _, s in self.windows.items()] + list(self.origins.values())
        lags = [self.lags, *self.origin_lags.values()]
        return sum(g.size_bytes for g in groups) + sum(h.counts.nbytes for h in lags)

    def lag_quantiles(self, origin: str | None = None) -> list[float]:
        """Event -> trained lag (s) at ``LAG_QUANTILES``, row-weighted, of every row
        or of ``origin``'s (within 0.55% of ``1 + lag``); NaN when empty."""
        lags = self.lags if origin is None else self.origin_lags.get(origin)
        if lags is None:
            return [math.nan for _ in LAG_QUANTILES]
        return lags.quantiles(LAG_QUANTILES)

    def newest_window(self) -> tuple[Window, GroupScores] | None:
        return self.windows.newest()

    def report(self) -> dict[str, Any]:
        """For summary.json: ``windows`` (time order), ``origins``, ``lag_s``."""
        with self.lock:
            return self._report()

    def _report(self) -> dict[str, Any]:
        p50, p99 = self.lag_quantiles()
        return {
            "scope": self.scope,
            "rows": self.rows,
            "windows": [
                {"start": _iso(start), "end": _iso(end), **_figures(scores)}
                for (start, end), scores in self.windows.items()
            ],
            "origins": {name: _figures(s) for name, s in sorted(self.origins.items())},
            "lag_s": {
                "p50": _num(p50),
                "p99": _num(p99),
                "from": "window_end",
                "by_origin": {
                    name: dict(
                        zip(("p50", "p99"), map(_num, self.lag_quantiles(name)), strict=True)
                    )
                    for name in sorted(self.origin_lags)
                },
            },
        }


class ProgressiveCollector(Collector):
    """Renders ``ProgressiveStats`` at scrape time (see module docstring)."""

    def __init__(self, stats: ProgressiveStats) -> None:
        self.stats = stats

    def describe(self) -> Iterable[Metric]:
        yield from self._families(False)

    def collect(self) -> Iterable[Metric]:
        yield from self._families(True)

    def _families(self, fill: bool) -> Iterator[Metric]:
        rows = CounterMetricFamily(
            "estuary_progressive_rows",
            "Rows scored before training on them, per origin (rank 0's share).",
            labels=["origin"],
        )
        auc = GaugeMetricFamily(
            "estuary_progressive_auc",
            "Progressive (predict-then-train) AUC of every row of the origin so far.",
            labels=["origin"],
        )
        logloss = GaugeMetricFamily(
            "estuary_progressive_logloss",
            "Progressive log loss of every row of the origin so far.",
            labels=["origin"],
        )
        w_auc = GaugeMetricFamily(
            "estuary_progressive_window_auc", "Progressive AUC of the newest event-time window."
        )
        w_rows = GaugeMetricFamily(
            "estuary_progressive_window_rows", "Rows scored in the newest event-time window."
        )
        w_start = GaugeMetricFamily(
            "estuary_progressive_window_start_timestamp_seconds",
            "Start (s since 1970) of the newest event-time window.",
        )
        lag = GaugeMetricFamily(
            "estuary_progressive_lag_seconds",
            "Event -> trained lag: wall time of the training step minus the end of the "
            "row's window, row-weighted quantiles over the run.",
            labels=["quantile"],
        )
        if fill:
            with self.stats.lock:
                self._fill(rows, auc, logloss, w_auc, w_rows, w_start, lag)
        yield from (rows, auc, logloss, w_auc, w_rows, w_start, lag)

    def _fill(self, *families: Any) -> None:
        """Add the samples to the families (lock held)."""
        rows, auc, logloss, w_auc, w_rows, w_start, lag = families
        for name, scores in sorted(self.stats.origins.items()):
            rows.add_metric([name], scores.rows)
            if not math.isnan(value := scores.auc()):
                auc.add_metric([name], value)
            logloss.add_metric([name], scores.logloss())
        newest = self.stats.newest_window()
        if newest is not None:
            (start, _), scores = newest
            if not math.isnan(value := scores.auc()):
                w_auc.add_metric([], value)
            w_rows.add_metric([], scores.rows)
            w_start.add_metric([], start)
        for q, value in zip(LAG_QUANTILES, self.stats.lag_quantiles(), strict=True):
            if not math.isnan(value):
                lag.add_metric([str(q)], value)


def format_report(report: dict[str, Any]) -> str:
    """``ProgressiveStats.report()`` as a text table: one line per window, then
    per origin, then the lag."""

    def line(name: str, figures: dict[str, Any]) -> str:
        auc, logloss = figures["auc"], figures["logloss"]
        auc_text = "-" if auc is None else f"{auc:.4f}"
        logloss_text = "-" if logloss is None else f"{logloss:.4f}"
        return f"  {name:<24} {figures['rows']:>10,} {auc_text:>8} {logloss_text:>8}"

    out = [f"progressive evaluation ({report['scope']}):"]
    out.append(f"  {'window start / origin':<24} {'rows':>10} {'auc':>8} {'logloss':>8}")
    out += [line(w["start"], w) for w in report["windows"]]
    out += [line(name, figures) for name, figures in report["origins"].items()]
    lag = report["lag_s"]
    if lag["p50"] is not None:
        out.append(
            f"  event -> trained lag (from the window end): "
            f"p50 {lag['p50']:,.1f} s, p99 {lag['p99']:,.1f} s"
        )
    by_origin = lag.get("by_origin", {})
    if len(by_origin) > 1:  # e.g. old history files vs a live stream
        for name, q in by_origin.items():
            if q["p50"] is not None:
                out.append(f"    {name:<22} p50 {q['p50']:,.1f} s, p99 {q['p99']:,.1f} s")
    return "\n".join(out)
