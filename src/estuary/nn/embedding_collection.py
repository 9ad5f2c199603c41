"""The bridge between parameter-server tables and torch autograd.

One training step touches the tables twice::

    ids (per feature, CSR) --lookup()--> pooled (B, F, D) numpy, rows as of now
        (numba kernels + table calls, no torch: may run in a prefetch thread)
    forward()          --> pooled as a leaf tensor that requires grad
    loss.backward()    --> pooled.grad (B, F, D)
    gradients()        --> per table (unique ids, grads summed per id) -> tables

``lookup`` deduplicates ids per table in one pass over all features (features
that share a table are deduplicated together), gathers each unique id's row once,
straight into the table's slice of one (U, D) block (tables served by one
``MultiTableStore``, e.g. a parameter server, in one call), and pools every bag
itself (``estuary.nn.kernels``). So torch sees one (B, F, D)
leaf, and its gradient is scattered back to the unique ids in one kernel: no
per-feature torch ops on the step's critical path.

Features whose table has ``pooling: none`` are not pooled: ``lookup`` pads each
one's bags into its own (B, L, D) block plus a (B, L) mask
(``estuary.nn.types.SequenceEmbedding``), ``embed`` returns them beside the
pooled block (where their slot holds zeros), and ``gradients`` scatters their
per-position gradients into the same per-id sums. Their ids are deduplicated
with every other feature of their table.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import torch
from torch import nn

from estuary.data.types import Float32Array, Int64Array, JaggedIds
from estuary.embedding.types import EmbeddingStore, shared_multi_store
from estuary.nn.kernels import (
    BoolArray,
    check_offsets,
    dedup_groups,
    pad_sequences,
    pool_bags,
    scatter_bag_grads,
    scatter_sequence_grads,
    truncate_bags,
)
from estuary.nn.types import SequenceEmbedding

_POOLING_MODES = ("sum", "mean", "none")


@dataclass
class BagLayout:
    """Where each bag's ids sit among a batch's unique rows (what ``gradients``
    needs to scatter the pooled gradient back).

    Args:
        inverse: int64 (N,) each id's index among its table's unique ids; the ids
            are concatenated table by table (see ``estuary.nn.kernels``).
        offsets: int64 (F, B + 1) each feature's bag boundaries as pooling sees
            them: unpooled (``pooling: none``) features' rows are all zeros, i.e.
            empty bags (zeros in the pooled block, no gradient).
        value_start: int64 (F,) where feature f's ids start in ``inverse``.
        row_base: int64 (F,) where feature f's table starts among the U rows.
        mean: bool (F,) mean pooling (else sum).
        single: bool (F,) every bag holds one id (the kernels skip ``offsets``).
        sequence_index: int64 (S,) the unpooled features' positions f.
        sequence_offsets: int64 (S, B + 1) their bag boundaries.
    """

    inverse: Int64Array
    offsets: Int64Array
    value_start: Int64Array
    row_base: Int64Array
    mean: BoolArray
    single: BoolArray
    sequence_index: Int64Array = field(default_factory=lambda: np.zeros(0, np.int64))
    sequence_offsets: Int64Array = field(default_factory=lambda: np.zeros((0, 1), np.int64))


@dataclass
class LookedUpBatch:
    """All tables' lookups for one batch; produced off the torch thread.

    Args:
        num_rows: B.
        pooled: float32 (B, F, D) pooled embeddings, rows as they were at lookup.
        tables: table names, in row-block order.
        ids: per table, int64 (N_t,) its unique ids (first-occurrence order).
        row_start: int64 (T + 1,) table t owns rows ``[row_start[t], row_start[t+1])``
            of the (U, D) gradient block.
        layout: the bags, for ``gradients``.
        sequences: per unpooled feature (model order), float32 (B, L, D) its
            right-padded rows and bool (B, L) the mask of real ids.
    """

    num_rows: int
    pooled: Float32Array
    tables: list[str]
    ids: list[Int64Array]
    row_start: Int64Array
    layout: BagLayout
    sequences: dict[str, tuple[Float32Array, BoolArray]] = field(default_factory=dict)


@dataclass
class SparseGradients:
    """One table's gradient for one step: ``grads`` float32 (N, D) summed per
    unique id in ``ids`` int64 (N,), applied at the table's learning rate times
    ``lr_scale``."""

    table: str
    ids: Int64Array
    grads: Float32Array
    lr_scale: float = 1.0


class EmbeddingCollection(nn.Module):
    """Pooled embeddings of F sparse features, stored in external tables.

    Args:
        features: sparse feature names, in model order (F of them).
        tables: table name -> store (``EmbeddingTable`` or anything with that API).
        feature_tables: feature -> table name (defaults to the feature's own name).
        pooling: feature -> ``sum``, ``mean`` or ``none`` (default ``sum``).
            ``none`` features reach the model as padded sequences (see ``embed``).
        max_lengths: feature -> keep at most the first this many ids of each of
            its bags (the rest are not looked up); unset = no cap.

    ``forward`` returns float32 (B, F, D); ``embed`` also returns the unpooled
    features. All tables must share one D.
    """

    def __init__(
        self,
        features: Sequence[str],
        tables: Mapping[str, EmbeddingStore],
        feature_tables: Mapping[str, str] | None = None,
        pooling: Mapping[str, str] | None = None,
        max_lengths: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.features = list(features)
        self.tables = dict(tables)
        self.feature_tables = {f: (feature_tables or {}).get(f, f) for f in self.features}
        self.pooling = {f: (pooling or {}).get(f, "sum") for f in self.features}
        for feature, table in self.feature_tables.items():
            if table not in self.tables:
                raise KeyError(f"feature {feature!r} reads table {table!r}, which does not exist")
            if self.pooling[feature] not in _POOLING_MODES:
                raise ValueError(
                    f"feature {feature!r}: unknown pooling {self.pooling[feature]!r}; "
                    f"use one of {', '.join(_POOLING_MODES)}"
                )
        self.max_lengths = dict(max_lengths or {})
        for feature, cap in self.max_lengths.items():
            if feature not in self.feature_tables:
                raise KeyError(f"max_lengths: {feature!r} is not a feature")
            if cap < 1:
                raise ValueError(f"max_lengths.{feature}: must be >= 1, got {cap}")
        self.sequence_features = [f for f in self.features if self.pooling[f] == "none"]
        dims = {self.tables[t].dim for t in self.feature_tables.values()}
        if len(dims) > 1:
            raise ValueError(
                f"all tables must share one dim to stack (B, F, D); got {sorted(dims)}"
            )
        self.dim = dims.pop() if dims else 0
        # Built once: tables in first-use order, and the features (model positions)
        # in the order their ids are concatenated, grouped by table.
        groups: dict[str, list[int]] = {}
        for f, feature in enumerate(self.features):
            groups.setdefault(self.feature_tables[feature], []).append(f)
        self._group_names = list(groups)
        self._concat_order = [f for members in groups.values() for f in members]
        # The tables in group order, and the batcher serving all of them (if any):
        # fixed for the collection's life, so looked up once, not every step.
        self._stores = [self.tables[table] for table in self._group_names]
        self._multi = shared_multi_store(self._stores) if len(self._stores) > 1 else None
        self._group_sizes = [len(members) for members in groups.values()]
        self._feature_group = np.empty(len(self.features), np.int64)
        for g, members in enumerate(groups.values()):
            self._feature_group[members] = g
        self._mean = np.array([self.pooling[f] == "mean" for f in self.features], np.bool_)
        self._sequence_index = np.array(
            [self.features.index(f) for f in self.sequence_features], np.int64
        )
        self._caps = [
            (f, self.max_lengths[name])
            for f, name in enumerate(self.features)
            if name in self.max_lengths
        ]
        self._pending: tuple[LookedUpBatch, torch.Tensor, list[torch.Tensor]] | None = None

    def lookup(self, sparse: Mapping[str, JaggedIds], *, train: bool) -> LookedUpBatch:
        """Deduplicate, gather and pool. Numpy, numba (GIL released) and table
        calls only, so it can run in a prefetch thread.

        Args:
            sparse: feature -> ids of B rows (CSR), for every feature.
            train: passed to the tables (``True`` inserts new ids).
        """
        if not self.features:
            return self._empty(0)
        bags = [sparse[f] for f in self.features]  # model order
        num_rows = bags[0].num_rows
        for feature, bag in zip(self.features, bags, strict=True):
            if bag.num_rows != num_rows:
                raise ValueError(
                    f"feature {feature!r} has {bag.num_rows} rows, expected {num_rows}"
                )
        lengths = np.array([bag.values.shape[0] for bag in bags], np.int64)  # (F,)
        offsets = np.stack([bag.offsets for bag in bags]).astype(np.int64, copy=False)
        single = np.empty(len(bags), np.bool_)
        bad = int(check_offsets(offsets, lengths, single))
        if bad >= 0:
            raise ValueError(f"feature {self.features[bad]!r}: offsets are not a CSR of its ids")
        for f, cap in self._caps:
            if not single[f] and int(np.diff(offsets[f]).max(initial=0)) > cap:
                kept = np.empty(int(lengths[f]), np.int64)
                ids_f = bags[f].values.astype(np.int64, copy=False)
                offsets[f] = truncate_bags(ids_f, offsets[f], cap, kept)
                lengths[f] = offsets[f, -1]
                bags[f] = JaggedIds(values=kept[: lengths[f]], offsets=offsets[f])
        # Unpooled features keep their own boundaries and pool as empty bags.
        sequence_offsets = offsets[self._sequence_index]  # (S, B + 1), a copy
        offsets[self._sequence_index] = 0
        single[self._sequence_index] = False

        # Concatenate ids table by table; value_start[f] = where feature f's ids begin.
        order = self._concat_order
        values = np.concatenate([bags[f].values for f in order]).astype(np.int64, copy=False)
        value_start = np.empty(len(bags), np.int64)
        value_start[order] = np.cumsum(lengths[order]) - lengths[order]
        group_bounds = np.zeros(len(self._group_names) + 1, np.int64)
        np.cumsum(np.add.reduceat(lengths[order], _starts(self._group_sizes)), out=group_bounds[1:])
        unique = np.empty_like(values)
        inverse = np.empty_like(values)
        counts = dedup_groups(values, group_bounds, unique, inverse)  # one pass, all tables

        row_start = np.zeros(len(self._group_names) + 1, np.int64)
        np.cumsum(counts, out=row_start[1:])
        rows = np.empty((int(row_start[-1]), self.dim), np.float32)  # (U, D)
        # Each table writes its unique ids' rows straight into its slice of the block.
        ids = [unique[group_bounds[g] : group_bounds[g] + counts[g]] for g in range(len(counts))]
        slices = [rows[row_start[g] : row_start[g + 1]] for g in range(len(counts))]
        if self._multi is not None:  # e.g. parameter-server tables: one request for all
            self._multi.lookup_many(self._stores, ids, train=train, out=slices)
        else:
            for store, table_ids, out in zip(self._stores, ids, slices, strict=True):
                store.lookup(table_ids, train=train, out=out)

        layout = BagLayout(
            inverse=inverse,
            offsets=offsets,
            value_start=value_start,
            row_base=row_start[self._feature_group],
            mean=self._mean,
            single=single,
            sequence_index=self._sequence_index,
            sequence_offsets=sequence_offsets,
        )
        pooled = np.empty((num_rows, len(self.features), self.dim), np.float32)
        pool_bags(rows, inverse, offsets, value_start, layout.row_base, self._mean, single, pooled)
        sequences = {}
        for s, f in enumerate(self._sequence_index.tolist()):
            bounds = sequence_offsets[s]
            length = max(1, int(np.diff(bounds).max(initial=0)))  # L >= 1: no empty blocks
            padded = np.empty((num_rows, length, self.dim), np.float32)  # (B, L, D)
            mask = np.empty((num_rows, length), np.bool_)  # (B, L)
            start, base = int(value_start[f]), int(layout.row_base[f])
            pad_sequences(rows, inverse, bounds, start, base, padded, mask)
            sequences[self.features[f]] = (padded, mask)
        return LookedUpBatch(
            num_rows, pooled, list(self._group_names), ids, row_start, layout, sequences
        )

    def _empty(self, num_rows: int) -> LookedUpBatch:
        none = np.zeros(0, np.int64)
        flags = np.zeros(0, np.bool_)
        layout = BagLayout(none, np.zeros((0, 1), np.int64), none, none, flags, flags)
        pooled = np.zeros((num_rows, 0, 0), np.float32)
        return LookedUpBatch(num_rows, pooled, [], [], np.zeros(1, np.int64), layout)

    def forward(self, batch: LookedUpBatch) -> torch.Tensor:
        """Pooled embeddings float32 (B, F, D), sharing memory with ``batch.pooled``.
        In training mode it is a leaf that requires grad (so models must not
        modify it in place); ``gradients()`` turns its ``.grad`` into per-id
        gradients for the tables. Unpooled features' slots hold zeros; use
        ``embed`` to get their sequences."""
        return self.embed(batch)[0]

    def embed(self, batch: LookedUpBatch) -> tuple[torch.Tensor, dict[str, SequenceEmbedding]]:
        """``forward``'s (B, F, D) block and, per ``pooling: none`` feature (model
        order), its padded rows (B, L, D) and mask (B, L), sharing memory with
        ``batch``. In training mode the padded rows are leaves that require grad
        too, and ``gradients()`` adds their per-position gradients to the ids'."""
        pooled, sequences = self.embedded(batch)
        if self.training and batch.tables:
            pooled.requires_grad_(True)
            for sequence in sequences.values():
                sequence.values.requires_grad_(True)
            self._pending = (batch, pooled, [s.values for s in sequences.values()])
        else:
            self._pending = None
        return pooled, sequences

    @staticmethod
    def embedded(
        batch: LookedUpBatch,
    ) -> tuple[torch.Tensor, dict[str, SequenceEmbedding]]:
        """``embed``'s tensors with no gradient and no state touched: safe from a
        thread other than the training step's (scoring rows as they arrive)."""
        pooled = torch.from_numpy(batch.pooled)  # (B, F, D), no copy
        sequences = {
            name: SequenceEmbedding(torch.from_numpy(values), torch.from_numpy(mask))
            for name, (values, mask) in batch.sequences.items()
        }
        return pooled, sequences

    def gradients(self) -> Sequence[SparseGradients]:
        """The sparse gradients of the last training ``forward``, after
        ``loss.backward()``: one entry per table, in ``batch.tables`` order. Ids
        whose rows got no gradient are sent zeros, which still counts as a step for
        stateful optimizers (Adam's step count).

        Cheap to call: the scatter to per-id gradients runs when the result is
        first read, i.e. on the sparse-update thread in hybrid/async mode. Until
        then the forward's output ``.grad`` must not change (the trainer never
        touches it again)."""
        if self._pending is None:
            return []
        batch, pooled, sequences = self._pending
        self._pending = None
        return StepGradients(batch, pooled.grad, self.dim, [s.grad for s in sequences])


