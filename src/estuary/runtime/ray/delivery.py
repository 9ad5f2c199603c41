"""Direct delivery on Ray: rank 0's parts reach the other ranks through actor
calls, and every rank fetches its blocks from the object store.

::

    rank 0 (its training thread)  send(r, part) -> mailbox[r] (bounded: DEPTH)
    rank r                        receive(r) = ray.get(rank0.next_part(r))
                                  -> mailbox[r].get() on one of rank 0's
                                     actor threads; the part's block references
                                     travel inside the reply (Ray counts rank r
                                     as a borrower, so the blocks live until
                                     rank r lets go of them)

A pull, not a push: rank r asks for its parts one at a time, so they arrive in
order, and rank 0 runs at most ``DEPTH`` parts ahead of the slowest rank.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import ray

from estuary.data.graph.routing import BlockRows, RankPart

__all__ = ["DEPTH", "RayPartRoutes", "take_part"]

DEPTH = 8  # parts rank 0 may route ahead of a rank (small: row ids and references)

_boxes: dict[int, queue.Queue[RankPart | None]] = {}  # rank 0's process: rank -> its parts
_lock = threading.Lock()


def _box(rank: int) -> queue.Queue[RankPart | None]:
    with _lock:
        return _boxes.setdefault(rank, queue.Queue(DEPTH))


def take_part(rank: int) -> RankPart | None:
    """Rank 0's process: rank ``rank``'s next part (``TrainerActor.next_part``)."""
    return _box(rank).get()  # Blocking wait: until rank 0 routes it


@dataclass(frozen=True)
class RayPartRoutes:
    """``PartRoutes`` over Ray (picklable: it travels in the ``WorkerLaunch``).

    Args:
        chief: rank 0's ``TrainerActor`` (it serves ``next_part``).
    """

    chief: Any

    def send(self, rank: int, part: RankPart | None) -> None:
        _box(rank).put(part)  # Blocking wait: while rank r is DEPTH parts behind

    def receive(self, rank: int) -> RankPart | None:
        # Blocking wait: rank 0 routes this rank's next part.
        part: RankPart | None = ray.get(self.chief.next_part.remote(rank))
        return part

    def fetch(self, refs: list[Any]) -> list[BlockRows]:
        got: list[BlockRows] = ray.get(refs)  # Blocking wait: zero-copy on this node
        return got
