"""Fused optimizer updates of 16-bit rows (``estuary.embedding.row_formats``).

The generic 16-bit update decodes the touched rows into a float32 scratch, runs
the optimizer's own kernel there and encodes them back: two more passes over
the rows. A fused kernel here does all of it in the optimizer's one pass over
each row, with the same arithmetic as the float32 kernel and the same
stochastic rounding as the generic path (so both give the same bits).
Measured (``bench/ps.py``, 1M rows, row-wise Adagrad): the generic path runs
updates at 0.45-0.6x the fp32 rate; fused bf16, see ``docs/results.md``.

``FUSED_HALF_UPDATES`` maps (optimizer class, dtype) to its fused update; the
rest (fp16 rows, other optimizers, plugins) take the generic path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from estuary.embedding.optimizers import (
    RowwiseAdagrad,
    RowwiseAdagradElem,
    SparseOptimizer,
    _clamp,
    _elementwise_current_step,
    _row_mean_square,
    _rowwise_adagrad_rate,
)
from estuary.embedding.precision import (
    bf16_to_f32,
    counter_bits,
    element_offsets,
    f32_to_bf16_sr,
    row_seed,
)
from estuary.embedding.prefetch import ROWS_AHEAD, prefetch_span
from estuary.embedding.types import Float32Array, Int64Array

__all__ = ["FUSED_HALF_UPDATES", "HalfUpdate"]

HalfUpdate = Callable[..., None]
"""``(optimizer, storage, bits, rows, ids, grads, lr, decay, words, key)``."""


@njit(cache=True, nogil=True, error_model="numpy")
def _rowwise_adagrad_bf16_kernel(
    storage: Float32Array,
    bits: Any,
    rows: Int64Array,
    ids: Int64Array,
    grads: Float32Array,
    words: int,
    key: np.uint64,
    lr: float,
    eps: float,
    decay: float,
    clip: float,
) -> None:
    # optimizers._rowwise_adagrad_kernel (the same _rowwise_adagrad_rate) with the
    # weights read from and written to the bf16 view ``bits`` (R, 2V); the
    # accumulator is float32 word ``words``.
    # Each element's random bits come from a 32-bit hash of (row seed, j) and the
    # bf16 rounding is branch-free: the element loop, draws included, vectorises
    # (integer ops on 32-bit lanes; see docs/results.md for the measured rates).
    dim = grads.shape[1]
    eps32 = np.float32(eps)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    width = storage.shape[1]
    offsets = element_offsets(dim)  # row_element_bits(seed, j) = counter_bits(seed + offsets[j])
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        step = _rowwise_adagrad_rate(storage, r, words, grads, n, lr, eps32)
        seed = row_seed(key, ids[n])
        for j in range(dim):
            w = bf16_to_f32(bits[r, j]) * decay32 - step * grads[n, j]
            rnd = counter_bits(np.uint32(seed + offsets[j]))
            bits[r, j] = f32_to_bf16_sr(_clamp(w, clip32), rnd)


def _rowwise_adagrad_bf16(
    optimizer: RowwiseAdagrad,
    storage: Float32Array,
    bits: np.ndarray,
    rows: Int64Array,
    ids: Int64Array,
    grads: Float32Array,
    lr: float,
    decay: float,
    words: int,
    key: int,
) -> None:
    _rowwise_adagrad_bf16_kernel(
        storage, bits, rows, ids, grads, words, np.uint64(key),
        lr, optimizer.params.eps, decay, optimizer.clip,
    )  # fmt: skip


@njit(cache=True, nogil=True, error_model="numpy")
def _rowwise_adagrad_elem_bf16_kernel(
    storage: Float32Array,
    bits: Any,
    rows: Int64Array,
    ids: Int64Array,
    grads: Float32Array,
    words: int,
    key: np.uint64,
    lr: float,
    eps: float,
    decay: float,
    clip: float,
) -> None:
    # optimizers._rowwise_adagrad_elem_kernel on bf16 weights, drawn and rounded
    # as in _rowwise_adagrad_bf16_kernel.
    dim = grads.shape[1]
    lr32 = np.float32(lr)
    eps32 = np.float32(eps)
    decay32 = np.float32(decay)
    clip32 = np.float32(clip)
    width = storage.shape[1]
    offsets = element_offsets(dim)
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        past = storage[r, words]
        seed = row_seed(key, ids[n])
        for j in range(dim):
            step = _elementwise_current_step(past, grads[n, j], lr32, eps32)
            w = bf16_to_f32(bits[r, j]) * decay32 - step
            rnd = counter_bits(np.uint32(seed + offsets[j]))
            bits[r, j] = f32_to_bf16_sr(_clamp(w, clip32), rnd)
        storage[r, words] = past + _row_mean_square(grads, n)


def _rowwise_adagrad_elem_bf16(
    optimizer: RowwiseAdagradElem,
    storage: Float32Array,
    bits: np.ndarray,
    rows: Int64Array,
    ids: Int64Array,
    grads: Float32Array,
    lr: float,
    decay: float,
    words: int,
    key: int,
) -> None:
    _rowwise_adagrad_elem_bf16_kernel(
        storage, bits, rows, ids, grads, words, np.uint64(key),
        lr, optimizer.params.eps, decay, optimizer.clip,
    )  # fmt: skip


FUSED_HALF_UPDATES: dict[tuple[type[SparseOptimizer], str], HalfUpdate] = {
    (RowwiseAdagrad, "bf16"): _rowwise_adagrad_bf16,
    (RowwiseAdagradElem, "bf16"): _rowwise_adagrad_elem_bf16,
}
