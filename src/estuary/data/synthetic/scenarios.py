"""Drift scenarios and new-id bursts of a ``SyntheticSpec`` (see docs/synthetic.md).

A scenario kind other than ``smooth`` moves the drifting values' weights between
two concepts, A and B (two independent draws per value). Its *mix* at an hour says
how much of B the weights hold: ``w = w0 + drift * ((1 - mix) * a(v) + mix * b(v))``.
Each kind is one function of the hours since ``drift_at``, found by name in
``MIX_BY_KIND``; every time is an absolute epoch hour, so an hour's data never
depends on where a run starts.

A burst replaces a share of each column's values, during its hours, with ids that
no other hour has: burst hour ``k`` (0-based) draws ranks in
``[vocab * (k + 1), vocab * (k + 2))``, beyond the vocabulary; the 32-bit keyed
permutation keeps them distinct from every regular id.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from estuary.data.synthetic.spec import SyntheticSpec, epoch_hour

__all__ = ["MIX_BY_KIND", "burst_hour_index", "concept_mix"]


def _abrupt(since_h: float, spec: SyntheticSpec) -> float:
    return 1.0 if since_h >= 0 else 0.0


def _gradual(since_h: float, spec: SyntheticSpec) -> float:
    return min(1.0, max(0.0, since_h / spec.drift_span_hours))


def _recurring(since_h: float, spec: SyntheticSpec) -> float:
    if since_h < 0:
        return 0.0
    return 1.0 - math.floor(since_h / spec.drift_period_hours) % 2  # B first, then A, ...


MIX_BY_KIND: dict[str, Callable[[float, SyntheticSpec], float]] = {
    "abrupt": _abrupt,
    "gradual": _gradual,
    "recurring": _recurring,
}
"""Scenario kind -> mix of concept B (in [0, 1]) from (hours since ``drift_at``, spec)."""


def concept_mix(spec: SyntheticSpec, hour: int) -> float:
    """Share of concept B in the drifting weights at epoch hour ``hour`` (a
    scenario kind; ``smooth`` has no concepts)."""
    if spec.drift_at is None:
        raise ValueError(f"drift_kind {spec.drift_kind!r} needs drift_at")
    return MIX_BY_KIND[spec.drift_kind](float(hour - epoch_hour(spec.drift_at)), spec)


def burst_hour_index(spec: SyntheticSpec, hour: int) -> int | None:
    """``k`` when epoch hour ``hour`` is the burst's hour ``k`` (0-based), else ``None``."""
    if spec.burst_at is None:
        return None
    k = hour - epoch_hour(spec.burst_at)
    return k if 0 <= k < spec.burst_hours else None
