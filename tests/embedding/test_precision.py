"""16-bit weight codecs: exact decoding, unbiased reproducible stochastic rounding,
sane inf/NaN handling."""

from __future__ import annotations

import numpy as np
import pytest

from estuary.embedding.precision import decode, encode_nearest, encode_sr, f16_to_f32

HALF = ["fp16", "bf16"]


def neighbours(x: float, dtype: str) -> tuple[float, float]:
    """The 16-bit values just below-or-at and just above float32 ``x``."""
    nearest = encode_nearest(np.array([x], np.float32), dtype)
    b = int(nearest.view(np.uint16)[0])
    around = np.array([b - 1, b, b + 1], np.uint16).view(nearest.dtype)
    cands = decode(around).astype(np.float64)
    return float(cands[cands <= x].max()), float(cands[cands > x].min())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("value", [0.1234567, -3.3333333, 1.0e-3, 3.0e-6, 250.7])
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(dtype: str, value: float) -> None:
    n = 200_000
    x = np.full(n, value, np.float32)
    got = decode(encode_sr(x, dtype, key=7)).astype(np.float64)
    lo, hi = neighbours(float(x[0]), dtype)
    assert set(np.unique(got)) <= {lo, hi}
    # Mean of n Bernoulli roundings: standard error (hi - lo) / (2 sqrt(n)); 5 sigma.
    assert abs(got.mean() - float(x[0])) < 5 * (hi - lo) / (2 * np.sqrt(n))
    assert lo < got.mean() < hi  # both neighbours occur: not round-to-nearest


@pytest.mark.parametrize("dtype", HALF)
def test_rounding_is_reproducible_for_a_key_and_differs_across_keys(dtype: str) -> None:
    x = np.random.default_rng(0).normal(size=4096).astype(np.float32)
    a, b, c = encode_sr(x, dtype, key=1), encode_sr(x, dtype, key=1), encode_sr(x, dtype, key=2)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    assert not np.array_equal(a.view(np.uint16), c.view(np.uint16))


@pytest.mark.parametrize("dtype", HALF)
def test_representable_values_and_specials_survive_rounding(dtype: str) -> None:
    x = np.array([0.0, -0.0, 1.0, -0.5, 2.0**-20, np.inf, -np.inf, np.nan], np.float32)
    for key in range(5):
        got = decode(encode_sr(x, dtype, key))
        np.testing.assert_array_equal(got[:6], x[:6])
        assert np.signbit(got[1])
        assert got[6] == -np.inf and np.isnan(got[7])


def test_fp16_overflow_goes_to_inf_and_stays_finite_at_its_largest_value() -> None:
    x = np.array([65504.0, 70000.0, -1e6], np.float32)
    got = decode(encode_sr(x, "fp16", key=3))
    assert got[0] == 65504.0 and got[1] == np.inf and got[2] == -np.inf


def test_fp16_kernel_decoding_matches_numpy_for_every_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.array([f16_to_f32(b) for b in bits], np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all()


def test_nearest_encoding_rounds_ties_to_even_in_bf16() -> None:
    # 1 + 2**-8 is halfway between bf16's 1 and 1 + 2**-7: ties go to the even 1.
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, np.nan], np.float32)
    got = decode(encode_nearest(x, "bf16"))
    assert got[0] == 1.0 and got[1] == 1 + 2.0**-6 and np.isnan(got[2])
