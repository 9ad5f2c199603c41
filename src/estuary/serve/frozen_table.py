"""``FrozenTable``: an exported table served as stored: its rows stay in the
export's encoding (float32, float16, bfloat16 bits or int8 with a per-row
scale) and only the rows a request looks up are decoded to float32.

Memory per row: the id (8 bytes, the sorted index) plus D x 4 (float32),
D x 2 (float16, bfloat16) or D + 4 (int8 and its float32 scale) bytes; an
``EmbeddingTable`` holding the same rows decoded also keeps optimizer slots,
a hash index and per-row bookkeeping for training.

Lookups read what ``EmbeddingTable.lookup(ids, train=False)`` reads: an id's own
row, or, for an id without one, the unknown row of the shard that owns it
(``estuary.embedding.hashing.shard_of``, the table's routing). Decoding a row
subset is the same element-wise arithmetic as decoding every row at load, so
predictions equal those of the rows decoded whole (``tests/serve/test_rows.py``).

The table is read-only: an export is one version; a server that applies
updates follows a run (``estuary serve --follow``), whose tables are
``EmbeddingTable``s.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
from numba import njit

from estuary.embedding.delta import IDS, UNKNOWN_PREFIX, WEIGHTS
from estuary.embedding.hashing import _ROUTE_SALT as ROUTE_SALT
from estuary.embedding.hashing import as_ids, mix64, shard_of
from estuary.embedding.storage import rows_out
from estuary.embedding.types import Float32Array, Int64Array, TableStats

__all__ = ["SCALE", "UNSCALED_ROW_DTYPES", "FrozenTable", "decode_rows"]

State = dict[str, np.ndarray]
SCALE = "weights.scale"
"""The int8 encoding's per-row float32 scale (row = int8 values x scale)."""
_UNKNOWN = UNKNOWN_PREFIX + WEIGHTS


@njit(cache=True, nogil=True)
def _gather_sorted(
    sorted_ids: Int64Array,
    weights: Float32Array,
    unknown: Float32Array,
    ids: Int64Array,
    out: Float32Array,
) -> int:
    """``FrozenTable.lookup`` of float32 rows: each id's row found in
    ``sorted_ids`` copied from ``weights`` into ``out``, else its shard's
    unknown row (``shard_of``'s routing over S = ``unknown.shape[0]`` shards);
    returns how many ids had a row."""
    n = sorted_ids.size
    shards = np.uint64(unknown.shape[0])
    found = 0
    for i in range(ids.size):
        j = np.searchsorted(sorted_ids, ids[i])
        if j < n and sorted_ids[j] == ids[i]:
            out[i, :] = weights[j, :]
            found += 1
        elif shards > 1:
            out[i, :] = unknown[np.int64(mix64(np.uint64(ids[i]) ^ ROUTE_SALT) % shards), :]
        else:
            out[i, :] = unknown[0, :]
    return found


# The row encodings ``decode_rows`` reads without a scale (bfloat16 as uint16 bits).
UNSCALED_ROW_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16)})


