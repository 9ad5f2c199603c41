"""An embedding table: ids routed to ``spec.shards`` shards by a stable id hash.

Shapes: ``N`` ids in a call, ``D`` dim, ``S`` shards, ``R`` rows.

Routing is ``splitmix64(id ^ salt) mod S`` (``estuary.embedding.hashing.route``),
the same in every process, so a shard can later live in its own process. Each
shard keeps its own unknown row: a single shared one would make every shard's
misses write one remote row.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from estuary.config.spec import TableSpec
from estuary.embedding.hashing import as_ids, route, shard_of
from estuary.embedding.shard import IDS, UNKNOWN_PREFIX, EmbeddingShard
from estuary.embedding.types import Float32Array, Int64Array, TableStats

# Per-row keys that ``state_dict`` concatenates across shards (alongside IDS); the
# pending-admission pair is routed by its own ids.
_PENDING = ("admission.ids", "admission.counts")


class EmbeddingTable:
    """Hash-keyed embedding table of ``spec.shards`` shards. Implements ``EmbeddingStore``.

    Args:
        spec: table settings; ``spec.shards`` fixes S.
        seed: job seed; an id's initial row depends only on (seed, name, id).
        name: table name.
        max_pending_ids: per-shard bound on ids counted by admission.

    With S = 1 every call goes straight to the shard (no routing, no copies).
    Shards are called one after another from the caller's thread.
    """

    def __init__(
        self, spec: TableSpec, seed: int, name: str, *, max_pending_ids: int = 1 << 20
    ) -> None:
        self.spec = spec
        self.name = name
        # Each shard pre-allocates its share of the initial capacity.
        per_shard = -(-spec.initial_capacity_rows // spec.shards)
        shard_spec = replace(spec, initial_capacity_rows=per_shard)
        self.shards = [
            EmbeddingShard(shard_spec, seed, name, max_pending_ids=max_pending_ids)
            for _ in range(spec.shards)
        ]

    @property
    def dim(self) -> int:
        """Embedding width D."""
        return self.spec.dim

    def __len__(self) -> int:
        """Ids holding their own row, over all shards."""
        return sum(len(s) for s in self.shards)

    def lookup(self, ids: Int64Array, *, train: bool) -> Float32Array:
        """Rows of ``ids`` int64 (N,) -> fresh float32 (N, D), in input order.

        See ``EmbeddingShard.lookup`` for ``train``.
        """
        if len(self.shards) == 1:
            return self.shards[0].lookup(ids, train=train)
        ids = as_ids(ids)
        order, offsets = route(ids, len(self.shards))
        out = np.empty((ids.size, self.dim), np.float32)
        for k, shard in enumerate(self.shards):
            sel = order[offsets[k] : offsets[k + 1]]
            if sel.size:
                out[sel] = shard.lookup(ids[sel], train=train)
        return out

    def apply_gradients(self, ids: Int64Array, grads: Float32Array) -> None:
        """One optimizer step; ``ids`` int64 (N,) unique, ``grads`` float32 (N, D).

        See ``EmbeddingShard.apply_gradients``.
        """
        if len(self.shards) == 1:
            self.shards[0].apply_gradients(ids, grads)
            return
        ids = as_ids(ids)
        grads = np.asarray(grads, np.float32)
        if grads.shape != (ids.size, self.dim):
            raise ValueError(f"grads must have shape ({ids.size}, {self.dim}), got {grads.shape}")
        order, offsets = route(ids, len(self.shards))
        for k, shard in enumerate(self.shards):
            sel = order[offsets[k] : offsets[k + 1]]
            if sel.size:
                shard.apply_gradients(ids[sel], grads[sel])

    def remove(self, ids: Int64Array) -> int:
        """Drop the rows of ``ids`` int64 (N,); returns how many existed."""
        if len(self.shards) == 1:
            return self.shards[0].remove(ids)
        ids = as_ids(ids)
        order, offsets = route(ids, len(self.shards))
        return sum(
            shard.remove(ids[order[offsets[k] : offsets[k + 1]]])
            for k, shard in enumerate(self.shards)
        )

    def stats(self) -> TableStats:
        """Counters summed over shards."""
        total = TableStats()
        for shard in self.shards:
            total = total + shard.stats()
        return total

    def state_dict(self) -> dict[str, np.ndarray]:
        """The shards' ``state_dict`` arrays concatenated (row keys, pending keys)
        and stacked (``unknown.*``: leading axis S, one unknown row per shard).
        Layout otherwise as ``EmbeddingShard.state_dict``."""
        if len(self.shards) == 1:
            return self.shards[0].state_dict()
        parts = [shard.state_dict() for shard in self.shards]
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Load a table state saved with any shard count (reshards by routing ids).

        Unknown rows: with the same S each shard gets its own back; otherwise
        every shard gets the element-wise mean of the saved ones.
        """
        n = len(self.shards)
        ids = as_ids(state[IDS])
        owner = shard_of(ids, n)
        pending_ids = as_ids(state.get(_PENDING[0], np.empty(0, np.int64)))
        pending_owner = shard_of(pending_ids, n)
        saved_unknown = {k: np.asarray(v) for k, v in state.items() if k.startswith(UNKNOWN_PREFIX)}
        same_count = all(v.shape[0] == n for v in saved_unknown.values())
        for k, shard in enumerate(self.shards):
            part: dict[str, np.ndarray] = {}
            mine = owner == k
            mine_pending = pending_owner == k
            for key, value in state.items():
                if key.startswith(UNKNOWN_PREFIX):
                    arr = saved_unknown[key]
                    part[key] = arr[k : k + 1] if same_count else arr.mean(axis=0, keepdims=True)
                elif key in _PENDING:
                    part[key] = np.asarray(value)[mine_pending]
                else:
                    part[key] = np.asarray(value)[mine]
            shard.load_state_dict(part)
