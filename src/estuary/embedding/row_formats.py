"""Row formats: how a shard's float32 storage rows hold the weights (``TableSpec.dtype``).

Shapes: ``N`` rows in a call, ``D`` dim, ``W`` floats of the optimizer's row
layout (weights + state, ``estuary.embedding.optimizers``), ``V`` float32 words
a stored row takes.

``fp32`` keeps the optimizer's layout as is (V = W): the optimizer kernels
update the storage in place. ``fp16`` / ``bf16`` pack the weights two to a
float32 word, the float32 state after them::

    row r:  [ weights, D x 16 bit (ceil(D/2) words) | state (W - D floats) ]
            V = ceil(D / 2) + W - D

so a row stays one contiguous span (D=16 row-wise Adagrad: 36 B instead of 68).
An update decodes the touched rows into a float32 (N, W) scratch in the
optimizer's layout, runs the optimizer there (any optimizer, plugins included)
and encodes the weights back with stochastic rounding
(``estuary.embedding.precision``); state is copied back as it is. Optimizers
with a fused 16-bit kernel (``estuary.embedding.half_updates``: row-wise
Adagrad on bf16) update in one pass instead, to the same bits. Lookups decode straight
into the caller's float32 (N, D).

Formats are found by name in ``ROW_FORMATS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit

from estuary.embedding.half_updates import FUSED_HALF_UPDATES
from estuary.embedding.precision import (
    CODES,
    FP32,
    STORED_DTYPES,
    draw_row_bits,
    f32_to_half_sr,
    half_to_f32,
)
from estuary.embedding.prefetch import ROWS_AHEAD, prefetch_span
from estuary.embedding.types import Float32Array, Int64Array

if TYPE_CHECKING:
    from estuary.embedding.initializers import Initializer
    from estuary.embedding.optimizers import SparseOptimizer

__all__ = ["ROW_FORMATS", "Fp32Rows", "HalfRows", "RowFormat", "make_row_format"]


@njit(cache=True, nogil=True)
def _gather_kernel(storage: Float32Array, rows: Int64Array, out: Float32Array) -> None:
    dim = out.shape[1]
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size and rows[n + ROWS_AHEAD] >= 0:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, dim)
        r = rows[n]
        if r < 0:
            r = 0  # UNKNOWN_ROW
        for j in range(dim):
            out[n, j] = storage[r, j]


@njit(cache=True, nogil=True)
def _gather_half_kernel(bits: Any, rows: Int64Array, out: Float32Array, code: int) -> None:
    # bits: uint16 (R, 2V), the storage's 16-bit view; rows < 0 read row 0.
    dim = out.shape[1]
    width = bits.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size and rows[n + ROWS_AHEAD] >= 0:
            prefetch_span(bits, rows[n + ROWS_AHEAD] * width, dim)
        r = rows[n]
        if r < 0:
            r = 0  # UNKNOWN_ROW
        for j in range(dim):
            out[n, j] = half_to_f32(bits[r, j], code)


@njit(cache=True, nogil=True)
def _decode_rows_kernel(
    storage: Float32Array, bits: Any, rows: Int64Array, words: int, code: int, out: Float32Array
) -> None:
    # out (N, W) in the optimizer's layout: decoded weights, then the state.
    dim = out.shape[1] - (storage.shape[1] - words)
    width = storage.shape[1]
    for n in range(rows.size):
        if n + ROWS_AHEAD < rows.size:
            prefetch_span(storage, rows[n + ROWS_AHEAD] * width, width)
        r = rows[n]
        for j in range(dim):
            out[n, j] = half_to_f32(bits[r, j], code)
        for c in range(width - words):
            out[n, dim + c] = storage[r, words + c]


@njit(cache=True, nogil=True)
def _encode_rows_kernel(
    rows_in: Float32Array,
    storage: Float32Array,
    bits: Any,
    rows: Int64Array,
    ids: Int64Array,
    words: int,
    code: int,
    key: np.uint64,
) -> None:
    # The inverse of _decode_rows_kernel, weights rounded stochastically: the
    # random bits of element j of the row of id ids[n] depend on (key, id, j)
    # only, not on where the row sits (a restored table rounds alike).
    dim = rows_in.shape[1] - (storage.shape[1] - words)
    width = storage.shape[1]
    rnd = np.empty(dim, np.uint32)  # a row's draws (draw_row_bits)
    for n in range(rows.size):
        r = rows[n]
        draw_row_bits(key, ids[n], rnd)
        for j in range(dim):
            bits[r, j] = f32_to_half_sr(rows_in[n, j], rnd[j], code)
        for c in range(width - words):
            storage[r, words + c] = rows_in[n, dim + c]


class RowFormat(ABC):
    """How rows of the optimizer's float32 layout (width ``width``) sit in storage.

    Args:
        dim: embedding width D.
        width: floats per row in the optimizer's layout, W (>= D).
    """

    name: str = ""
    code: int = FP32  # precision's code of the stored weights

    def __init__(self, dim: int, width: int) -> None:
        self.dim = dim
        self.width = width

    @property
    def dtype(self) -> np.dtype:
        """numpy dtype of the stored weights (uint16 = bf16 bits)."""
        return STORED_DTYPES[self.name]

    @property
    @abstractmethod
    def words(self) -> int:
        """float32 words the weights of a row take."""

    @property
    def stored_width(self) -> int:
        """float32 words per stored row, V."""
        return self.words + self.width - self.dim

    def columns(self, cols: slice) -> slice:
        """Storage columns of the optimizer-layout state columns ``cols``."""
        shift = self.words - self.dim
        return slice(cols.start + shift, cols.stop + shift)

    @abstractmethod
    def weights(self, storage: Float32Array, rows: Any) -> np.ndarray:
        """Stored weights of ``rows`` (int64 (N,) or a slice), (N, D) of ``dtype``."""

    @abstractmethod
    def put_weights(self, storage: Float32Array, rows: Int64Array, values: np.ndarray) -> None:
        """Write stored weights ``values`` (N, D) of ``dtype`` into ``rows`` (N,)."""

    @abstractmethod
    def gather(self, storage: Float32Array, rows: Int64Array, out: Float32Array) -> None:
        """Weights of ``rows`` int64 (N,) as float32 into ``out`` (N, D); row < 0 reads row 0."""

    @abstractmethod
    def step(
        self,
        optimizer: SparseOptimizer,
        storage: Float32Array,
        rows: Int64Array,
        ids: Int64Array,
        grads: Float32Array,
        lr_scale: float,
        key: int,
    ) -> None:
        """One ``optimizer.step`` of ``rows`` (N,) unique, held by ``ids`` (N,),
        with ``grads`` float32 (N, D); ``key`` and the ids seed the rounding of
        16-bit weights."""

    @abstractmethod
    def fill(
        self,
        storage: Float32Array,
        rows: Int64Array,
        ids: Int64Array,
        initializer: Initializer,
        seed: int,
        state: Float32Array,
        key: int,
    ) -> None:
        """New rows: weights of ``ids`` (N,) from ``initializer`` (table seed
        ``seed``) and state columns set to ``state`` float32 (W - D,)."""

    @abstractmethod
    def reset_state(
        self,
        optimizer: SparseOptimizer,
        storage: Float32Array,
        rows: Int64Array,
        state: Float32Array,
    ) -> None:
        """Set the state columns of ``rows`` (N,) to their initial values ``state`` (W - D,)."""


class Fp32Rows(RowFormat):
    """float32 weights in the optimizer's own layout (kernels update in place)."""

    name = "fp32"

    @property
    def words(self) -> int:
        return self.dim

    def weights(self, storage: Float32Array, rows: Any) -> np.ndarray:
        return storage[rows, : self.dim]

    def put_weights(self, storage: Float32Array, rows: Int64Array, values: np.ndarray) -> None:
        storage[rows, : self.dim] = values

    def gather(self, storage: Float32Array, rows: Int64Array, out: Float32Array) -> None:
        _gather_kernel(storage, rows, out)

    def step(
        self,
        optimizer: SparseOptimizer,
        storage: Float32Array,
        rows: Int64Array,
        ids: Int64Array,
        grads: Float32Array,
        lr_scale: float,
        key: int,
    ) -> None:
        optimizer.step(storage, rows, grads, lr_scale=lr_scale)

    def fill(
        self,
        storage: Float32Array,
        rows: Int64Array,
        ids: Int64Array,
        initializer: Initializer,
        seed: int,
        state: Float32Array,
        key: int,
    ) -> None:
        initializer.fill(storage, rows, ids, seed)
        storage[rows, self.dim :] = state

    def reset_state(
        self,
        optimizer: SparseOptimizer,
        storage: Float32Array,
        rows: Int64Array,
        state: Float32Array,
    ) -> None:
        optimizer.init_state(storage, rows)


