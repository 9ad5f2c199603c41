"""A parameter server's side of the slot map: its routing version and the
fence a migration holds between steps (``estuary.ps.migration``).

::

    request (lookup_many / push_many) carrying map version v
      RoutingGate.admit(tables, steps, v)
        fenced and the request is past the fence (a train lookup of a step
        after the table's fence step, or any other read): wait until lifted
        v != this server's version: ``StaleRoutingError`` (the client fetches
        the map and routes the request again)

With slot counting on (``count_slots``, the scaling manager's hot-shard
rebalance), every train lookup adds its ids to a per-slot load (``take_loads``).

A checkpoint capture that spans the servers holds the map (``hold`` ...
``release``, taken on the servers in order): before rows move, the migration
takes ``lock_moves`` on the servers in the same order, which waits for the
holds to end, and a hold waits until the lift. A capture so sees every server
either before a migration or after it, never some of each, and the two never
wait on each other in a circle. Captures are not fenced (a trainer may
checkpoint while the fence step's last pushes are still coming).

A train lookup of step s <= fence passes: the steps up to the fence run on, so
every rank's push of the fence step arrives (pushes never wait here) and the
migration starts once the fence step is applied everywhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from estuary.embedding.hashing import SERVER_SALT, shard_of
from estuary.embedding.types import Int64Array
from estuary.ps.types import PSError, PSTimeoutError

__all__ = ["RoutingGate", "StaleRoutingError"]


class StaleRoutingError(PSError):
    """The request was routed with an older slot map than the server's."""


class RoutingGate:
    """Routing version, slot owners (``None``: the even map) and fence of one server."""

    def __init__(self) -> None:
        self.version = 0
        self.owners: np.ndarray | None = None
        self.servers = 0
        self.members: list[dict[str, Any]] | None = None  # after a split or merge
        self._cond = threading.Condition()
        self._fence: dict[str, int] | None = None
        self._moving = False  # rows move: holds wait (lock_moves ... lift)
        self._holds = 0
        self._looked: dict[str, int] = {}
        self._loads_lock = threading.Lock()
        self._loads: Int64Array | None = None

    def admit(
        self,
        tables: Sequence[str],
        steps: Sequence[int] | None,
        version: int | None,
        timeout_s: float,
    ) -> None:
        """Let a request through (see the module docstring); ``steps`` ``None``:
        not a train lookup; ``version`` ``None``: unrouted (a one-server client)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._fenced(tables, steps):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PSTimeoutError(f"request waited {timeout_s:g} s at a migration fence")
                self._cond.wait(left)  # Blocking wait: the migration lifts the fence.
            if version is not None and version != self.version:
                raise StaleRoutingError(
                    f"routed with slot map version {version}, the server is at {self.version}"
                )
            if steps is not None:
                for name, step in zip(tables, steps, strict=True):
                    self._looked[name] = max(self._looked.get(name, 0), step)

    def _fenced(self, tables: Sequence[str], steps: Sequence[int] | None) -> bool:
        if self._fence is None:
            return False
        if steps is None:
            return True
        return any(s > self._fence.get(t, 0) for t, s in zip(tables, steps, strict=True))

    def check(self, version: int | None) -> None:
        """Raise ``PSError`` when a push was routed with another map (a push of a
        step after a fence comes only after a lookup that fetched the new map)."""
        with self._cond:
            if version is not None and version != self.version:
                raise PSError(
                    f"push routed with slot map version {version}, the server is at "
                    f"{self.version}: a push crossed a migration"
                )

    def hold(self, timeout_s: float) -> None:
        """Keep the map from changing until ``release`` (a checkpoint capture that
        spans every server): waits while rows are moving (``lock_moves``)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._moving:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PSTimeoutError(f"hold waited {timeout_s:g} s for a migration to end")
                self._cond.wait(left)  # Blocking wait: the migration lifts its fence.
            self._holds += 1

    def release(self) -> None:
        """End one ``hold``."""
        with self._cond:
            self._holds = max(0, self._holds - 1)
            self._cond.notify_all()

    def lock_moves(self, timeout_s: float) -> None:
        """Let the rows move (until ``lift``): waits for the holds to end, and
        new holds wait meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._moving = True
            while self._holds > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._moving = False
                    self._cond.notify_all()
                    raise PSTimeoutError(f"migration waited {timeout_s:g} s for a capture")
                self._cond.wait(left)  # Blocking wait: a checkpoint capture ends.

    def fence(self, tables: Sequence[str], at: Mapping[str, int] | None) -> dict[str, int]:
        """Fence every table at ``at[t]`` or at the highest step looked up here,
        whichever is later; returns the fence steps."""
        with self._cond:
            fence = {t: max(self._looked.get(t, 0), (at or {}).get(t, 0)) for t in tables}
            if self._fence is not None:
                fence = {t: max(s, self._fence.get(t, 0)) for t, s in fence.items()}
            self._fence = fence
            self._cond.notify_all()  # a raised fence lets waiting lookups through
            return dict(fence)

    def lift(self) -> None:
        """Let the waiting requests through (they then see the new version)."""
        with self._cond:
            self._fence = None
            self._moving = False
            self._cond.notify_all()

    @property
    def fenced(self) -> bool:
        with self._cond:
            return self._fence is not None

    def set_map(
        self,
        owners: np.ndarray,
        servers: int,
        version: int,
        members: list[dict[str, Any]] | None = None,
    ) -> None:
        """Adopt slot map ``version`` (owners int64 (S,)); ``members``: the job's
        servers in order (``address``, ``authkey`` hex), set when a split or
        merge changed them (kept otherwise). Slot loads being counted restart
        at zero over the new S when S changed (a refined or restored map)."""
        with self._cond:
            self.owners = np.asarray(owners, np.int64).copy()
            self.servers = servers
            self.version = version
            if members is not None:
                self.members = members
        with self._loads_lock:  # counting: over the new map's slots from now on
            if self._loads is not None and self._loads.size != self.owners.size:
                self._loads = np.zeros(self.owners.size, np.int64)

    def start_at(self, steps: Mapping[str, int]) -> None:
        """A server joining mid-run: steps up to ``steps[t]`` count as looked up
        here (a later fence is never below them)."""
        with self._cond:
            for name, step in steps.items():
                self._looked[name] = max(self._looked.get(name, 0), step)

    def count_slots(self, slots: int) -> None:
        """Count train-lookup ids per slot of a ``slots``-slot map from now on."""
        with self._loads_lock:
            if self._loads is None or self._loads.size != slots:
                self._loads = np.zeros(slots, np.int64)

    def note(self, ids: Int64Array) -> None:
        """Add a train lookup's ids to the slot loads (no-op unless counting)."""
        loads = self._loads
        if loads is None or ids.size == 0:
            return
        counts = np.bincount(shard_of(ids, loads.size, salt=SERVER_SALT), minlength=loads.size)
        with self._loads_lock:
            if self._loads is loads:
                loads += counts

    def take_loads(self) -> Int64Array | None:
        """Ids looked up per slot since the last take (then zero); ``None``: not counting."""
        with self._loads_lock:
            if self._loads is None:
                return None
            out = self._loads.copy()
            self._loads[:] = 0
            return out
