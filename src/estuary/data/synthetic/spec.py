"""``SyntheticSpec``: what a synthetic CTR data set looks like (see ``synthetic``).

Hours are counted as **epoch hours**, whole hours since 1970-01-01T00 UTC, so an
hour's data never depends on where a run starts: ``spec.epoch_hours()`` is the
run's range, ``hour_datetime(h)`` turns one back into a UTC datetime.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Literal, get_args

from estuary.config.errors import ConfigError

__all__ = [
    "CRITEO_VOCAB_SIZES",
    "DRIFT_KINDS",
    "DriftKind",
    "SyntheticSpec",
    "epoch_hour",
    "hour_datetime",
    "parse_hour",
]

CRITEO_VOCAB_SIZES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Distinct values of C1..C26 in the Criteo Kaggle (7-day) data set: the default."""

DriftKind = Literal["smooth", "abrupt", "gradual", "recurring"]
"""How drifting values' weights move over time (see ``synthetic.scenarios``)."""
DRIFT_KINDS: tuple[str, ...] = get_args(DriftKind)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_VOCAB = 1 << 32  # ids are 32-bit (8 hex digits) and distinct per value


def epoch_hour(when: datetime) -> int:
    """Whole hours since 1970-01-01T00 UTC (a naive ``when`` is read as UTC)."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int((when - _EPOCH) // timedelta(hours=1))


def hour_datetime(hour: int) -> datetime:
    """The UTC datetime at the start of epoch hour ``hour``."""
    return _EPOCH + timedelta(hours=hour)


def parse_hour(text: str) -> datetime:
    """``2026-01-01T00`` (or any ISO 8601 time on the hour) as a UTC datetime.

    Raises:
        ValueError: not ISO 8601, or not on a whole hour.
    """
    when = datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if when.minute or when.second or when.microsecond:
        raise ValueError(f"{text!r} is not on a whole hour")
    return when.astimezone(UTC)


@dataclass(frozen=True)
class SyntheticSpec:
    """A synthetic CTR data set: columns, volume, time range and click model.

    The data of one hour is a pure function of the spec's model fields, ``seed``,
    ``rows_per_hour`` and the hour itself; ``hours``, ``start`` and ``chunk_rows``
    only choose which hours are made and how, never what is in them.

    Args:
        rows_per_hour: rows in each hourly partition.
        hours: number of consecutive hours, from ``start``.
        start: first hour (UTC; a naive datetime is read as UTC); on a whole hour.
        num_dense: dense columns ``I1..I{num_dense}``: non-negative counts.
        vocab_sizes: distinct values of each sparse column ``C1..C{len}``; at most
            2**32 each (a value is 8 hex digits). Default: Criteo's 26 columns.
        zipf_exponent: value ``k`` of a column (k = 1, 2, ...) is drawn with
            probability proportional to ``k ** -zipf_exponent``.
        base_ctr: mean label over a day; the click model's bias is solved for it.
        drift: how far drifting values' weights move, in units of their feature's
            weight scale; 0 makes the click model stationary.
        drift_fraction: share of each column's values whose weight drifts.
        drift_period_hours: ``smooth``: the drift's correlation time (weights
            ``drift_period_hours`` apart are independent, nearby hours are alike);
            ``recurring``: how long each concept lasts before the other returns.
        drift_kind: ``smooth`` (value noise, the default), or a scenario between two
            concepts A and B of the drifting values' weights: ``abrupt`` (A before
            ``drift_at``, B from it), ``gradual`` (a linear blend from A to B over
            ``drift_span_hours`` from ``drift_at``), ``recurring`` (B from ``drift_at``,
            then A and B alternate every ``drift_period_hours``).
        drift_at: when a scenario's change starts (an absolute hour, UTC, never an
            offset from ``start``); required by every kind but ``smooth``.
        drift_span_hours: ``gradual``: hours the blend from A to B takes.
        burst_at: first hour of a burst of new ids (``None``: no burst): during
            ``[burst_at, burst_at + burst_hours)`` a share ``burst_share`` of each
            column's values are ids outside the vocabulary, distinct per hour.
        burst_hours: hours the burst lasts.
        burst_share: share of values replaced by new ids during the burst.
        diurnal_amplitude: amplitude (in logits) of the time-of-day CTR cycle.
        num_interactions: pairwise sparse-feature interactions in the click model.
        signal_scale: scales every learnable effect; larger = more predictable labels.
        label_noise: probability that a drawn label is flipped (< base_ctr).
        missing_rate: mean share of empty values per column (varies per column).
        seed: selects the click model and every draw.
        chunk_rows: rows generated at a time; bounds memory, never changes the data.
    """

    rows_per_hour: int = 100_000
    hours: int = 24
    start: datetime = datetime(2026, 1, 1, tzinfo=UTC)
    num_dense: int = 13
    vocab_sizes: tuple[int, ...] = CRITEO_VOCAB_SIZES
    zipf_exponent: float = 1.05
    base_ctr: float = 0.22
    drift: float = 0.5
    drift_fraction: float = 0.3
    drift_period_hours: float = 24.0
    drift_kind: DriftKind = "smooth"
    drift_at: datetime | None = None
    drift_span_hours: float = 24.0
    burst_at: datetime | None = None
    burst_hours: int = 1
    burst_share: float = 0.2
    diurnal_amplitude: float = 0.2
    num_interactions: int = 4
    signal_scale: float = 1.0
    label_noise: float = 0.0
    missing_rate: float = 0.05
    seed: int = 0
    chunk_rows: int = 1 << 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocab_sizes", tuple(int(v) for v in self.vocab_sizes))
        for name in ("drift_at", "burst_at"):
            when = getattr(self, name)
            if when is not None and when.tzinfo is None:
                object.__setattr__(self, name, when.replace(tzinfo=UTC))

    @property
    def num_sparse(self) -> int:
        """Sparse columns (F)."""
        return len(self.vocab_sizes)

    @property
    def start_hour(self) -> int:
        """``start`` as an epoch hour."""
        return epoch_hour(self.start)

    def epoch_hours(self) -> range:
        """The run's hours, as epoch hours, in time order."""
        return range(self.start_hour, self.start_hour + self.hours)

    def dense_names(self) -> list[str]:
        """``I1..I{num_dense}``."""
        return [f"I{i}" for i in range(1, self.num_dense + 1)]

    def sparse_names(self) -> list[str]:
        """``C1..C{num_sparse}``."""
        return [f"C{i}" for i in range(1, self.num_sparse + 1)]

    def validate(self, path: str = "synthetic") -> None:
        """Check every field.

        Raises:
            ConfigError: names the field, e.g. ``synthetic.rows_per_hour: must be > 0``.
        """
        positive = (
            "rows_per_hour",
            "hours",
            "chunk_rows",
            "drift_period_hours",
            "drift_span_hours",
            "burst_hours",
        )
        non_negative = (
            "num_dense",
            "num_interactions",
            "drift",
            "diurnal_amplitude",
            "signal_scale",
        )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in positive and not value > 0:
                raise ConfigError(f"{path}.{f.name}", f"must be > 0, got {value}")
            if f.name in non_negative and not value >= 0:
                raise ConfigError(f"{path}.{f.name}", f"must be >= 0, got {value}")
        for name in ("start", "drift_at", "burst_at"):
            when = getattr(self, name)
            if when is None:
                continue
            if when.minute or when.second or when.microsecond:
                raise ConfigError(f"{path}.{name}", f"must be on a whole hour, got {when}")
            if epoch_hour(when) < 0:
                raise ConfigError(f"{path}.{name}", "must be 1970-01-01T00 UTC or later")
        self._validate_scenario(path)
        if not self.vocab_sizes:
            raise ConfigError(f"{path}.vocab_sizes", "needs at least one sparse column")
        for i, size in enumerate(self.vocab_sizes):
            if not 1 <= size <= _MAX_VOCAB:
                raise ConfigError(f"{path}.vocab_sizes[{i}]", f"must be in [1, 2**32], got {size}")
        if self.zipf_exponent <= 0:
            raise ConfigError(f"{path}.zipf_exponent", "must be > 0")
        if not 0 < self.base_ctr < 1:
            raise ConfigError(f"{path}.base_ctr", "must be in (0, 1)")
        if not 0 <= self.drift_fraction <= 1:
            raise ConfigError(f"{path}.drift_fraction", "must be in [0, 1]")
        if not 0 <= self.label_noise < min(self.base_ctr, 1 - self.base_ctr):
            raise ConfigError(f"{path}.label_noise", "must be in [0, min(base_ctr, 1 - base_ctr))")
        if not 0 <= self.missing_rate <= 0.5:
            raise ConfigError(f"{path}.missing_rate", "must be in [0, 0.5]")
        if not 0 <= self.seed < 1 << 64:
            raise ConfigError(f"{path}.seed", "must be in [0, 2**64)")

    def _validate_scenario(self, path: str) -> None:
        """The drift kind, its time, and the burst (see ``validate``)."""
        if self.drift_kind not in DRIFT_KINDS:
            raise ConfigError(
                f"{path}.drift_kind",
                f"must be one of {', '.join(DRIFT_KINDS)}, got {self.drift_kind!r}",
            )
        if self.drift_kind != "smooth" and self.drift_at is None:
            raise ConfigError(
                f"{path}.drift_at", f"is required with drift_kind {self.drift_kind!r}"
            )
        if self.drift_kind == "smooth" and self.drift_at is not None:
            raise ConfigError(f"{path}.drift_at", "has no effect with drift_kind 'smooth'")
        if not 0 < self.burst_share <= 1:
            raise ConfigError(f"{path}.burst_share", f"must be in (0, 1], got {self.burst_share}")
        if self.burst_at is None:
            return
        # Burst hour k draws ranks in [size * (k + 1), size * (k + 2)).
        for i, size in enumerate(self.vocab_sizes):
            if size * (self.burst_hours + 1) > _MAX_VOCAB:
                raise ConfigError(
                    f"{path}.burst_hours",
                    f"new ids of {self.burst_hours} hours do not fit in 32 bits beside "
                    f"vocab_sizes[{i}] = {size} (need vocab * (burst_hours + 1) <= 2**32)",
                )
