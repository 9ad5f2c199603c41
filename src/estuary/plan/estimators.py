"""Robust estimators for the calibration's timings: medians and affine fits.

A calibrated figure is read from a few timed windows on a machine whose speed
moves (other tenants, caches, clocks). Two things made calibrations minutes
apart disagree by up to 2x (docs/deploy.md, "Calibration reproducibility"):
a figure read from one window (or the best of two), and a per-call / per-unit
pair solved from exactly two points, where any noise in either point moves the
intercept and the slope against each other. Here a figure is the median over
interleaved rounds, and a pair is a least-squares line through the per-size
medians of three or more sizes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

__all__ = ["fit_affine", "median_by_x"]


def median_by_x(
    points: Sequence[tuple[float, float]],
    reduce: Callable[[list[float]], float] = statistics.median,
) -> list[tuple[float, float]]:
    """(x, ``reduce`` of its ys: by default their median) for each distinct x of
    ``points``, in increasing x: one noisy round at a size no longer carries the fit."""
    by_x: dict[float, list[float]] = {}
    for x, y in points:
        by_x.setdefault(float(x), []).append(float(y))
    return [(x, float(reduce(ys))) for x, ys in sorted(by_x.items())]


def fit_affine(
    points: Sequence[tuple[float, float]],
    reduce: Callable[[list[float]], float] = statistics.median,
) -> tuple[float, float]:
    """(fixed, per_unit) of ``y ~ fixed + per_unit * x`` over ``points`` (x units,
    y seconds), both >= 0.

    The ys at each x are first reduced to one (``median_by_x``: their median,
    or ``reduce``, e.g. ``min`` for one process's CPU seconds, which other jobs
    only add to); the line is the least-squares one through those. A negative slope (the
    sizes' costs do not grow: noise) gives a flat line at the medians' mean; a
    negative intercept gives the least-squares line through the origin. With a
    single distinct x the line goes through the origin and that point.

    Raises:
        ValueError: no points, or an x < 0.
    """
    if not points:
        raise ValueError("fit_affine: needs at least one (x, y) point")
    if any(x < 0 for x, _ in points):
        raise ValueError(f"fit_affine: x must be >= 0, got {[x for x, _ in points]}")
    med = median_by_x(points, reduce)
    xs = [x for x, _ in med]
    ys = [y for _, y in med]
    if len(med) == 1:
        x, y = med[0]
        return (0.0, max(y, 0.0) / x) if x > 0 else (max(y, 0.0), 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in med) / sxx
    if slope <= 0:
        return max(my, 0.0), 0.0
    fixed = my - slope * mx
    if fixed < 0:
        return 0.0, max(sum(x * y for x, y in med) / sum(x * x for x in xs), 0.0)
    return fixed, slope
