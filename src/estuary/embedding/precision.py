"""16-bit weights: float32 <-> fp16 / bf16 conversions, with stochastic rounding.

numpy has no bfloat16, so bf16 values are held as ``uint16`` bit patterns (the
high half of a float32); fp16 values as numpy ``float16``. In a table state a
``uint16`` weights array therefore means bf16 (``STORED_DTYPES``).

Stochastic rounding (``*_sr``): a float32 ``x`` between two neighbouring 16-bit
values ``lo <= x < hi`` becomes ``hi`` with probability ``(x - lo) / (hi - lo)``,
so the rounding is unbiased (``E[round(x)] = x``) and small updates are not lost
to round-to-nearest (Gupta et al. 2015; fbgemm's fp16/bf16 embedding updates).
The random bits are counter-based: a table row's rounding depends only on the
caller's key (the table seed and the step), the row's id and the element's
position (``row_seed``, ``row_element_bits``); ``encode_sr``'s on the key and
the flat position (``random_bits``). Runs are reproducible.

NaN stays NaN (quiet), +-inf stays +-inf; finite values beyond the largest
16-bit value round up to inf with the probability their distance implies
(fp16's largest is 65504: beyond it values round stochastically towards inf).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from estuary.embedding.hashing import GOLDEN, mix64

__all__ = [
    "BF16",
    "CODES",
    "FP16",
    "FP32",
    "STORED_DTYPES",
    "bf16_to_f32",
    "call_key",
    "counter_bits",
    "decode",
    "draw_row_bits",
    "dtype_name",
    "element_bits",
    "element_offsets",
    "encode_nearest",
    "encode_sr",
    "f16_to_f32",
    "f32_to_bf16_sr",
    "f32_to_f16_sr",
    "f32_to_half_sr",
    "half_to_f32",
    "random_bits",
    "row_element_bits",
    "row_seed",
]

# Codes the kernels branch on.
FP32, FP16, BF16 = 0, 1, 2
CODES = {"fp32": FP32, "fp16": FP16, "bf16": BF16}
# numpy dtype of the stored weights, per table dtype.
STORED_DTYPES: dict[str, np.dtype] = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
    "bf16": np.dtype(np.uint16),
}
_NAMES = {dt: name for name, dt in STORED_DTYPES.items()}

_U16 = np.uint32(16)
_U13 = np.uint32(13)
_LOW16 = np.uint64(0xFFFF)
_LOW13 = np.uint64(0x1FFF)
_ABS = np.uint32(0x7FFFFFFF)
_EXP_ALL = np.uint32(0x7F800000)
_F16_INF = np.uint32(0x7C00)
_F16_REBIAS = np.uint32(112 << 10)  # (127 - 15) << 10: float32 -> fp16 exponent
_F16_MIN_NORMAL_BITS = np.uint32(0x38800000)  # 2**-14 as float32 bits
_TWO_M24 = 2.0**-24  # fp16 subnormal spacing
_INV_2_16 = 1.0 / 65536.0
_S16 = np.uint64(16)
_S32 = np.uint64(32)
_U15 = np.uint32(15)
_G32 = np.uint32(0x9E3779B9)  # 2**32 / golden ratio
_H1 = np.uint32(0x7FEB352D)  # lowbias32 multipliers (Wellons, hash-prospector)
_H2 = np.uint32(0x846CA68B)
_LOW16_32 = np.uint32(0xFFFF)


@njit(cache=True, nogil=True, inline="always")
def random_bits(key: np.uint64, counter: np.uint64) -> np.uint64:
    """64 random bits that depend only on (``key``, ``counter``) (splitmix64)."""
    return mix64(key + (counter + np.uint64(1)) * GOLDEN)


@njit(cache=True, nogil=True, inline="always")
def row_seed(key: np.uint64, row_id: np.int64) -> np.uint32:
    """The 32-bit seed of the row of ``row_id``'s rounding in a call keyed ``key``
    (the high half of ``mix64(row_id ^ key)``): uniform over calls."""
    return np.uint32(mix64(np.uint64(row_id) ^ key) >> _S32)


@njit(cache=True, nogil=True, inline="always")
def counter_bits(x: np.uint32) -> np.uint32:
    """A 16-bit draw (low half of the result) from the 32-bit counter ``x``: the
    high half of lowbias32 (an integer hash, a bijection on 32 bits) of ``x``.
    Every step is truncated to 32 bits (numba widens integer arithmetic)."""
    x = np.uint32((x ^ (x >> _U16)) * _H1)
    x = np.uint32((x ^ (x >> _U15)) * _H2)
    x = np.uint32(x ^ (x >> _U16))
    return np.uint32(x >> _U16)


@njit(cache=True, nogil=True)
def element_offsets(dim: int) -> np.ndarray:
    """``j * 0x9E3779B9 mod 2**32`` for j < ``dim`` (uint32): element j's counter
    is ``row seed + offsets[j]`` (``row_element_bits``)."""
    out = np.empty(dim, np.uint32)
    for j in range(dim):
        out[j] = np.uint32(np.uint64(j) * np.uint64(_G32))
    return out


@njit(cache=True, nogil=True, inline="always")
def row_element_bits(seed: np.uint32, j: int) -> np.uint32:
    """The 16-bit rounding draw (low half of the result) of element ``j`` of the
    row seeded ``seed`` (``row_seed``): ``counter_bits(seed + j * 0x9E3779B9)``
    (mod 2**32).

    For a fixed element, ``seed`` uniform over calls makes the counter, so the
    hash and its high half, exactly uniform: the rounding stays unbiased. Only
    32-bit integer operations and no state carried from one element to the next:
    a fused kernel's element loop vectorises with the draws in it (16 lanes
    here) when it reads the offsets ``j * 0x9E3779B9`` from ``element_offsets``.
    Measured on the fused bf16 row-wise Adagrad kernel at D=64 (CPU time, one
    run): 19.5M ids/s, against 19.8M with a constant in place of the draws and
    15.8M computing the offsets in the loop (numba's 64-bit products); the
    earlier 64-bit splitmix draw per 4 elements, made before the loop, ran the
    whole kernel at 13.1-14.0M.
    """
    return counter_bits(np.uint32(seed + np.uint32(np.uint64(j) * np.uint64(_G32))))


@njit(cache=True, nogil=True, inline="always")
def draw_row_bits(key: np.uint64, row_id: np.int64, out: np.ndarray) -> None:
    """The rounding bits of the row of ``row_id`` in a call keyed ``key``: 16-bit
    draws into ``out`` uint32 (at least D,), element j's in ``out[j]``, equal to
    ``row_element_bits(row_seed(key, row_id), j)``. For kernels that draw a
    row's bits before its element loop; the fused update draws them in its loop
    (``counter_bits(seed + element_offsets(D)[j])``, the same bits)."""
    seed = row_seed(key, row_id)
    for j in range(out.size):
        out[j] = row_element_bits(seed, j)


@njit(cache=True, nogil=True, inline="always")
def element_bits(word: np.uint64, j: int) -> np.uint64:
    """The rounding bits of element ``j`` (low 16 bits of the result) from
    ``word = random_bits(key, j // 4)``: one 64-bit draw serves 4 elements (a
    draw costs as much as the rest of an element's update)."""
    return word >> (np.uint64(j & 3) * _S16)


@njit(cache=True, nogil=True)
def call_key(seed: np.uint64, clock: np.int64) -> np.uint64:
    """The rounding key of one call: the table seed mixed with the call's clock
    value (distinct per call), so no two calls share random bits."""
    return mix64(np.uint64(seed) ^ mix64(np.uint64(clock)))


@njit(cache=True, nogil=True, inline="always")
def bf16_to_f32(h: np.uint16) -> np.float32:
    """bf16 bits -> float32 (exact: the bits are the float32's high half)."""
    return np.uint32(np.uint32(h) << _U16).view(np.float32)  # numba widens shifts


@njit(cache=True, nogil=True, inline="always")
def f32_to_bf16_sr(x: np.float32, bits: np.uint64 | np.uint32) -> np.uint16:
    """float32 -> bf16 bits, rounded stochastically with the low 16 of ``bits``.

    Branch-free (a select for NaN), so loops over a row vectorise. Adding a
    uniform 16-bit value carries into the kept half with probability (dropped
    bits) / 2**16; a carry out of the largest finite value gives inf; +-inf
    have 16 zero low bits, so they never carry.
    """
    u = np.float32(x).view(np.uint32)
    rounded = np.uint32(u + (np.uint32(bits) & _LOW16_32)) >> _U16
    quiet_nan = (u >> _U16) | np.uint32(0x40)  # a NaN stays a (quiet) NaN
    return np.uint16(quiet_nan if (u & _ABS) > _EXP_ALL else rounded)


@njit(cache=True, nogil=True, inline="always")
def f16_to_f32(h: np.uint16) -> np.float32:
    """fp16 bits -> float32 (exact; subnormals, inf and NaN included)."""
    hu = np.uint32(h)
    sign = (hu & np.uint32(0x8000)) << _U16
    exp = (hu >> np.uint32(10)) & np.uint32(0x1F)
    man = hu & np.uint32(0x3FF)
    if exp == 0:  # zero or subnormal: man * 2**-24
        v = np.float32(np.float64(man) * _TWO_M24)
        return -v if sign else v
    if exp == 31:  # inf or NaN
        return np.uint32(sign | _EXP_ALL | (man << _U13)).view(np.float32)
    bits = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << _U13)
    return np.uint32(bits).view(np.float32)


@njit(cache=True, nogil=True, inline="always")
def f32_to_f16_sr(x: np.float32, bits: np.uint64) -> np.uint16:
    """float32 -> fp16 bits, rounded stochastically with the low 16 of ``bits``."""
    u = np.float32(x).view(np.uint32)
    sign = (u >> _U16) & np.uint32(0x8000)
    a = u & _ABS
    if a > _EXP_ALL:  # NaN
        return np.uint16(sign | np.uint32(0x7E00))
    if a >= _F16_MIN_NORMAL_BITS:
        # Normal range: 13 mantissa bits dropped; the uniform 13-bit addend
        # carries with probability (dropped) / 2**13 (into the exponent too).
        r = ((a + np.uint32(bits & _LOW13)) >> _U13) - _F16_REBIAS
        if r >= _F16_INF:  # beyond 65504 (or float32 inf): inf
            r = _F16_INF
        return np.uint16(sign | r)
    # Subnormal range: a multiple of 2**-24; round up with the fraction's
    # probability (a 16-bit uniform: bias below 2**-16 of a step).
    scaled = abs(np.float64(x)) / _TWO_M24  # exact (a power-of-two scale)
    low = np.floor(scaled)
    if np.float64(bits & _LOW16) * _INV_2_16 < scaled - low:
        low += 1.0
    return np.uint16(sign | np.uint32(low))  # 1024 -> 0x400, the smallest normal


@njit(cache=True, nogil=True, inline="always")
def f32_to_half_sr(x: np.float32, bits: np.uint64, code: int) -> np.uint16:
    """float32 -> the 16-bit pattern of ``code`` (``BF16`` or ``FP16``), rounded
    stochastically with the low 16 of ``bits``."""
    if code == BF16:
        return f32_to_bf16_sr(x, bits)
    return f32_to_f16_sr(x, bits)


@njit(cache=True, nogil=True, inline="always")
def half_to_f32(h: np.uint16, code: int) -> np.float32:
    """The 16-bit pattern ``h`` of ``code`` (``BF16`` or ``FP16``) -> float32 (exact)."""
    return bf16_to_f32(h) if code == BF16 else f16_to_f32(h)


@njit(cache=True, nogil=True)
def _sr_kernel(x: np.ndarray, out: np.ndarray, code: int, key: np.uint64) -> None:
    word = np.uint64(0)
    for i in range(x.size):
        if i & 3 == 0:
            word = random_bits(key, np.uint64(i >> 2))
        out[i] = f32_to_half_sr(x[i], element_bits(word, i), code)


def encode_sr(values: np.ndarray, dtype: str, key: int) -> np.ndarray:
    """float32 ``values`` (any shape) -> the stored array of ``dtype`` ('fp16' or
    'bf16'), stochastically rounded with random bits keyed by ``key`` and each
    element's flat position."""
    x = np.ascontiguousarray(values, np.float32).reshape(-1)
    out = np.empty(x.size, np.uint16)
    _sr_kernel(x, out, CODES[dtype], np.uint64(key))
    return out.view(STORED_DTYPES[dtype]).reshape(np.shape(values))


def dtype_name(array: np.ndarray) -> str:
    """The table dtype a stored weights array holds ('fp32', 'fp16', 'bf16');
    any other dtype reads as its numpy name."""
    return _NAMES.get(array.dtype, str(array.dtype))


def decode(array: np.ndarray) -> np.ndarray:
    """Stored weights (float32, float16, or uint16 bf16 bits) -> float32 (exact)."""
    if array.dtype == np.uint16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(array, np.float32)


def encode_nearest(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` -> the stored array of ``dtype``, rounded to nearest
    (ties to even): a one-off conversion (loading across dtypes), not an update."""
    x = np.asarray(values, np.float32)
    if dtype != "bf16":
        with np.errstate(over="ignore"):  # beyond fp16's range: inf, as intended
            return x.astype(STORED_DTYPES[dtype])
    u = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
