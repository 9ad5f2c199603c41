"""Row order: a bounded buffer that batches rows in read order or draws them at random.

``RowBuffer(buffer_rows=0)`` is a FIFO: rows leave in the order they came.
With ``buffer_rows = N > 0`` it holds at least N rows (until the input ends) and
each batch is a uniform draw without replacement from everything held, the
classic shuffle buffer; memory is ``(N + B + one block)`` rows. Draws come from
the caller's seeded ``numpy.random.Generator``, so the same input in the same
order gives the same batches.

Removing a batch costs O(B): drawn slots are refilled from the buffer's tail.

Sequence features (several ids per row) live in one pool of ids per feature;
each row slot holds its bag's ``(start, length)`` in the pool, so a row moves
(and is drawn) as two integers, and a batch gathers whole bags. Ids of rows that
left stay in the pool until it fills; then the live bags are compacted into a
fresh pool (amortised O(1) per id).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from estuary.data.types import Float32Array, Int64Array, JaggedIds

__all__ = ["RowBuffer"]


class RowBuffer:
    """Rows waiting to be batched (see module docstring).

    Args:
        num_dense: Dd.
        num_sparse: F.
        buffer_rows: N; ``0`` keeps read order.
        rng: the draws (``None`` only with ``buffer_rows == 0``).
        num_sequences: S, sequence features (a bag of ids per row each).
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        buffer_rows: int,
        rng: np.random.Generator | None,
        num_sequences: int = 0,
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
        self._bag_start: Int64Array = np.empty((capacity, num_sequences), np.int64)
        self._bag_len: Int64Array = np.empty((capacity, num_sequences), np.int64)
        self._pools: list[Int64Array] = [np.empty(1024, np.int64) for _ in range(num_sequences)]
        self._pool_used = [0] * num_sequences  # ids written to each pool
        self._head = 0  # FIFO: first live row
        self._size = 0  # live rows: [head, head + size)

    def __len__(self) -> int:
        return self._size

    def add(
        self,
        labels: Float32Array,
        dense: Float32Array,
        ids: Int64Array,
        row_ids: Int64Array,
        bags: Sequence[JaggedIds] = (),
    ) -> None:
        """Append R rows: labels (R,), dense (R, Dd), ids (R, F), row_ids (R,), and
        one ``JaggedIds`` of R rows per sequence feature (S of them)."""
        n = labels.shape[0]
        if self._head + self._size + n > self._labels.shape[0]:
            self._make_room(n)
        end = self._head + self._size
        self._labels[end : end + n] = labels
        self._dense[end : end + n] = dense
        self._ids[end : end + n] = ids
        self._row_ids[end : end + n] = row_ids
        assert len(bags) == len(self._pools), "one bag per sequence feature"
        for s, bag in enumerate(bags):
            count = int(bag.offsets[-1] - bag.offsets[0])
            if self._pool_used[s] + count > self._pools[s].shape[0]:
                self._compact(s, count)
            used = self._pool_used[s]
            self._pools[s][used : used + count] = bag.values[bag.offsets[0] : bag.offsets[-1]]
            self._bag_start[end : end + n, s] = used + bag.offsets[:-1] - bag.offsets[0]
            self._bag_len[end : end + n, s] = np.diff(bag.offsets)
            self._pool_used[s] = used + count
        self._size += n

    def ready(self, batch_size: int) -> bool:
        """Whether a full batch may leave now (the buffer keeps N rows back)."""
        return self._size >= self.buffer_rows + batch_size

    def take(
        self, batch_size: int
    ) -> tuple[Float32Array, Float32Array, Int64Array, Int64Array, list[JaggedIds]]:
        """Remove up to ``batch_size`` rows: (labels, dense, ids, row_ids, bags), copies."""
        b = min(batch_size, self._size)
        if self.buffer_rows == 0 or self.rng is None:
            rows = np.arange(self._head, self._head + b)
            index = slice(self._head, self._head + b)
            out = (
                self._labels[index].copy(),
                self._dense[index].copy(),
                self._ids[index].copy(),
                self._row_ids[index].copy(),
                self._gather_bags(rows),
            )
            self._head += b
            self._size -= b
            if self._size == 0:
                self._head = 0
                self._pool_used = [0] * len(self._pools)  # nothing live: reuse the pools
            return out
        n = self._size  # head is always 0 when shuffling
        drawn = self.rng.choice(n, size=b, replace=False)
        out = (
            self._labels[drawn],
            self._dense[drawn],
            self._ids[drawn],
            self._row_ids[drawn],
            self._gather_bags(drawn),
        )
        # Refill the drawn slots below n - b with the tail rows that were not drawn.
        tail = np.arange(n - b, n)
        movers = tail[~np.isin(tail, drawn)]
        holes = drawn[drawn < n - b]
        arrays = (self._labels, self._dense, self._ids, self._row_ids)
        for array in (*arrays, self._bag_start, self._bag_len):
            array[holes] = array[movers]
        self._size = n - b
        return out

    def _gather_bags(self, rows: Int64Array) -> list[JaggedIds]:
        """The bags of slots ``rows`` (B,), one ``JaggedIds`` of B rows per feature."""
        return [self._gather(rows, s) for s in range(len(self._pools))]

    def _gather(self, rows: Int64Array, s: int) -> JaggedIds:
        starts = self._bag_start[rows, s]
        lengths = self._bag_len[rows, s]
        offsets = np.zeros(rows.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return JaggedIds(values=self._pools[s][index], offsets=offsets)

    def _compact(self, s: int, incoming: int) -> None:
        """Copy feature ``s``'s live bags into a fresh pool with room for ``incoming``."""
        live = np.arange(self._head, self._head + self._size)
        bag = self._gather(live, s)
        kept = int(bag.offsets[-1])
        pool = np.empty(max(1024, 2 * (kept + incoming)), np.int64)
        pool[:kept] = bag.values
        self._bag_start[live, s] = bag.offsets[:-1]
        self._pools[s] = pool
        self._pool_used[s] = kept

    def _make_room(self, n: int) -> None:
        live = slice(self._head, self._head + self._size)
        need = self._size + n
        capacity = self._labels.shape[0]
        if need > capacity:
            capacity = max(need, 2 * capacity)
        arrays = []
        for array in (
            self._labels,
            self._dense,
            self._ids,
            self._row_ids,
            self._bag_start,
            self._bag_len,
        ):
            fresh = np.empty((capacity, *array.shape[1:]), array.dtype)
            fresh[: self._size] = array[live]
            arrays.append(fresh)
        self._labels, self._dense, self._ids, self._row_ids = arrays[:4]
        self._bag_start, self._bag_len = arrays[4:]
        self._head = 0
