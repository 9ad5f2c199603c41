"""The synthetic click model and the chunk generator (see ``synthetic`` for the tour).

Every draw is a hash, never a stateful RNG: a row's values are
``splitmix64(key(seed, hour, column) + row * golden)``, and a value's latent
weight is ``splitmix64(key(seed, feature) + value * golden)``. So any row range of
any hour can be made alone, in any order, in any process, with no table of
per-value weights (vocabularies of 1e8 cost nothing), and chunking never changes
the data.

Cost per row: ~8 hash evaluations per sparse column (value draw, weight, two
drift knots, interactions) as numpy passes over the chunk; about 1-2 µs per
Criteo-shaped row on one core.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from estuary.data.synthetic.scenarios import burst_hour_index, concept_mix
from estuary.data.synthetic.spec import SyntheticSpec

__all__ = ["ClickModel", "SyntheticChunk", "generate_chunks", "model_for"]

U64Array = npt.NDArray[np.uint64]
U32Array = npt.NDArray[np.uint32]
F64Array = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_G = np.uint64(_GOLDEN)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)
_LOW11 = np.uint64(2047)  # low 11 bits: a 1/2048-grained coin, independent of unit()
_LOW10 = np.uint64(1023)
_LOGISTIC_TO_UNIT_STD = math.sqrt(3.0) / math.pi

# Signal budget (logit standard deviations before ``signal_scale``): sparse main
# effects, sparse pairwise interactions, dense features. Total ~1.2, which puts the
# Bayes-optimal AUC near 0.8, about where real CTR data sits.
_SPARSE_STD, _INTERACTION_STD, _DENSE_STD = 1.0, 0.5, 0.5
_INTERACTION_DIM = 4
_CALIBRATION_ROWS_PER_HOUR = 2048


class _Tag(IntEnum):
    """Hash domains, so no two kinds of draw ever share a key."""

    ROWS = 1
    SPARSE = 2
    VALUE = 3
    KNOT = 4
    PERMUTE = 5
    PAIR = 6
    FACTOR = 7
    DENSE = 8
    ACTIVITY = 9
    LABEL = 10
    FEATURE = 11
    CALIBRATION = 12
    DIURNAL = 13
    CONCEPT = 14
    BURST = 15


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (for scalar keys)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def key(*parts: int) -> int:
    """A 64-bit key for a sequence of integers (seed, tag, hour, column, ...)."""
    h = 0x243F6A8885A308D3
    for part in parts:
        h = _mix_int(((h ^ (part & _MASK64)) + _GOLDEN) & _MASK64)
    return h


def _unit_int(k: int) -> float:
    """A uniform float in (0, 1) from a scalar key."""
    return ((k >> 11) + 0.5) * 2.0**-53


def hash_u64(k: int, index: U64Array) -> U64Array:
    """uint64 (N,): element i is splitmix64 output number ``index[i]`` of stream ``k``."""
    x = index * _G  # uint64 arithmetic wraps, as splitmix64 wants
    x += np.uint64(k)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def unit(h: U64Array) -> F64Array:
    """float64 (N,) uniform in the open interval (0, 1), from the top 53 bits."""
    u = (h >> _S11).astype(np.float64)
    u += 0.5
    u *= 2.0**-53
    return u


def std_logistic(h: U64Array) -> F64Array:
    """float64 (N,) logistic draws scaled to unit variance (a cheap, heavier-tailed
    stand-in for a normal: one log per value, no table)."""
    u = unit(h)
    return np.log(u / (1.0 - u)) * _LOGISTIC_TO_UNIT_STD


def zipf_ranks(u: F64Array, vocab: int, exponent: float) -> U64Array:
    """uint64 (N,) ranks in [0, vocab): rank k-1 with probability ~ k**-exponent.

    Inverse CDF of the continuous density ``x**-exponent`` on [1, vocab + 1),
    floored: O(1) per draw for any vocabulary (no 1e8-entry CDF table); the head
    is slightly flatter than the discrete law, the tail follows it.
    """
    a = 1.0 - exponent
    if abs(a) < 1e-9:
        x = np.exp(u * math.log(vocab + 1.0))
    else:
        top = (vocab + 1.0) ** a
        x = (1.0 + u * (top - 1.0)) ** (1.0 / a)
    ranks = np.floor(x) - 1.0
    np.clip(ranks, 0.0, vocab - 1.0, out=ranks)
    return ranks.astype(np.uint64)


def permute32(ranks: U64Array, k: int) -> U32Array:
    """uint32 (N,): a keyed bijection of 32-bit values, so a column's ranks become
    scattered ids with no collisions (every step below is invertible mod 2**32)."""
    x = ranks.astype(np.uint32) ^ np.uint32(k & 0xFFFFFFFF)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    x ^= np.uint32(k >> 32)
    return x


@dataclass(frozen=True)
class SyntheticChunk:
    """Rows ``start .. start + B`` of one hour.

    Args:
        hour: epoch hour (hours since 1970-01-01T00 UTC).
        start: index of the first row within the hour.
        labels: int8 (B,) 0/1 clicks.
        click_prob: float32 (B,) the click model's probability for each row
            (ground truth: the best any model could predict).
        dense: int64 (B, Dd) non-negative counts; 0 where missing.
        dense_valid: bool (B, Dd) False where the value is missing (written empty).
        sparse: uint32 (B, F) value ids, written as 8 hex digits; column-major
            (``sparse[:, f]`` is contiguous).
        sparse_valid: bool (B, F) False where the value is missing (written empty).
        row_ids: int64 (B,) ``hour * rows_per_hour + index``: unique and, across
            consecutive hours, consecutive.
        event_time_ms: int64 (B,) Unix milliseconds, non-decreasing in the hour.
    """

    hour: int
    start: int
    labels: npt.NDArray[np.int8]
    click_prob: npt.NDArray[np.float32]
    dense: npt.NDArray[np.int64]
    dense_valid: BoolArray
    sparse: U32Array
    sparse_valid: BoolArray
    row_ids: npt.NDArray[np.int64]
    event_time_ms: npt.NDArray[np.int64]

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])


class ClickModel:
    """The latent click model of a ``SyntheticSpec`` (everything derived from hashes).

    ``logit(row) = bias + diurnal(hour)
                   + sum_f w_f(value_f, hour)                      # sparse main effects
                   + sum_(f,g) <a_f(value_f), b_g(value_g)>        # pairwise interactions
                   + sum_d beta_d tanh(z_d) + c tanh(z_0) tanh(z_1)  # dense, nonlinear``

    ``w_f(v, hour) = w0 + drift * member * noise(hour)`` where ``member`` marks
    ``drift_fraction`` of the values and ``noise`` is smooth value noise with
    independent knots every ``drift_period_hours`` (``drift_kind`` smooth), or a
    scenario's mix of two concepts (``synthetic.scenarios``). ``z_d`` is the standardised
    log count behind dense column d (shared row activity + own noise). ``bias``
    is solved so the mean label over a day is ``base_ctr``.

    Args:
        spec: the data set's spec (validated here).
    """

    def __init__(self, spec: SyntheticSpec) -> None:
        spec.validate()
        self.spec = spec
        seed, f_count, d_count = spec.seed, spec.num_sparse, spec.num_dense
        scale = spec.signal_scale
        strength = np.array(
            [0.1 + _unit_int(key(seed, _Tag.FEATURE, f)) ** 2 for f in range(f_count)]
        )
        self.sparse_std = _SPARSE_STD * scale * strength / np.linalg.norm(strength)  # (F,)
        self.sparse_missing = [
            round(2048 * min(1.0, 2 * spec.missing_rate * _unit_int(key(seed, _Tag.SPARSE, f))))
            for f in range(f_count)
        ]
        self.drift_members = round(1024 * spec.drift_fraction)
        self.pairs = self._choose_pairs()
        self.pair_std = _INTERACTION_STD * scale / math.sqrt(max(1, len(self.pairs)))

        def draw(tag: _Tag, d: int, j: int) -> float:
            return _unit_int(key(seed, tag, d, j))

        self.dense_mu = np.array([0.5 + 3.5 * draw(_Tag.DENSE, d, 0) for d in range(d_count)])
        self.dense_spread = np.array([0.5 + draw(_Tag.DENSE, d, 1) for d in range(d_count)])
        self.dense_rho = np.array([0.2 + 0.6 * draw(_Tag.DENSE, d, 2) for d in range(d_count)])
        self.dense_missing = [
            round(2048 * min(1.0, 2 * spec.missing_rate * draw(_Tag.DENSE, d, 3)))
            for d in range(d_count)
        ]
        beta = np.array([draw(_Tag.DENSE, d, 4) - 0.5 for d in range(d_count)])
        norm = float(np.linalg.norm(beta)) or 1.0
        self.dense_beta = _DENSE_STD * scale * beta / norm  # (Dd,)
        self.dense_cross = 0.5 * _DENSE_STD * scale if d_count >= 2 else 0.0
        self.diurnal_phase = 24.0 * _unit_int(key(seed, _Tag.DIURNAL))
        self._bias: float | None = None

    def _choose_pairs(self) -> list[tuple[int, int]]:
        f_count = self.spec.num_sparse
        wanted = min(self.spec.num_interactions, f_count * (f_count - 1) // 2)
        pairs: list[tuple[int, int]] = []
        j = 0
        while len(pairs) < wanted:
            k = key(self.spec.seed, _Tag.PAIR, j)
            f, g = k % f_count, (k >> 32) % f_count
            if f != g and (min(f, g), max(f, g)) not in pairs:
                pairs.append((min(f, g), max(f, g)))
            j += 1
        return pairs

    # -- per-value quantities ----------------------------------------------------------

    def value_weights(self, feature: int, ranks: U64Array, hour: int) -> F64Array:
        """float64 (N,) main-effect weight of ``feature``'s values ``ranks`` at ``hour``."""
        spec = self.spec
        h = hash_u64(key(spec.seed, _Tag.VALUE, feature), ranks)
        weights = std_logistic(h)
        if spec.drift > 0 and self.drift_members > 0:
            if spec.drift_kind == "smooth":  # value noise, knots every drift_period_hours
                t = hour / spec.drift_period_hours
                knot = math.floor(t)
                tag, first = _Tag.KNOT, knot
                frac = t - knot
                mix = frac * frac * (3.0 - 2.0 * frac)
            else:  # concepts A (0) and B (1), mixed as the scenario says
                tag, first, mix = _Tag.CONCEPT, 0, concept_mix(spec, hour)
            n0 = std_logistic(hash_u64(key(spec.seed, tag, feature, first), ranks))
            n1 = std_logistic(hash_u64(key(spec.seed, tag, feature, first + 1), ranks))
            member = (h & _LOW10) < np.uint64(self.drift_members)
            weights += np.where(member, spec.drift * (n0 + mix * (n1 - n0)), 0.0)
        weights *= self.sparse_std[feature]
        return weights

    # -- rows --------------------------------------------------------------------------

    def _draw(
        self, row_key: int, hour: int, index: U64Array
    ) -> tuple[F64Array, U32Array, BoolArray, npt.NDArray[np.int64], BoolArray]:
        """(logit without bias (B,), ids (F, B), ids valid (F, B), dense (Dd, B),
        dense valid (Dd, B)) for rows ``index`` drawn from stream ``row_key``."""
        spec, b = self.spec, index.shape[0]
        burst = burst_hour_index(spec, hour)
        logit = np.zeros(b)
        ranks = np.empty((spec.num_sparse, b), np.uint64)
        valid = np.empty((spec.num_sparse, b), np.bool_)
        ids = np.empty((spec.num_sparse, b), np.uint32)
        for f, vocab in enumerate(spec.vocab_sizes):
            h = hash_u64(key(row_key, _Tag.SPARSE, f), index)
            valid[f] = (h & _LOW11) >= np.uint64(self.sparse_missing[f])
            ranks[f] = zipf_ranks(unit(h), vocab, spec.zipf_exponent)
            if burst is not None:
                self._burst_ranks(ranks[f], row_key, f, vocab, burst, index)
            logit += np.where(valid[f], self.value_weights(f, ranks[f], hour), 0.0)
            ids[f] = permute32(ranks[f], key(spec.seed, _Tag.PERMUTE, f))
        for p, (f, g) in enumerate(self.pairs):
            dot = np.zeros(b)
            for j in range(_INTERACTION_DIM):
                a = std_logistic(hash_u64(key(spec.seed, _Tag.FACTOR, p, j, 0), ranks[f]))
                a *= std_logistic(hash_u64(key(spec.seed, _Tag.FACTOR, p, j, 1), ranks[g]))
                dot += a
            both = valid[f] & valid[g]
            logit += np.where(both, dot * (self.pair_std / math.sqrt(_INTERACTION_DIM)), 0.0)

        activity = std_logistic(hash_u64(key(row_key, _Tag.ACTIVITY), index))
        dense = np.empty((spec.num_dense, b), np.int64)
        dense_valid = np.empty((spec.num_dense, b), np.bool_)
        squashed: list[F64Array] = []
        for d in range(spec.num_dense):
            h = hash_u64(key(row_key, _Tag.DENSE, d), index)
            rho = self.dense_rho[d]
            z = rho * activity + math.sqrt(1.0 - rho * rho) * std_logistic(h)
            log_count = np.maximum(self.dense_mu[d] + self.dense_spread[d] * z, 0.0)
            dense[d] = np.floor(np.expm1(log_count)).astype(np.int64)
            dense_valid[d] = (h & _LOW11) >= np.uint64(self.dense_missing[d])
            dense[d][~dense_valid[d]] = 0
            squashed.append(np.tanh(z))
            logit += self.dense_beta[d] * squashed[d]
        if self.dense_cross:
            logit += self.dense_cross * squashed[0] * squashed[1]
        hour_of_day = hour % 24
        logit += spec.diurnal_amplitude * math.sin(
            2 * math.pi * (hour_of_day + self.diurnal_phase) / 24
        )
        return logit, ids, valid, dense, dense_valid

    def _burst_ranks(
        self, ranks: U64Array, row_key: int, feature: int, vocab: int, k: int, index: U64Array
    ) -> None:
        """Replace, in place, a ``burst_share`` of ``ranks`` (N,) by new ranks of
        burst hour ``k``: Zipf-drawn in ``[vocab * (k + 1), vocab * (k + 2))``."""
        h = hash_u64(key(row_key, _Tag.BURST, feature), index)
        new = unit(h) < self.spec.burst_share
        u = unit(hash_u64(key(row_key, _Tag.BURST, feature, 1), index[new]))
        ranks[new] = zipf_ranks(u, vocab, self.spec.zipf_exponent) + np.uint64(vocab * (k + 1))

    @property
    def bias(self) -> float:
        """The logit offset that makes the mean label ``base_ctr`` (solved once, on
        24 hours x 2048 calibration rows from their own hash domain)."""
        if self._bias is None:
            index = np.arange(_CALIBRATION_ROWS_PER_HOUR, dtype=np.uint64)
            logits = np.concatenate(
                [
                    self._draw(key(self.spec.seed, _Tag.CALIBRATION, h), h, index)[0]
                    for h in range(24)
                ]
            )
            eps = self.spec.label_noise
            target = (self.spec.base_ctr - eps) / (1.0 - 2.0 * eps)
            lo, hi = -30.0, 30.0
            for _ in range(60):  # bisection: mean sigmoid is increasing in the bias
                mid = 0.5 * (lo + hi)
                if np.mean(_sigmoid(logits + mid)) < target:
                    lo = mid
                else:
                    hi = mid
            self._bias = 0.5 * (lo + hi)
        return self._bias

    def chunk(self, hour: int, start: int, stop: int) -> SyntheticChunk:
        """Rows ``[start, stop)`` of epoch hour ``hour``."""
        spec = self.spec
        index = np.arange(start, stop, dtype=np.uint64)
        row_key = key(spec.seed, _Tag.ROWS, hour)
        logit, ids, valid, dense, dense_valid = self._draw(row_key, hour, index)
        prob = _sigmoid(logit + self.bias)
        if spec.label_noise:
            prob = spec.label_noise + (1.0 - 2.0 * spec.label_noise) * prob
        labels = unit(hash_u64(key(row_key, _Tag.LABEL), index)) < prob
        rows = np.arange(start, stop, dtype=np.int64)
        return SyntheticChunk(
            hour=hour,
            start=start,
            labels=labels.astype(np.int8),
            click_prob=prob.astype(np.float32),
            dense=dense.T,
            dense_valid=dense_valid.T,
            sparse=ids.T,
            sparse_valid=valid.T,
            row_ids=hour * spec.rows_per_hour + rows,
            event_time_ms=hour * 3_600_000 + rows * 3_600_000 // spec.rows_per_hour,
        )


def _sigmoid(x: F64Array) -> F64Array:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


@functools.lru_cache(maxsize=8)
def model_for(spec: SyntheticSpec) -> ClickModel:
    """The (cached) click model of ``spec``; specs are frozen, so equal specs share it."""
    return ClickModel(spec)


def generate_chunks(
    spec: SyntheticSpec, hour: int, start: int = 0, stop: int | None = None
) -> Iterator[SyntheticChunk]:
    """Rows ``[start, stop)`` (default: the whole hour) of epoch hour ``hour``, in
    chunks of at most ``spec.chunk_rows``; memory is bounded by one chunk.

    The rows are the same whatever the chunking, the order hours are asked for, or
    the process that asks.
    """
    stop = spec.rows_per_hour if stop is None else stop
    if not 0 <= start <= stop <= spec.rows_per_hour:
        raise ValueError(f"rows [{start}, {stop}) not within [0, {spec.rows_per_hour})")
    model = model_for(spec)
    for lo in range(start, stop, spec.chunk_rows):
        yield model.chunk(hour, lo, min(stop, lo + spec.chunk_rows))
