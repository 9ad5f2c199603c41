from __future__ import annotations

import numpy as np
import pytest

from estuary.plan.estimators import fit_affine, median_by_x


def test_fit_affine_recovers_a_line_through_several_sizes() -> None:
    """Three sizes, several rounds each: the line's two terms come back."""
    points = [(x, 0.002 + 1e-6 * x) for x in (26, 2000, 8000) for _ in range(3)]
    fixed, per = fit_affine(points)
    assert fixed == pytest.approx(0.002)
    assert per == pytest.approx(1e-6)


def test_fit_affine_ignores_one_bad_round_at_a_size() -> None:
    """One round at the small size read 3x slow (a hiccup): the median of its
    size keeps the intercept; a fit on the rounds' mean would move it 2x."""
    good = [(x, 0.002 + 1e-6 * x) for x in (26, 2000, 8000) for _ in range(3)]
    fixed, per = fit_affine([*good, (26, 3 * (0.002 + 26e-6))])
    assert fixed == pytest.approx(0.002, rel=1e-6)
    assert per == pytest.approx(1e-6, rel=1e-6)


def test_fit_affine_least_squares_averages_noise_across_sizes() -> None:
    """Noise of +-5% on each size's figure moves a two-point slope more than a
    least-squares one over five sizes (same noise draws per size). (The
    intercept is read mostly off the smallest size either way: what steadies
    it is the median over rounds, above.)"""
    rng = np.random.default_rng(0)
    sizes = [26, 2000, 4000, 6000, 8000]
    two_err, ls_err = [], []
    for _ in range(200):
        noise = 1 + rng.uniform(-0.05, 0.05, len(sizes))
        pts = [(x, (0.002 + 1e-6 * x) * k) for x, k in zip(sizes, noise, strict=True)]
        two_err.append(abs(fit_affine([pts[0], pts[-1]])[1] - 1e-6))
        ls_err.append(abs(fit_affine(pts)[1] - 1e-6))
    assert np.mean(ls_err) < 0.9 * np.mean(two_err)  # 2.6e-8 against 3.1e-8


def test_fit_affine_clamps_to_non_negative_terms() -> None:
    # Falling costs (noise): a flat line at the mean, no negative slope.
    assert fit_affine([(1, 0.003), (10, 0.001)]) == (pytest.approx(0.002), 0.0)
    # A line that would cross below zero: through the origin instead.
    fixed, per = fit_affine([(10, 0.0), (20, 0.01), (30, 0.02)])
    assert fixed == 0.0 and per > 0
    # One size: through the origin and it; at x = 0 all of it is fixed.
    assert fit_affine([(4, 0.008), (4, 0.012)]) == (0.0, pytest.approx(0.0025))
    assert fit_affine([(0, 0.5)]) == (0.5, 0.0)


def test_fit_affine_refuses_no_points_and_negative_sizes() -> None:
    with pytest.raises(ValueError, match="at least one"):
        fit_affine([])
    with pytest.raises(ValueError, match="x must be >= 0"):
        fit_affine([(-1, 0.1), (2, 0.2)])


def test_median_by_x_groups_and_sorts() -> None:
    assert median_by_x([(2, 5.0), (1, 1.0), (2, 1.0), (2, 3.0)]) == [(1.0, 1.0), (2.0, 3.0)]


def test_fit_affine_takes_the_least_of_each_size_when_asked() -> None:
    """One process's CPU seconds only grow with other jobs: ``min`` keeps each
    size's quietest round (two of three rounds slowed by 20% here)."""
    line = [(x, 0.002 + 1e-6 * x) for x in (256, 512, 1024)]
    slowed = [(x, y * k) for x, y in line for k in (1.2, 1.0, 1.2)]
    fixed, per = fit_affine(slowed, min)
    assert fixed == pytest.approx(0.002) and per == pytest.approx(1e-6)
    assert fit_affine(slowed)[1] == pytest.approx(1.2e-6)  # the median: the slowed rounds
