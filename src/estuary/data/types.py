"""Batch types shared by readers, the embedding layer and the trainer.

A ``Batch`` holds B rows:

    labels  float32 (B,)
    dense   float32 (B, Dd)          already transformed (log1p), missing -> 0
    sparse  dict feature -> JaggedIds, in schema order

``JaggedIds`` is one feature's ids in CSR layout. For single-valued columns every
row has exactly one id, so ``offsets == arange(B + 1)`` (``TabularDataset.take``
gives all of a batch's single-valued features one shared, read-only such array)::

    rows:    r0      r1   r2
    ids:    [a, b] [ c ] [ ]         values  = [a, b, c]
                                     offsets = [0, 2, 3, 3]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]
Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class JaggedIds:
    """One feature's ids for a batch (CSR).

    Args:
        values: int64 (N,) raw 64-bit ids (hashes); any int64 value is valid.
        offsets: int64 (B + 1,) row boundaries into ``values``.
    """

    values: Int64Array
    offsets: Int64Array

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @classmethod
    def single(cls, values: Int64Array) -> JaggedIds:
        """One id per row."""
        return cls(values=values, offsets=np.arange(values.shape[0] + 1, dtype=np.int64))

    def take(self, rows: Int64Array) -> JaggedIds:
        """The sub-batch made of ``rows`` (in that order)."""
        starts = self.offsets[rows]
        lengths = self.offsets[rows + 1] - starts
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if np.all(lengths == 1):
            return JaggedIds(values=self.values[starts], offsets=offsets)
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return JaggedIds(values=self.values[index], offsets=offsets)

    @classmethod
    def concatenate(cls, bags: Sequence[JaggedIds]) -> JaggedIds:
        """One CSR column of the rows of ``bags`` in order (read-only arrays)."""
        values = np.concatenate([b.values for b in bags]) if bags else np.zeros(0, np.int64)
        offsets = np.zeros(1 + sum(b.num_rows for b in bags), dtype=np.int64)
        row, base = 1, 0
        for bag in bags:  # one step per bag, not per row
            offsets[row : row + bag.num_rows] = bag.offsets[1:] - bag.offsets[0] + base
            row += bag.num_rows
            base += int(bag.offsets[-1] - bag.offsets[0])
        for array in (values, offsets):
            array.flags.writeable = False
        return cls(values=values, offsets=offsets)


@dataclass(frozen=True)
class Batch:
    """B rows ready for the model (see module docstring for shapes).

    Args:
        labels: float32 (B,) 0/1 labels.
        dense: float32 (B, Dd) dense features.
        sparse: feature name -> ids, in schema order.
        row_ids: int64 (B,) position of each row in its source stream (global row
            number over all sources in file order); used for row accounting.
        origin: where the rows came from, when they all came from one source:
            a ``data.dataset`` batch gets ``"stream/source"`` (the task's names;
            for a joined stream its left source) from the graph's sink; ``None``
            when its rows mix sources (interleaved or shuffled together, or a
            batch across two sources' tasks) and for ``data.sources`` runs. It
            travels to every rank with the batch; an update plan may depend on it.
        weights: float32 (B,) per-row loss weights (e.g. importance weights of a
            sampled-down stream); ``None``: every row weighs 1.
    """

    labels: Float32Array
    dense: Float32Array
    sparse: dict[str, JaggedIds] = field(default_factory=dict)
    row_ids: Int64Array | None = None
    origin: str | None = None
    weights: Float32Array | None = None

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def take(self, rows: Int64Array) -> Batch:
        """The sub-batch made of ``rows`` (in that order)."""
        return Batch(
            labels=self.labels[rows],
            dense=self.dense[rows],
            sparse={name: ids.take(rows) for name, ids in self.sparse.items()},
            row_ids=None if self.row_ids is None else self.row_ids[rows],
            origin=self.origin,
            weights=None if self.weights is None else self.weights[rows],
        )

    @classmethod
    def concatenate(cls, batches: Sequence[Batch]) -> Batch:
        """The rows of ``batches`` in order, as one batch (they share features;
        ``row_ids``, ``origin`` and ``weights`` are dropped)."""
        first = batches[0]
        return cls(
            labels=np.concatenate([b.labels for b in batches]),
            dense=np.concatenate([b.dense for b in batches]),
            sparse={
                name: JaggedIds.concatenate([b.sparse[name] for b in batches])
                for name in first.sparse
            },
        )

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop``."""
        return self.take(np.arange(start, min(stop, self.num_rows), dtype=np.int64))
