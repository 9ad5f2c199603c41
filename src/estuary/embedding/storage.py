"""Contiguous row storage of one shard: float32 (R, W), weights then optimizer state.

Row 0 is the shard's shared *unknown* row (read by ids without a row, trained by
their gradients); rows 1.. belong to ids via the hash index. The column layout
of a row is the optimizer's (see ``estuary.embedding.optimizers``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from estuary.embedding.types import Float32Array, Int64Array

UNKNOWN_ROW = 0


@njit(cache=True, nogil=True)
def _gather_kernel(storage: Float32Array, rows: Int64Array, out: Float32Array) -> None:
    dim = out.shape[1]
    for n in range(rows.size):
        r = rows[n]
        if r < 0:
            r = 0  # UNKNOWN_ROW
        for j in range(dim):
            out[n, j] = storage[r, j]


class RowStorage:
    """Growable float32 (R, W) array; grows by doubling (amortised O(1) per row).

    Args:
        width: floats per row W (weights + optimizer state).
        capacity_rows: rows allocated up front (row 0 included).
    """

    def __init__(self, width: int, capacity_rows: int) -> None:
        self.width = width
        self.array: Float32Array = np.zeros((max(1, capacity_rows), width), np.float32)

    @property
    def capacity_rows(self) -> int:
        """Rows allocated (R_alloc >= rows in use)."""
        return int(self.array.shape[0])

    @property
    def nbytes(self) -> int:
        """Memory held by the array."""
        return int(self.array.nbytes)

    def ensure_rows(self, rows: int) -> None:
        """Make rows ``0 .. rows-1`` addressable (copies once per doubling)."""
        if rows <= self.array.shape[0]:
            return
        grown = np.empty((max(rows, 2 * self.array.shape[0]), self.width), np.float32)
        grown[: self.array.shape[0]] = self.array
        self.array = grown

    def gather(self, rows: Int64Array, dim: int) -> Float32Array:
        """Weights of ``rows`` int64 (N,) -> fresh float32 (N, D); row < 0 reads row 0."""
        out = np.empty((rows.size, dim), np.float32)
        _gather_kernel(self.array, rows, out)
        return out
