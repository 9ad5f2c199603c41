"""The hot-shard rebalance: which slots of a hot PS shard to move to the
coldest one, from the ids looked up per slot (``estuary.ps.routing``).

::

    hot shard h (load L_h), coldest c (L_c), per-slot loads l[s]
    target = (L_h - L_c) / 2                 the move that evens the pair
    slots of h, hottest first: take s while moved + l[s] <= target
    (at least one loaded slot stays on h; slots with no load do not move)

A slot hotter than the target cannot move without overshooting: when no slot
fits, nothing moves here, and the Ray actuator refines the slot map (every
slot split into up to 16, ``SlotMap.refined``; no row moves) so the next
interval can move part of that slot's ids. One id alone cannot be split: with
the map at its finest the decision says why nothing moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estuary.embedding.types import Int64Array

__all__ = ["Moves", "plan_moves"]


@dataclass(frozen=True)
class Moves:
    """``slots`` to move; ``moved`` the load they carried; ``hot_load`` and
    ``cold_load`` the two shards' loads over the same window."""

    slots: Int64Array
    moved: float
    hot_load: float
    cold_load: float

    @property
    def share(self) -> float:
        """Fraction of the hot shard's load that moves."""
        return self.moved / self.hot_load if self.hot_load > 0 else 0.0


def plan_moves(loads: Int64Array, owners: Int64Array, hot: int, cold: int) -> Moves:
    """The slots (of a map with ``owners`` int64 (S,)) to move from ``hot`` to
    ``cold`` given ``loads`` int64 (S,) ids looked up per slot (see the module
    docstring)."""
    loads = np.asarray(loads, np.float64)
    owned = np.flatnonzero(owners == hot)
    hot_load = float(loads[owned].sum())
    cold_load = float(loads[owners == cold].sum())
    target = (hot_load - cold_load) / 2
    order = owned[np.argsort(-loads[owned], kind="stable")]
    picked: list[int] = []
    moved = 0.0
    for slot in order:
        load = float(loads[slot])
        if load <= 0:
            break
        if moved + load <= target and moved + load < hot_load:
            picked.append(int(slot))
            moved += load
    return Moves(np.asarray(picked, np.int64), moved, hot_load, cold_load)
