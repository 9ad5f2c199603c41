"""Scores given to rows on arrival, held until the rows are committed.

With ``train.mixed_buffer`` and progressive evaluation, each row is scored as it
arrives, before the buffer takes it (``estuary.train.progressive``). The data
progress counts a row only once it leaves the buffer: trained (after its step)
or dropped (sampled out or evicted). A checkpoint taken while rows wait in the
buffer (or in a step read ahead) counts them in neither, and a resume reads and
scores them again. Filing a row's score only when the row is committed keeps the
progressive figures saved with a checkpoint in step with the data progress saved
beside it, so across a resume every row is scored exactly once.

``PendingScores`` holds, per row id, the label, the probability and whether the
row held an id never seen before (decided on arrival), in arrays indexed by a
``HashIndex`` slot: holding and taking are vectorised, and memory follows the
rows waiting (the buffer's rows plus a step read ahead), not the rows so far.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from estuary.embedding.hash_index import HashIndex
from estuary.embedding.memory import grown
from estuary.embedding.types import Int64Array

__all__ = ["PendingScores", "Taken"]

BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Taken:
    """Rows taken out of ``PendingScores`` (in the order asked, those held only).

    Args:
        row_ids: (K,) the rows found.
        labels: (K,) int8 in {0, 1}.
        probs: (K,) float32 probabilities given on arrival.
        new: (K,) whether the row held an id never seen before, on arrival.
    """

    row_ids: Int64Array
    labels: npt.NDArray[np.int8]
    probs: npt.NDArray[np.float32]
    new: BoolArray

    @property
    def rows(self) -> int:
        return int(self.row_ids.shape[0])


class PendingScores:
    """Arrival scores by row id until the rows are committed (module docstring).

    Thread-safe: rows arrive on the read-ahead thread in hybrid/async mode while
    the step's thread commits trained ones.
    """

    def __init__(self, capacity_rows: int = 1024) -> None:
        self._index = HashIndex(capacity_rows)
        self._labels = np.zeros(capacity_rows, np.int8)
        self._probs = np.zeros(capacity_rows, np.float32)
        self._new = np.zeros(capacity_rows, np.bool_)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes of the index and the per-row arrays."""
        return self._index.nbytes + self._labels.nbytes + self._probs.nbytes + self._new.nbytes

    def hold(
        self,
        row_ids: Int64Array,
        labels: npt.NDArray[np.int8],
        probs: npt.NDArray[np.float32],
        new: BoolArray,
    ) -> None:
        """Hold rows ``row_ids`` (N,) with their labels, probabilities and new-id
        flags (each (N,)); a row held again replaces its earlier score."""
        if row_ids.shape[0] == 0:
            return
        with self._lock:
            slots = self._index.get_or_insert(row_ids)
            need = int(slots.max()) + 1
            if need > self._labels.shape[0]:
                size = max(need, 2 * self._labels.shape[0])
                self._labels = grown(self._labels, size)
                self._probs = grown(self._probs, size)
                self._new = grown(self._new, size)
            self._labels[slots] = labels
            self._probs[slots] = probs
            self._new[slots] = new

    def new_row_ids(self) -> Int64Array:
        """int64 (K,): the rows held that held an id never seen before on arrival
        (saved with a checkpoint: ``ProgressiveEval.checkpoint_state``)."""
        with self._lock:
            keys, slots = self._index.items()
            return keys[self._new[slots]]

    def take(self, row_ids: Int64Array) -> Taken:
        """Remove rows ``row_ids`` (N,) and return those that were held."""
        with self._lock:
            slots = self._index.remove(row_ids)
            found = slots >= 0
            at = slots[found]
            return Taken(
                np.asarray(row_ids, np.int64)[found],
                self._labels[at].copy(),
                self._probs[at].copy(),
                self._new[at].copy(),
            )
