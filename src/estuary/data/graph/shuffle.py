"""Row order: a bounded buffer that batches rows in read order or draws them at random.

``RowBuffer(buffer_rows=0)`` is a FIFO: rows leave in the order they came.
With ``buffer_rows = N > 0`` it holds at least N rows (until the input ends) and
each batch is a uniform draw without replacement from everything held, the
classic shuffle buffer; memory is ``(N + B + one block)`` rows. Draws come from
the caller's seeded ``numpy.random.Generator``, so the same input in the same
order gives the same batches.

Removing a batch costs O(B): drawn slots are refilled from the buffer's tail.
"""

from __future__ import annotations

import numpy as np

from estuary.data.types import Float32Array, Int64Array

__all__ = ["RowBuffer"]


class RowBuffer:
    """Rows waiting to be batched (see module docstring).

    Args:
        num_dense: Dd.
        num_sparse: F.
        buffer_rows: N; ``0`` keeps read order.
        rng: the draws (``None`` only with ``buffer_rows == 0``).
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        buffer_rows: int,
        rng: np.random.Generator | None,
    ) -> None:
        if buffer_rows and rng is None:
            raise ValueError("a shuffling buffer needs an rng")
        self.buffer_rows = buffer_rows
        self.rng = rng
        capacity = max(1024, buffer_rows)
        self._labels: Float32Array = np.empty(capacity, np.float32)
        self._dense: Float32Array = np.empty((capacity, num_dense), np.float32)
        self._ids: Int64Array = np.empty((capacity, num_sparse), np.int64)
        self._row_ids: Int64Array = np.empty(capacity, np.int64)
        self._head = 0  # FIFO: first live row
        self._size = 0  # live rows: [head, head + size)

    def __len__(self) -> int:
        return self._size

    def add(
        self, labels: Float32Array, dense: Float32Array, ids: Int64Array, row_ids: Int64Array
    ) -> None:
        """Append R rows: labels (R,), dense (R, Dd), ids (R, F), row_ids (R,)."""
        n = labels.shape[0]
        if self._head + self._size + n > self._labels.shape[0]:
            self._make_room(n)
        end = self._head + self._size
        self._labels[end : end + n] = labels
        self._dense[end : end + n] = dense
        self._ids[end : end + n] = ids
        self._row_ids[end : end + n] = row_ids
        self._size += n

    def ready(self, batch_size: int) -> bool:
        """Whether a full batch may leave now (the buffer keeps N rows back)."""
        return self._size >= self.buffer_rows + batch_size

    def take(self, batch_size: int) -> tuple[Float32Array, Float32Array, Int64Array, Int64Array]:
        """Remove up to ``batch_size`` rows: (labels, dense, ids, row_ids), copies."""
        b = min(batch_size, self._size)
        if self.buffer_rows == 0 or self.rng is None:
            index = slice(self._head, self._head + b)
            out = (
                self._labels[index].copy(),
                self._dense[index].copy(),
                self._ids[index].copy(),
                self._row_ids[index].copy(),
            )
            self._head += b
            self._size -= b
            if self._size == 0:
                self._head = 0
            return out
        n = self._size  # head is always 0 when shuffling
        drawn = self.rng.choice(n, size=b, replace=False)
        out = (self._labels[drawn], self._dense[drawn], self._ids[drawn], self._row_ids[drawn])
        # Refill the drawn slots below n - b with the tail rows that were not drawn.
        tail = np.arange(n - b, n)
        movers = tail[~np.isin(tail, drawn)]
        holes = drawn[drawn < n - b]
        for array in (self._labels, self._dense, self._ids, self._row_ids):
            array[holes] = array[movers]
        self._size = n - b
        return out

    def _make_room(self, n: int) -> None:
        live = slice(self._head, self._head + self._size)
        need = self._size + n
        capacity = self._labels.shape[0]
        if need > capacity:
            capacity = max(need, 2 * capacity)
        arrays = []
        for array in (self._labels, self._dense, self._ids, self._row_ids):
            fresh = np.empty((capacity, *array.shape[1:]), array.dtype)
            fresh[: self._size] = array[live]
            arrays.append(fresh)
        self._labels, self._dense, self._ids, self._row_ids = arrays
        self._head = 0
