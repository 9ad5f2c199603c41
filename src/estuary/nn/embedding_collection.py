"""The bridge between parameter-server tables and torch autograd.

One training step touches the tables twice::

    ids (per feature, CSR) --lookup()--> unique ids + rows (numpy; no torch, may run
        in a prefetch thread)   --forward()--> pooled (B, F, D) tensor
    loss.backward()  --gradients()--> per-table (unique ids, summed grads) -> tables

``lookup`` deduplicates ids per table (features that share a table are
deduplicated together), so each unique id is gathered once and its gradient
arrives already summed over the batch: ``rows`` becomes a leaf tensor and
autograd accumulates into ``rows.grad`` (N, D).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from estuary.data.types import Float32Array, Int64Array, JaggedIds
from estuary.embedding.types import EmbeddingStore

_POOLING_MODES = {"sum": "sum", "mean": "mean"}


@dataclass
class TableLookup:
    """One table's part of a looked-up batch.

    Args:
        table: table name.
        ids: int64 (N,) unique ids.
        rows: float32 (N, D) their rows at lookup time.
        features: the features read from this table, in schema order.
        inverse: per feature, int64 (n_f,) index into ``ids`` for each id of the bag.
        offsets: per feature, int64 (B + 1,) bag boundaries (``None`` = one id per row).
    """

    table: str
    ids: Int64Array
    rows: Float32Array
    features: list[str]
    inverse: list[Int64Array]
    offsets: list[Int64Array | None]


@dataclass
class LookedUpBatch:
    """All tables' lookups for one batch; produced off the torch thread."""

    num_rows: int
    tables: list[TableLookup]


@dataclass
class SparseGradients:
    """One table's gradient for one step: ``grads`` float32 (N, D) summed per
    unique id in ``ids`` int64 (N,)."""

    table: str
    ids: Int64Array
    grads: Float32Array


class EmbeddingCollection(nn.Module):
    """Pooled embeddings of F sparse features, stored in external tables.

    Args:
        features: sparse feature names, in model order (F of them).
        tables: table name -> store (``EmbeddingTable`` or anything with that API).
        feature_tables: feature -> table name (defaults to the feature's own name).
        pooling: feature -> ``sum`` or ``mean`` (default ``sum``).

    ``forward`` returns float32 (B, F, D); all tables must share one D.
    """

    def __init__(
        self,
        features: Sequence[str],
        tables: Mapping[str, EmbeddingStore],
        feature_tables: Mapping[str, str] | None = None,
        pooling: Mapping[str, str] | None = None,
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
                    f"feature {feature!r}: pooling {self.pooling[feature]!r} cannot be stacked "
                    f"into (B, F, D); use sum or mean"
                )
        dims = {self.tables[t].dim for t in self.feature_tables.values()}
        if len(dims) > 1:
            raise ValueError(
                f"all tables must share one dim to stack (B, F, D); got {sorted(dims)}"
            )
        self.dim = dims.pop() if dims else 0
        # Table name -> its features, in model order; built once.
        self._groups: dict[str, list[str]] = {}
        for feature in self.features:
            self._groups.setdefault(self.feature_tables[feature], []).append(feature)
        self._leaves: list[tuple[str, Int64Array, torch.Tensor]] = []

    def lookup(self, sparse: Mapping[str, JaggedIds], *, train: bool) -> LookedUpBatch:
        """Deduplicate and gather. Pure numpy + table calls (the tables' kernels
        release the GIL), so it can run in a prefetch thread."""
        num_rows = sparse[self.features[0]].num_rows if self.features else 0
        lookups: list[TableLookup] = []
        for table, features in self._groups.items():
            bags = [sparse[f] for f in features]
            all_ids = bags[0].values if len(bags) == 1 else np.concatenate([b.values for b in bags])
            # np.unique sorts: O(n log n), ~2-3 ms for 50k ids; returns each id once.
            ids, inverse_all = np.unique(all_ids, return_inverse=True)
            rows = self.tables[table].lookup(ids, train=train)
            inverse: list[Int64Array] = []
            offsets: list[Int64Array | None] = []
            start = 0
            for bag in bags:
                n = bag.values.shape[0]
                inverse.append(inverse_all[start : start + n].astype(np.int64, copy=False))
                start += n
                single = n == num_rows and bool(np.all(np.diff(bag.offsets) == 1))
                offsets.append(None if single else bag.offsets)
            lookups.append(TableLookup(table, ids, rows, features, inverse, offsets))
        return LookedUpBatch(num_rows=num_rows, tables=lookups)

    def forward(self, batch: LookedUpBatch) -> torch.Tensor:
        """Pooled embeddings float32 (B, F, D). In training mode the gathered rows
        become leaf tensors whose ``.grad`` ``gradients()`` hands to the tables."""
        pooled: dict[str, torch.Tensor] = {}
        self._leaves = []
        for part in batch.tables:
            leaf = torch.from_numpy(part.rows)
            if self.training:
                leaf.requires_grad_(True)
                self._leaves.append((part.table, part.ids, leaf))
            for feature, inverse, offsets in zip(
                part.features, part.inverse, part.offsets, strict=True
            ):
                index = torch.from_numpy(inverse)
                if offsets is None:
                    pooled[feature] = leaf.index_select(0, index)  # (B, D)
                else:
                    pooled[feature] = F.embedding_bag(
                        index,
                        leaf,
                        torch.from_numpy(offsets[:-1]),
                        mode=_POOLING_MODES[self.pooling[feature]],
                    )  # (B, D); empty bags give zeros
        if not self.features:
            return torch.zeros(batch.num_rows, 0, 0)
        return torch.stack([pooled[f] for f in self.features], dim=1)  # (B, F, D)

    def gradients(self) -> list[SparseGradients]:
        """The sparse gradients of the last training ``forward``, after
        ``loss.backward()``. Ids whose rows got no gradient are sent zeros, which
        still counts as a step for stateful optimizers (Adam's step count)."""
        out = []
        for table, ids, leaf in self._leaves:
            grad = leaf.grad
            grads = (
                np.zeros((ids.shape[0], leaf.shape[1]), dtype=np.float32)
                if grad is None
                else grad.numpy()
            )
            out.append(SparseGradients(table, ids, grads))
        self._leaves = []
        return out
