"""An embedding table: ids routed to ``spec.shards`` shards by a stable id hash.

Shapes: ``N`` ids in a call, ``D`` dim, ``S`` shards, ``R`` rows.

Routing is ``splitmix64(id ^ salt) mod S`` (``estuary.embedding.hashing.route``),
the same in every process, so a shard can later live in its own process. Each
shard keeps its own unknown row: a single shared one would make every shard's
misses write one remote row. Capacity is split evenly: each shard holds at most
``ceil(capacity_rows / S)`` rows. Every shard sees every step end (shards
without ids in a batch get ``advance_step``), so TTL in steps means the same
in each.

State dicts and deltas (layout in ``estuary.embedding.delta``) merge the shards'
parts; the table owns the checkpoint chain (``delta.lineage``/``delta.version``).
Both load into any shard count: rows, pending ids and evicted ids are routed by id.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from estuary.config.spec import TableSpec
from estuary.embedding.compaction import COMPACT_BELOW, Compaction
from estuary.embedding.delta import DeltaChain, is_full, merge_states, split_state
from estuary.embedding.hashing import as_ids, route
from estuary.embedding.shard import EmbeddingShard, RawExport
from estuary.embedding.storage import rows_out
from estuary.embedding.types import Float32Array, Int64Array, TableStats

State = dict[str, np.ndarray]


class TableSnapshot:
    """A table's state or delta taken at one moment (``EmbeddingTable.snapshot``):
    ``chain`` (its ``delta.*`` keys) at once, the arrays from ``materialize()``."""

    def __init__(self, parts: list[RawExport], chain: State) -> None:
        self._parts = parts
        self.chain = chain

    def materialize(self) -> State:
        """The state dict (as ``state_dict`` / ``delta_state_dict`` return it)."""
        return {**merge_states([p.materialize() for p in self._parts]), **self.chain}


class EmbeddingTable:
    """Hash-keyed embedding table of ``spec.shards`` shards. Implements ``EmbeddingStore``.

    Args:
        spec: table settings; ``spec.shards`` fixes S.
        seed: job seed; an id's initial row depends only on (seed, name, id).
        name: table name.
        max_pending_ids: per-shard bound on ids counted by admission (default
            ``spec.admission.max_pending_ids``).
        time_fn: wall clock for ``eviction.ttl_s`` (injectable for tests).

    With S = 1 every call goes straight to the shard (no routing, no copies).
    Shards are called one after another from the caller's thread.
    """

    def __init__(
        self,
        spec: TableSpec,
        seed: int,
        name: str,
        *,
        max_pending_ids: int | None = None,
        time_fn: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.name = name
        # Each shard pre-allocates its share of the initial capacity.
        per_shard = -(-spec.initial_capacity_rows // spec.shards)
        shard_spec = replace(spec, initial_capacity_rows=per_shard)
        self.shards = [
            EmbeddingShard(
                shard_spec,
                seed,
                name,
                max_pending_ids=max_pending_ids,
                shards=spec.shards,
                time_fn=time_fn,
            )
            for _ in range(spec.shards)
        ]
        self._chain = DeltaChain()

    @property
    def dim(self) -> int:
        """Embedding width D."""
        return self.spec.dim

    @property
    def step(self) -> int:
        """Training steps ended (``apply_gradients`` + ``advance_step`` calls)."""
        return self.shards[0].step

    def __len__(self) -> int:
        """Ids holding their own row, over all shards."""
        return sum(len(s) for s in self.shards)

    def lookup(
        self, ids: Int64Array, *, train: bool, out: Float32Array | None = None
    ) -> Float32Array:
        """Rows of ``ids`` int64 (N,) -> float32 (N, D) in input order: ``out`` if
        given, else fresh.

        See ``EmbeddingShard.lookup`` for ``train`` and ``out``.
        """
        if len(self.shards) == 1:
            return self.shards[0].lookup(ids, train=train, out=out)
        ids = as_ids(ids)
        out = rows_out(out, ids.size, self.dim)
        order, offsets = route(ids, len(self.shards))
        for k, shard in enumerate(self.shards):
            sel = order[offsets[k] : offsets[k + 1]]
            if sel.size:
                out[sel] = shard.lookup(ids[sel], train=train)
        return out

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        """One optimizer step at the learning rate times ``lr_scale``; ``ids`` int64
        (N,) unique, ``grads`` float32 (N, D).

        Ends the step on every shard. See ``EmbeddingShard.apply_gradients``.
        """
        if len(self.shards) == 1:
            self.shards[0].apply_gradients(ids, grads, lr_scale=lr_scale)
            return
        ids = as_ids(ids)
        grads = np.asarray(grads, np.float32)
        if grads.shape != (ids.size, self.dim):
            raise ValueError(f"grads must have shape ({ids.size}, {self.dim}), got {grads.shape}")
        order, offsets = route(ids, len(self.shards))
        for k, shard in enumerate(self.shards):
            sel = order[offsets[k] : offsets[k + 1]]
            if sel.size:
                shard.apply_gradients(ids[sel], grads[sel], lr_scale=lr_scale)
            else:
                shard.advance_step()

    def advance_step(self) -> None:
        """End a training step without gradients (``apply_gradients`` already ends one)."""
        for shard in self.shards:
            shard.advance_step()

    def set_admission_counting(self, enabled: bool) -> None:
        """See ``EmbeddingShard.set_admission_counting``."""
        for shard in self.shards:
            shard.set_admission_counting(enabled)

    @property
    def admission_min_count(self) -> int | None:
        """The admission rule's ``min_count`` (its shards' least); ``None``:
        every id admitted at first sight."""
        counts = [c for c in (s.admission_min_count for s in self.shards) if c is not None]
        return min(counts) if counts else None

    def raise_admission(self, min_count: int) -> int | None:
        """See ``EmbeddingShard.raise_admission``; returns the least ``min_count``
        over the shards now (``None``: no counter)."""
        counts = [c for c in (s.raise_admission(min_count) for s in self.shards) if c is not None]
        return min(counts) if counts else None

    def sweep(self) -> int:
        """Apply the TTL now on every shard; returns rows evicted."""
        return sum(shard.sweep() for shard in self.shards)

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

    def export_rows(self, select: Callable[[Int64Array], np.ndarray]) -> State:
        """The rows (and exact pending counts) of the ids ``select`` picks, over
        every shard (see ``EmbeddingShard.export_rows``); copies."""
        return merge_states([shard.export_rows(select) for shard in self.shards])

    def import_rows(self, state: State) -> int:
        """Take in rows (and exact pending counts) moved from another server, for
        ids this table does not hold (see ``EmbeddingShard.import_rows``);
        returns the rows taken in."""
        parts = split_state(state, len(self.shards))
        return sum(shard.import_rows(part) for shard, part in zip(self.shards, parts, strict=True))

    def forget_pending(self, ids: Int64Array) -> int:
        """Drop the exact pending admission counts of ``ids``; returns how many were pending."""
        ids = as_ids(ids)
        if len(self.shards) == 1:
            return self.shards[0].forget_pending(ids)
        order, offsets = route(ids, len(self.shards))
        return sum(
            shard.forget_pending(ids[order[offsets[k] : offsets[k + 1]]])
            for k, shard in enumerate(self.shards)
        )

    def compact(self, *, below: float = COMPACT_BELOW) -> list[Compaction]:
        """Compact each shard whose arrays are mostly empty (see
        ``EmbeddingShard.compact``); returns what each shard did, in order."""
        return [shard.compact(below=below) for shard in self.shards]

    def cap_rows(self, rows: int) -> int:
        """Lower the table's row capacity to ``rows`` (split evenly over its
        shards; see ``EmbeddingShard.cap_rows``); returns the capacity now."""
        each = -(-rows // len(self.shards))
        return sum(shard.cap_rows(each) for shard in self.shards)

    @property
    def capacity_rows(self) -> int | None:
        """Most rows the table holds (its shards' sum); ``None``: unbounded."""
        caps = [shard.capacity_rows for shard in self.shards]
        return None if any(c is None for c in caps) else sum(c for c in caps if c is not None)

    @property
    def allocated_rows(self) -> int:
        """Rows its arrays hold before they grow (its shards' sum)."""
        return sum(shard.allocated_rows for shard in self.shards)

    def stats(self) -> TableStats:
        """Counters summed over shards."""
        total = TableStats()
        for shard in self.shards:
            total = total + shard.stats()
        return total

    def state_dict(self, *, mark_clean: bool = True) -> State:
        """All rows and state, the shards' parts merged (layout:
        ``estuary.embedding.delta``). ``mark_clean`` starts a new delta interval
        and chain version."""
        parts = [s.export_raw(dirty_only=False, mark=mark_clean) for s in self.shards]
        if mark_clean:
            self._chain.advance()
        return TableSnapshot(parts, self._chain.keys()).materialize()

    def delta_state_dict(self) -> State:
        """Rows changed and ids evicted since the last mark, plus the small
        whole-table parts (pending ids, unknown rows, clocks); marks clean.

        A full state (``delta.full = 1``) when a shard evicted more ids since the
        mark than it holds rows (see ``estuary.embedding.delta``).
        """
        return self.snapshot(delta=True).materialize()

    def snapshot(self, *, delta: bool) -> TableSnapshot:
        """``state_dict()`` (or ``delta_state_dict()``) in two halves: the rows are
        copied now, each shard under its lock (a memcpy of the rows in use; for a
        delta, a gather of the changed rows), and the chain advances; the state's
        arrays come from ``materialize()``, which any thread may call later while
        the table trains on (an asynchronous checkpoint)."""
        if not delta:
            parts = [s.export_raw(dirty_only=False, mark=True) for s in self.shards]
            self._chain.advance()
            return TableSnapshot(parts, self._chain.keys())
        full = any(s.log_overflowed() for s in self.shards)
        parts = [s.export_raw(dirty_only=not full, mark=True) for s in self.shards]
        base = self._chain.advance()
        return TableSnapshot(parts, self._chain.delta_keys(base, full))

    def mark_clean(self) -> None:
        """Start a new delta interval (and chain version) without exporting."""
        for shard in self.shards:
            shard.mark_clean()
        self._chain.advance()

    def chain_keys(self) -> list[int]:
        """``[lineage, version]`` of the checkpoint chain."""
        return [self._chain.lineage, self._chain.version]

    def adopt_chain(self, lineage: int, version: int) -> None:
        """Follow checkpoint chain ``lineage`` at ``version`` (a server joining
        the others' chain mid-run)."""
        self._chain.lineage, self._chain.version = lineage, version

    def load_state_dict(self, state: State) -> None:
        """Load a table state saved with any shard count (reshards by routing ids).

        Unknown rows: with the same S each shard gets its own back; otherwise
        every shard gets the element-wise mean of the saved ones (clocks: the
        maximum). Adopts the state's chain, so its deltas apply next.
        """
        for shard, part in zip(self.shards, split_state(state, len(self.shards)), strict=True):
            shard.import_state(part, delta=False)
        self._chain.adopt(state)

    def apply_delta(self, delta: State) -> None:
        """Apply a ``delta_state_dict`` (of any shard count) on top of the state
        it was taken against (its ``delta.base``); raises ``ValueError`` otherwise."""
        self._chain.check(delta, self.name)
        full = is_full(delta)
        for shard, part in zip(self.shards, split_state(delta, len(self.shards)), strict=True):
            shard.import_state(part, delta=not full)
        self._chain.adopt(delta)