def decode_rows(weights: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """Stored rows -> float32, by their dtype: float32 as is, float16 widened,
    uint16 as bfloat16 bits (the top half of a float32), int8 times ``scale``."""
    if weights.dtype == np.float32:
        return weights
    if weights.dtype == np.float16:
        return weights.astype(np.float32)
    if weights.dtype == np.uint16:
        return (weights.astype(np.uint32) << 16).view(np.float32)
    if weights.dtype == np.int8:
        if scale is None:
            raise ValueError(f"int8 rows need their {SCALE!r}")
        return weights.astype(np.float32) * scale[:, None]
    raise ValueError(f"rows of dtype {weights.dtype} are not an export encoding")


class ReadOnlyStore:
    """A served table's writing methods (the ``TableStore`` protocol's), each
    refused with a ``TypeError`` naming the table (``_read_only``)."""

    name: str

    def _read_only(self, what: str) -> NoReturn:
        raise TypeError(f"table {self.name!r}: served tables are read-only ({what})")

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        self._read_only("apply_gradients")

    def load_state_dict(self, state: State) -> None:
        self._read_only("load_state_dict")

    def delta_state_dict(self) -> State:
        self._read_only("delta_state_dict")

    def apply_delta(self, delta: State) -> None:
        self._read_only("apply_delta")


class FrozenTable(ReadOnlyStore):
    """One exported table's rows, read-only, in their stored encoding.

    Args:
        name: the table's name (in errors).
        state: the export's tensors: ``ids`` (R,), ``weights`` (R, D) encoded,
            ``weights.scale`` (R,) for int8 rows, ``unknown.weights`` (S', D).
        shards: S, the table's shard count (its routing of unknown ids); saved
            unknown rows of another count S' are averaged, as
            ``EmbeddingTable.load_state_dict`` does.
    """

    def __init__(self, name: str, state: State, shards: int) -> None:
        self.name = name
        ids = as_ids(state[IDS])
        weights = np.asarray(state[WEIGHTS])
        if weights.ndim != 2 or weights.shape[0] != ids.size:
            raise ValueError(f"{name}: weights shape {weights.shape} does not fit {ids.size} ids")
        scale = state.get(SCALE)
        if scale is not None and np.shape(scale) != (ids.size,):
            raise ValueError(f"{name}: {SCALE} shape {np.shape(scale)}, expected ({ids.size},)")
        order = np.argsort(ids, kind="stable")
        self.ids = np.ascontiguousarray(ids[order])
        if self.ids.size > 1 and not (np.diff(self.ids) > 0).all():
            raise ValueError(f"{name}: duplicate ids")
        self.weights = np.ascontiguousarray(weights[order])
        self.scale = None if scale is None else np.ascontiguousarray(scale[order], np.float32)
        decode_rows(self.weights[:0], None if self.scale is None else self.scale[:0])
        unknown = np.asarray(state[_UNKNOWN], np.float32).reshape(-1, weights.shape[1])
        if unknown.shape[0] != shards:
            unknown = np.repeat(unknown.mean(axis=0, keepdims=True), shards, axis=0)
        self.unknown = np.ascontiguousarray(unknown)
        self.shards = shards
        self._lookups = self._hits = 0

    @classmethod
    def from_sorted(
        cls,
        name: str,
        ids: Int64Array,
        weights: np.ndarray,
        unknown: np.ndarray,
        shards: int,
        scale: np.ndarray | None = None,
    ) -> FrozenTable:
        """A table over rows already in its layout (``ids`` sorted and unique,
        ``weights`` in their order, e.g. ``estuary.serve.prepared``'s): the arrays
        are kept as given (no sort, no copy), only their shapes checked."""
        if weights.ndim != 2 or weights.shape[0] != ids.size:
            raise ValueError(f"{name}: weights shape {weights.shape} does not fit {ids.size} ids")
        decode_rows(weights[:0], None if scale is None else scale[:0])
        if unknown.ndim != 2 or unknown.shape[1] != weights.shape[1]:
            raise ValueError(
                f"{name}: unknown rows {unknown.shape} do not fit dim {weights.shape[1]}"
            )
        if unknown.shape[0] != shards:
            unknown = np.repeat(unknown.mean(axis=0, keepdims=True), shards, axis=0)
        table = cls.__new__(cls)
        table.name, table.ids, table.weights, table.scale = name, ids, weights, scale
        table.unknown = np.ascontiguousarray(unknown, np.float32)
        table.shards = shards
        table._lookups = table._hits = 0
        return table

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held: the sorted ids, the rows as stored, their scales, the unknown rows."""
        scale = 0 if self.scale is None else self.scale.nbytes
        return self.ids.nbytes + self.weights.nbytes + scale + self.unknown.nbytes

    def lookup(
        self, ids: Int64Array, *, train: bool, out: Float32Array | None = None
    ) -> Float32Array:
        """Rows of ``ids`` (N,) as float32 (N, D), into ``out`` when given; an id
        without a row reads its shard's unknown row. ``train`` must be False."""
        if train:
            raise TypeError(f"table {self.name!r}: an export's tables are read-only")
        ids = as_ids(ids)
        out = rows_out(out, ids.size, self.dim)
        if ids.size == 0:
            return out
        if (
            self.weights.dtype == np.float32
            and self.ids.size
            and self.unknown.shape[0] == self.shards
        ):
            # One compiled call finds and copies the rows (the GIL released):
            # per table, ~10 numpy calls fewer on the request path.
            found = _gather_sorted(self.ids, self.weights, self.unknown, ids, out)
            self._lookups += int(ids.size)
            self._hits += int(found)
            return out
        at = np.searchsorted(self.ids, ids)
        at[at == self.ids.size] = 0
        hit = self.ids[at] == ids if self.ids.size else np.zeros(ids.size, np.bool_)
        slots = at[hit]
        scale = None if self.scale is None else self.scale[slots]
        out[hit] = decode_rows(self.weights[slots], scale)
        miss = ~hit
        if miss.any():
            owner = shard_of(ids[miss], self.shards) if self.shards > 1 else 0
            out[miss] = self.unknown[owner]
        self._lookups += int(ids.size)
        self._hits += int(slots.size)
        return out

    def state_dict(self) -> State:
        """The rows decoded to float32 (``ids``, ``weights``, ``unknown.weights``)."""
        return {
            IDS: self.ids.copy(),
            WEIGHTS: decode_rows(self.weights, self.scale).copy(),
            _UNKNOWN: self.unknown.copy(),
        }

    def stats(self) -> TableStats:
        return TableStats(
            rows=int(self.ids.size), bytes=self.nbytes, lookups=self._lookups, hits=self._hits
        )

    def _read_only(self, what: str) -> NoReturn:
        raise TypeError(
            f"table {self.name!r}: an export's tables are read-only ({what}); "
            "to serve updates, follow the run: estuary serve --follow RUN_DIR"
        )
