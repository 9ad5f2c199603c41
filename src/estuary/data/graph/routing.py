"""Direct delivery: rank 0 plans and accounts, every trainer fetches its own rows.

With data executors on a cluster, the rows need not pass through rank 0::

    executor e: reads a split -> per block: BlockRows (the rows, left in the
                object store) + RemoteBlock (accounting and a reference to them)
    rank 0:     RoutedSink: each block goes whole to one rank (the one holding
                the fewest rows), into that rank's RowBuffer of row ids
                per step: StepRoute = one RankPart per rank: the row ids it
                trains and the references of blocks new to it
    rank r:     PartAssembler: fetches its new blocks (only those: ~1/W of the
                data), gathers the part's rows from them -> Batch

Rank 0 moves row ids (8 bytes a row) instead of rows; it still plans, counts bad
rows and records every trained row in ``Progress``, so the exactly-once
accounting is the one-reader accounting.

Shuffle: each rank draws from its own buffer of ``buffer_rows / W`` rows, fed
by whole blocks, so a step mixes rows from W blocks' worth of buffers instead of
one buffer of ``buffer_rows``; the draws come from the sink's seeded rng, so the
steps depend only on the data and the seed. Balance: a block (~``block_size_bytes``
of text) goes to the rank with the fewest buffered rows, so ranks differ by at
most about one block; a step is ready once every rank has B rows, and at the end
the ranks drain what they hold (a rank with nothing left trains an empty part,
as a short last batch does with rank-0 scatter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from estuary.data.badrows import BadRow
from estuary.data.graph.executors import Block
from estuary.data.graph.progress import ROW_BITS
from estuary.data.graph.shuffle import RowBuffer
from estuary.data.graph.sinks import BatchSink
from estuary.data.types import Batch, Float32Array, Int64Array, JaggedIds

__all__ = [
    "BlockRows",
    "PartAssembler",
    "RankPart",
    "RemoteBlock",
    "RoutedSink",
    "StepRoute",
]


@dataclass(frozen=True)
class BlockRows:
    """A block's good rows as a trainer needs them (left in the object store).

    Args:
        rows: int64 (G,) row numbers, ascending.
        labels: float32 (G,).
        dense: float32 (G, Dd).
        ids: int64 (G, F) single-id features.
        jagged: sequence feature -> its bags of the G rows.
    """

    rows: Int64Array
    labels: Float32Array
    dense: Float32Array
    ids: Int64Array
    jagged: dict[str, JaggedIds] = field(default_factory=dict)

    @classmethod
    def of(cls, block: Block) -> BlockRows:
        return cls(block.rows, block.labels, block.dense, block.ids, dict(block.jagged))


@dataclass(frozen=True)
class RemoteBlock:
    """What rank 0 holds of a block: its accounting (as ``Block``) and ``payload``,
    a reference to its ``BlockRows`` (an object-store reference on Ray)."""

    rows: Int64Array
    rows_read: int
    bad_count: int
    payload: Any
    bad_examples: list[BadRow] = field(default_factory=list)
    skipped_rows: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    def with_rows(self, rows: BlockRows) -> Block:
        """The whole ``Block``, with its rows fetched."""
        return Block(
            rows=self.rows,
            labels=rows.labels,
            dense=rows.dense,
            ids=rows.ids,
            rows_read=self.rows_read,
            bad_count=self.bad_count,
            bad_examples=self.bad_examples,
            skipped_rows=self.skipped_rows,
            jagged=rows.jagged,
        )

    @classmethod
    def of(cls, block: Block, payload: Any) -> RemoteBlock:
        return cls(
            block.rows,
            block.rows_read,
            block.bad_count,
            payload,
            block.bad_examples,
            block.skipped_rows,
        )


@dataclass(frozen=True)
class RankPart:
    """One rank's part of a step.

    Args:
        row_ids: int64 (R,) the rows to train (``(split code << 32) | row``).
        blocks: blocks new to this rank since its last part: (split code, payload
            reference); the part's rows are in these and earlier ones.
        step_rows: N, the step's rows over all ranks.
        origin: ``"stream/source"`` when every row came from that source.
    """

    row_ids: Int64Array
    blocks: list[tuple[int, Any]]
    step_rows: int
    origin: str | None = None


@dataclass(frozen=True)
class StepRoute:
    """One step: ``parts[r]`` for rank r; ``row_ids`` every rank's rows (N,)."""

    parts: list[RankPart]
    row_ids: Int64Array

    @property
    def rows(self) -> int:
        return int(self.row_ids.shape[0])


