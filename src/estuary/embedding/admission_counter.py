"""What every admission counter shares: the rule's trivial cases and one
sighting per call's distinct ids (``AdmissionCounter.observe``); how counts are
kept and decided is the counter's own (``admission.AdmissionFilter``: exact;
``admission_sketch.SketchAdmissionFilter``: a count-min sketch)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import numpy as np

from estuary.config.spec import AdmissionSpec
from estuary.embedding.hashing import as_ids
from estuary.embedding.types import Int64Array

MAX_MIN_COUNT = 1 << 16  # an exact counter's ceiling for a raised min_count


class AdmissionCounter(ABC):
    """Decides admission of row-less ids by their counts (``spec``'s rule)."""

    spec: AdmissionSpec
    # Off while a multi-epoch run re-reads rows it has already counted.
    counting: bool = True

    @property
    def admits_all(self) -> bool:
        """True when every id is admitted at first sight (nothing to count)."""
        return self.spec.min_count <= 1 and self.spec.probability >= 1.0

    @property
    def max_min_count(self) -> int:
        """The highest ``min_count`` this counter can decide (it counts that far)."""
        return MAX_MIN_COUNT

    def raise_min_count(self, min_count: int) -> int:
        """Admit only ids seen ``min_count`` times from now on (the scaling
        manager's memory rule): never lowered, at most ``max_min_count``;
        returns the rule's ``min_count`` now. Ids already pending keep their
        counts."""
        new = min(max(self.spec.min_count, min_count), self.max_min_count)
        if new != self.spec.min_count:
            self.spec = replace(self.spec, min_count=new)
        return new

    def observe(self, ids: Int64Array) -> Int64Array:
        """Count one sighting of each of ``ids`` (N,) and decide.

        Args:
            ids: int64 (N,) ids without a row, duplicates allowed.

        Returns:
            The admitted ids, unique int64 (A,). Each distinct id is decided
            once per call, with all its occurrences counted.
        """
        ids = as_ids(ids)
        if self.admits_all:
            return np.unique(ids)
        if not self.counting:
            return np.empty(0, np.int64)
        uniq, counts = np.unique(ids, return_counts=True)
        return self._decide(uniq, counts.astype(np.int64, copy=False))

    @abstractmethod
    def __len__(self) -> int:
        """Ids the counter holds counts of (pending)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Memory the counts take."""

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """The counts, as arrays a checkpoint stores."""

    @abstractmethod
    def _decide(self, uniq: Int64Array, counts: Int64Array) -> Int64Array:
        """Count unique ids ``uniq`` (U,) seen ``counts`` (U,) times each in one
        call and return those admitted."""