class HalfRows(RowFormat):
    """16-bit weights (``fp16`` or ``bf16``) packed two to a word, float32 state
    after them; updates through a float32 scratch (module docstring)."""

    def __init__(self, dim: int, width: int, name: str) -> None:
        super().__init__(dim, width)
        self.name = name
        self.code = CODES[name]

    @property
    def words(self) -> int:
        return (self.dim + 1) // 2

    def _bits(self, storage: Float32Array) -> np.ndarray:
        return storage.view(np.uint16)  # (R, 2V), weights in columns 0 .. D-1

    def weights(self, storage: Float32Array, rows: Any) -> np.ndarray:
        return self._bits(storage)[rows, : self.dim].view(self.dtype)

    def put_weights(self, storage: Float32Array, rows: Int64Array, values: np.ndarray) -> None:
        self._bits(storage)[rows, : self.dim] = np.asarray(values, self.dtype).view(np.uint16)

    def gather(self, storage: Float32Array, rows: Int64Array, out: Float32Array) -> None:
        _gather_half_kernel(self._bits(storage), rows, out, self.code)

    def _encode(
        self,
        rows_in: Float32Array,
        storage: Float32Array,
        rows: Int64Array,
        ids: Int64Array,
        key: int,
    ) -> None:
        bits, code = self._bits(storage), self.code
        _encode_rows_kernel(rows_in, storage, bits, rows, ids, self.words, code, np.uint64(key))

    def step(
        self,
        optimizer: SparseOptimizer,
        storage: Float32Array,
        rows: Int64Array,
        ids: Int64Array,
        grads: Float32Array,
        lr_scale: float,
        key: int,
    ) -> None:
        bits = self._bits(storage)
        fused = FUSED_HALF_UPDATES.get((type(optimizer), self.name))
        if fused is not None:  # one pass (estuary.embedding.half_updates)
            lr, decay = optimizer.rates(lr_scale)
            fused(optimizer, storage, bits, rows, ids, grads, lr, decay, self.words, key)
            return
        scratch = np.empty((rows.size, self.width), np.float32)  # (N, W)
        _decode_rows_kernel(storage, bits, rows, self.words, self.code, scratch)
        optimizer.step(scratch, np.arange(rows.size, dtype=np.int64), grads, lr_scale=lr_scale)
        self._encode(scratch, storage, rows, ids, key)

    def fill(
        self,
        storage: Float32Array,
        rows: Int64Array,
        ids: Int64Array,
        initializer: Initializer,
        seed: int,
        state: Float32Array,
        key: int,
    ) -> None:
        scratch = np.empty((rows.size, self.width), np.float32)  # (N, W)
        initializer.fill(scratch, np.arange(rows.size, dtype=np.int64), ids, seed)
        scratch[:, self.dim :] = state
        self._encode(scratch, storage, rows, ids, key)

    def reset_state(
        self,
        optimizer: SparseOptimizer,
        storage: Float32Array,
        rows: Int64Array,
        state: Float32Array,
    ) -> None:
        storage[rows, self.words :] = state


ROW_FORMATS: dict[str, Callable[[int, int], RowFormat]] = {
    "fp32": Fp32Rows,
    "fp16": lambda dim, width: HalfRows(dim, width, "fp16"),
    "bf16": lambda dim, width: HalfRows(dim, width, "bf16"),
}


def make_row_format(dtype: str, dim: int, width: int) -> RowFormat:
    """The row format of ``TableSpec.dtype`` ``dtype`` for rows of D ``dim``, W ``width``."""
    return ROW_FORMATS[dtype](dim, width)