class RoutedSink(BatchSink):
    """``BatchSink`` for direct delivery: yields ``StepRoute``s of W parts of up
    to ``batch_size`` rows each (see module docstring); reads ``RemoteBlock``s.

    Args:
        ranks: W.
        batch_size: B, rows per rank and step.
        buffer_rows: N over all ranks (each rank holds ``ceil(N / W)``).
        (the rest as ``BatchSink``)
    """

    def __init__(self, *args: Any, ranks: int, buffer_rows: int, **kwargs: Any) -> None:
        # The base class's buffer stays empty (read order, no rows): the ranks' hold them.
        super().__init__(*args, buffer_rows=0, **kwargs)
        per_rank = -(-buffer_rows // ranks)
        self.ranks = [
            RowBuffer(0, 0, per_rank, self.rng if per_rank else None) for _ in range(ranks)
        ]
        self._new: list[list[tuple[int, Any]]] = [[] for _ in range(ranks)]

    def _add(self, block: Any, code: int, row_ids: Int64Array) -> None:
        assert isinstance(block, RemoteBlock), "direct delivery reads RemoteBlocks"
        rank = int(np.argmin([len(buffer) for buffer in self.ranks]))  # ties: the lowest
        n = row_ids.shape[0]
        empty = np.empty((n, 0), np.float32)
        self.ranks[rank].add(np.zeros(n, np.float32), empty, empty.astype(np.int64), row_ids)
        self._new[rank].append((code, block.payload))

    def _ready(self) -> bool:
        return all(buffer.ready(self.batch_size) for buffer in self.ranks)

    def _pending(self) -> bool:
        return any(len(buffer) for buffer in self.ranks)

    def _take(self) -> StepRoute:
        taken = [buffer.take(self.batch_size)[3] for buffer in self.ranks]  # row ids
        step_rows = sum(t.shape[0] for t in taken)
        parts = []
        for rank, row_ids in enumerate(taken):
            origin = self._origin(row_ids) if row_ids.shape[0] else None
            parts.append(RankPart(row_ids, self._new[rank], step_rows, origin))
            self._new[rank] = []
        return StepRoute(parts, np.concatenate(taken))

    def routes(self) -> Iterator[StepRoute]:
        """The steps until the data ends (or a stop while waiting for data)."""
        for step in self._steps():
            assert isinstance(step, StepRoute)
            yield step


@dataclass
class _Held:
    keys: Int64Array  # (G,) the block's row ids, ascending
    batch: Batch  # its rows, features in model order
    left: int  # rows not yet trained


class PartAssembler:
    """Rank r's side of direct delivery: ``RankPart`` -> ``Batch``.

    Holds the blocks routed to this rank until every row of each was trained
    (a block's rows leave over several steps when the buffer shuffles).

    Args:
        features: single-id sparse features, in ``BlockRows.ids`` column order.
        sequences: sequence features (``BlockRows.jagged``).
        order: every sparse feature in model order.
        num_dense: Dd.
        fetch: payload references -> their ``BlockRows`` (``ray.get`` on Ray).
    """

    def __init__(
        self,
        features: Sequence[str],
        sequences: Sequence[str],
        order: Sequence[str],
        num_dense: int,
        fetch: Callable[[list[Any]], list[BlockRows]],
    ) -> None:
        self.features, self.sequences, self.order = list(features), list(sequences), list(order)
        self.num_dense = num_dense
        self.fetch = fetch
        self.rows_fetched = 0  # rows of the blocks this rank fetched
        self._held: list[_Held] = []  # sorted by first key

    def batch(self, part: RankPart) -> Batch:
        """The part's rows (sorted by row id), ready for the model.

        Raises:
            RuntimeError: a row of the part is in no block this rank holds (a
                routing bug: never a data error).
        """
        if part.blocks:
            # Blocking wait: the new blocks, from the object store (zero-copy on this node).
            got = self.fetch([ref for _, ref in part.blocks])
            for (code, _), rows in zip(part.blocks, got, strict=True):
                self._hold(code, rows)
            self._held.sort(key=lambda h: int(h.keys[0]))
        row_ids = np.sort(part.row_ids)
        firsts = np.array([int(h.keys[0]) for h in self._held], dtype=np.int64)
        which = np.searchsorted(firsts, row_ids, side="right") - 1
        pieces = []
        for b in np.unique(which):
            wanted = row_ids[which == b]
            held = self._held[int(b)] if b >= 0 else None
            index = self._locate(held, wanted)
            pieces.append(held.batch.take(index))  # type: ignore[union-attr]
            held.left -= int(index.shape[0])  # type: ignore[union-attr]
        self._held = [h for h in self._held if h.left > 0]
        if not pieces:
            return self._empty()
        batch = Batch.concatenate(pieces)
        return Batch(batch.labels, batch.dense, batch.sparse, row_ids=row_ids, origin=part.origin)

    def _hold(self, code: int, rows: BlockRows) -> None:
        keys = (np.int64(code) << ROW_BITS) | rows.rows
        columns = np.ascontiguousarray(rows.ids.T)  # (F, G)
        sparse = {name: JaggedIds.single(columns[f]) for f, name in enumerate(self.features)}
        sparse.update({name: rows.jagged[name] for name in self.sequences})
        batch = Batch(rows.labels, rows.dense, {name: sparse[name] for name in self.order})
        self._held.append(_Held(keys, batch, int(keys.shape[0])))
        self.rows_fetched += int(keys.shape[0])

    @staticmethod
    def _locate(held: _Held | None, wanted: Int64Array) -> Int64Array:
        """Positions of ``wanted`` (ascending row ids) in ``held``'s block."""
        if held is not None:
            index = np.searchsorted(held.keys, wanted)
            inside = index < held.keys.shape[0]
            if inside.all() and (held.keys[index] == wanted).all():
                return index
        raise RuntimeError(
            f"direct delivery: row id {int(wanted[0])} is in no block this rank holds"
        )

    def _empty(self) -> Batch:
        none = np.empty(0, np.int64)
        return Batch(
            np.empty(0, np.float32),
            np.empty((0, self.num_dense), np.float32),
            {name: JaggedIds(none, np.zeros(1, np.int64)) for name in self.order},
            row_ids=none,
        )