class StepGradients(Sequence[SparseGradients]):
    """One step's per-table gradients, computed on first access.

    Args:
        batch: the looked-up batch the forward used.
        grad: float32 (B, F, D) the gradient of its pooled output, or ``None``
            (no gradient reached it: every table gets zeros).
        dim: D.
        sequence_grads: per unpooled feature (``batch.sequences`` order), float32
            (B, L, D) the gradient of its padded rows, or ``None``.
    """

    def __init__(
        self,
        batch: LookedUpBatch,
        grad: torch.Tensor | None,
        dim: int,
        sequence_grads: Sequence[torch.Tensor | None] = (),
    ) -> None:
        self._batch = batch
        self._grad = grad
        self._sequence_grads = list(sequence_grads)
        self._dim = dim
        self._parts: list[SparseGradients] | None = None
        self._lock = threading.Lock()

    def _resolve(self) -> list[SparseGradients]:
        with self._lock:
            if self._parts is None:
                batch = self._batch
                grads = np.zeros((int(batch.row_start[-1]), self._dim), np.float32)  # (U, D)
                if self._grad is not None:
                    layout = batch.layout
                    scatter_bag_grads(
                        np.ascontiguousarray(self._grad.detach().numpy()),
                        layout.inverse,
                        layout.offsets,
                        layout.value_start,
                        layout.row_base,
                        layout.mean,
                        layout.single,
                        grads,
                    )
                layout = batch.layout
                for s, grad in enumerate(self._sequence_grads):
                    if grad is None:
                        continue
                    f = int(layout.sequence_index[s])
                    scatter_sequence_grads(
                        np.ascontiguousarray(grad.detach().numpy()),
                        layout.inverse,
                        layout.sequence_offsets[s],
                        int(layout.value_start[f]),
                        int(layout.row_base[f]),
                        grads,
                    )
                start = batch.row_start
                self._parts = [
                    SparseGradients(table, ids, grads[start[t] : start[t + 1]])
                    for t, (table, ids) in enumerate(zip(batch.tables, batch.ids, strict=True))
                ]
                self._grad = None  # free the (B, F, D) and (B, L, D) gradients
                self._sequence_grads = []
            return self._parts

    def __len__(self) -> int:
        return len(self._batch.tables)

    @overload
    def __getitem__(self, index: int) -> SparseGradients: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[SparseGradients]: ...

    def __getitem__(self, index: int | slice) -> SparseGradients | Sequence[SparseGradients]:
        return self._resolve()[index]

    def __iter__(self) -> Iterator[SparseGradients]:
        return iter(self._resolve())


def _starts(sizes: Sequence[int]) -> Int64Array:
    """int64 (len(sizes),) the start of each run of ``sizes`` items."""
    return np.cumsum([0, *sizes[:-1]]).astype(np.int64)
