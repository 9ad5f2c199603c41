"""Several trainers on one ``data.dataset`` with direct delivery: rank 0 routes,
every rank fetches its own rows (``estuary.data.graph.routing``).

::

    rank 0: Driver.steps(W) -> StepRoute: W RankParts (row ids + new blocks)
            part r handed to rank r through ``PartRoutes`` (rank r asks for it)
            part 0: fetched and trained here
            Progress.record(every rank's row ids) after the step
    rank r: PartRoutes.receive -> its RankPart -> fetch its new blocks -> Batch

The same face as ``BatchScatter`` (``batches``, ``next_share``): every rank
learns each step's total rows N and the end of the data from its part, so all
ranks take the same number of steps, and the loss is reduced as with rank-0
scatter (``StepShare.loss_scale``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from estuary.data.graph.routing import BlockRows, PartAssembler, RankPart, StepRoute
from estuary.data.types import Batch
from estuary.train.batch_scatter import StepShare

__all__ = ["PartRoutes", "RoutedBatches"]


class PartRoutes(Protocol):
    """How rank 0's parts reach the other ranks, and how a rank fetches blocks
    (a cluster runtime's: Ray actor calls and its object store)."""

    def send(self, rank: int, part: RankPart | None) -> None:
        """Rank 0: hand rank ``rank`` its next part (``None``: the data ended).
        Blocks while the rank is a few parts behind."""
        ...

    def receive(self, rank: int) -> RankPart | None:
        """Rank ``rank`` > 0: its next part from rank 0 (``None``: the data ended).
        Blocks until rank 0 has routed it."""
        ...

    def fetch(self, refs: list[Any]) -> list[BlockRows]:
        """The blocks behind payload references (blocking)."""
        ...


class RoutedBatches:
    """This rank's batches by direct delivery (see module docstring).

    Args:
        rank: r.
        world_size: W.
        assembler: turns this rank's parts into batches.
        routes: the transport.
        source: rank 0: ``Driver.steps(W)``; other ranks: ``None``.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        assembler: PartAssembler,
        routes: PartRoutes,
        source: Iterator[StepRoute] | None,
    ) -> None:
        if (source is None) != (rank != 0):
            raise ValueError("rank 0, and only rank 0, routes the steps")
        self.rank, self.world_size = rank, world_size
        self.assembler, self.routes, self.source = assembler, routes, source
        self.send_s = 0.0  # rank 0: seconds spent handing parts to the other ranks
        self._shares: deque[StepShare] = deque()

    def batches(self) -> Iterator[Batch]:
        """This rank's part of every step, until the data ends (on all ranks at once)."""
        if self.source is None:
            while (part := self.routes.receive(self.rank)) is not None:
                self._shares.append(StepShare(part.step_rows, None))
                yield self.assembler.batch(part)
            return
        for step in self.source:
            self._send(step.parts[1:])
            self._shares.append(StepShare(step.rows, step.row_ids))
            yield self.assembler.batch(step.parts[0])
        self._send([None] * (self.world_size - 1))

    def next_share(self) -> StepShare:
        """The ``StepShare`` of the next step (call after taking its batch)."""
        return self._shares.popleft()

    @property
    def rows_fetched(self) -> int:
        return self.assembler.rows_fetched

    def _send(self, parts: list[RankPart] | list[None]) -> None:
        t0 = time.perf_counter()
        for rank, part in enumerate(parts, start=1):
            self.routes.send(rank, part)
        self.send_s += time.perf_counter() - t0
