"""Tables prepared for serving: each table's rows sorted by id, in the checkpoint's
encoding, with deltas merged in (a version prepared whole).

``PreparedTable`` holds what a lookup reads (``FrozenTable``'s layout: sorted
ids, the rows as stored, the shards' unknown rows) and the checkpoint chain's
keys, so a delta is checked as ``EmbeddingTable.apply_delta`` checks it (same
lineage, based on the version held, or full). Merging a delta does what
``EmbeddingTable.apply_delta`` does to the rows a lookup reads: the delta's
evicted ids are removed, then its rows upserted, and its unknown rows (when it
has them) replace the held ones. So a ``FrozenTable`` over a prepared table
looks up what the ``EmbeddingTable`` restored from the same chain looks up
(``tests/serve/test_process_follow.py``).

The version a server swaps in is handed over in slot files
(``estuary.serve.slots``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from estuary.embedding.delta import (
    BASE,
    EVICTED_IDS,
    IDS,
    LINEAGE,
    UNKNOWN_PREFIX,
    VERSION,
    WEIGHTS,
    is_full,
)
from estuary.embedding.hashing import as_ids
from estuary.serve.frozen_table import decode_rows

__all__ = ["PreparedTable", "check_delta", "delta_version"]

State = Mapping[str, np.ndarray]
_UNKNOWN = UNKNOWN_PREFIX + WEIGHTS


def check_delta(name: str, lineage: int, version: int, delta: State) -> tuple[int, int, bool]:
    """Whether ``delta`` applies on table ``name`` at chain keys ``lineage`` and
    ``version``, as ``EmbeddingTable.apply_delta`` checks it: returns the keys
    after it and whether it carries every row (``is_full``).

    Raises:
        ValueError: not a delta, from another chain, or not based on ``version``.
    """
    if BASE not in delta:
        raise ValueError(f"{name}: not a delta (no {BASE!r})")
    delta_lineage, base = int(delta[LINEAGE][0]), int(delta[BASE][0])
    if delta_lineage != lineage:
        raise ValueError(
            f"{name}: delta is from checkpoint chain {delta_lineage:#x}, "
            f"this table follows {lineage:#x}"
        )
    full = is_full(dict(delta))
    if base != version and not full:
        raise ValueError(
            f"{name}: delta applies on top of version {base}, this table is at "
            f"version {version} (apply deltas in order, once each)"
        )
    return delta_lineage, delta_version(delta, version), full


def delta_version(delta: State, version: int) -> int:
    """The table version after ``delta`` (``version`` when it names none)."""
    return int(delta[VERSION][0]) if VERSION in delta else version


@dataclass
class PreparedTable:
    """One table's rows as a lookup reads them, and its chain keys.

    Args:
        name: the table's name (in errors).
        ids: int64 (R,), sorted, unique.
        weights: (R, D) as stored (float32, float16 or bfloat16 bits as uint16).
        unknown: float32 (S', D), the unknown rows as saved.
        lineage, version: the checkpoint chain's keys of the state held.
    """

    name: str
    ids: np.ndarray
    weights: np.ndarray
    unknown: np.ndarray
    lineage: int
    version: int

    @classmethod
    def from_state(cls, name: str, state: State) -> PreparedTable:
        """A table state (``state_dict``, any shard count) as a prepared table."""
        ids = as_ids(state[IDS])
        weights = np.asarray(state[WEIGHTS])
        if weights.ndim != 2 or weights.shape[0] != ids.size:
            raise ValueError(f"{name}: weights shape {weights.shape} does not fit {ids.size} ids")
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        if sorted_ids.size > 1 and not (np.diff(sorted_ids) > 0).all():
            raise ValueError(f"{name}: duplicate ids")
        unknown = np.asarray(state[_UNKNOWN], np.float32).reshape(-1, weights.shape[1])
        return cls(
            name,
            np.ascontiguousarray(sorted_ids),
            np.ascontiguousarray(weights[order]),
            np.array(unknown),
            int(state[LINEAGE][0]) if LINEAGE in state else 0,
            int(state[VERSION][0]) if VERSION in state else 0,
        )

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    def apply(self, delta: State) -> PreparedTable:
        """This table with ``delta`` (a ``delta_state_dict``) merged in, as a new
        table (this one is left as it is: it may still be served).

        Raises:
            ValueError: ``delta`` is not based on this state (as
                ``EmbeddingTable.apply_delta``), or its rows do not fit.
        """
        lineage, _, full = check_delta(self.name, self.lineage, self.version, delta)
        if full:
            return PreparedTable.from_state(self.name, {**delta, _UNKNOWN: self._unknown(delta)})
        ids, weights = self.ids, self.weights
        gone = as_ids(delta.get(EVICTED_IDS, np.empty(0, np.int64)))
        if gone.size and ids.size:
            at = np.searchsorted(ids, gone)
            inside = at < ids.size
            at = at[inside][ids[at[inside]] == gone[inside]]
            if at.size:
                keep = np.ones(ids.size, np.bool_)
                keep[at] = False
                ids, weights = ids[keep], weights[keep]
        new_ids = as_ids(delta[IDS])
        rows = np.asarray(delta[WEIGHTS])
        if rows.shape != (new_ids.size, self.dim):
            raise ValueError(
                f"{self.name}: delta weights {rows.shape}, expected ({new_ids.size}, {self.dim})"
            )
        if rows.dtype != weights.dtype:  # another encoding: both as float32
            rows, weights = decode_rows(rows, None), decode_rows(weights, None)
        order = np.argsort(new_ids, kind="stable")
        new_ids, rows = new_ids[order], rows[order]
        at = np.searchsorted(ids, new_ids)
        hit = np.zeros(new_ids.size, np.bool_)
        inside = at < ids.size
        hit[inside] = ids[at[inside]] == new_ids[inside]
        fresh = ~hit
        merged_ids = np.insert(ids, at[fresh], new_ids[fresh])
        merged = np.insert(weights, at[fresh], rows[fresh], axis=0)
        # Rows that were held: their new places after the insertions before them.
        if hit.any():
            shift: np.ndarray = np.cumsum(fresh) - fresh  # insertions placed before each hit
            merged[at[hit] + shift[hit]] = rows[hit]
        return PreparedTable(
            self.name,
            merged_ids,
            merged,
            self._unknown(delta),
            lineage,
            delta_version(delta, self.version),
        )

    def _unknown(self, delta: State) -> np.ndarray:
        if _UNKNOWN not in delta:
            return self.unknown
        return np.array(np.asarray(delta[_UNKNOWN], np.float32).reshape(-1, self.dim))
