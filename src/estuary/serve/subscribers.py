"""``Subscribers``: which slot file each server of a node reads, and when the one
preparer of the node may write which slot (no Ray here: the node's preparer,
``estuary.serve.node_preparer``, holds one and acts on what it decides).

The preparer writes each version into one of two slot files (``SlotWriter``)
and offers it to every subscriber (a Ray Serve replica of the node). A
subscriber answers each offer: ``served`` (it serves the version now, from its
slot) or ``skipped`` (it could not; it serves what it served before). A slot
may be written only when no live subscriber reads it, so version v+1 goes into
the slot of v-1 only after every live subscriber has answered v:

- every offer gets an answer, or the subscriber is dropped: a subscriber owing
  an answer past ``timeout_s`` after the offer, or silent (no call) for
  ``timeout_s`` while owing nothing, is dead or hung and must not stall the
  others (``expire``); one whose process is gone is dropped at once (``drop``:
  the caller knows it, e.g. by its pid);
- when both slots are read (some subscribers skipped the newest version and
  still read the slot of the one before, the others serve the newest), the
  readers of the older slot are dropped (``free_slot``): the newest version is
  kept, the writer writes the older slot. A dropped subscriber learns it at its
  next call and joins again;
- a subscriber joining gets the newest version some live subscriber serves (the
  slot that stays unwritten), the newest offered when none is served yet (the
  first, before any subscriber answered), or, while a version is being
  written, that one once it is offered.

Offers carry a sequence number (``seq``); a subscriber answers by it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Offer", "SlotChoice", "Subscribers"]


@dataclass(frozen=True)
class Offer:
    """A version written into a slot and offered to the subscribers.

    Args:
        seq: its sequence number (1, 2, ...: one per version written).
        slot: the index of the slot file holding it.
        message: what a subscriber is told (``file``, ``bytes``, ``checkpoint``, ...).
    """

    seq: int
    slot: int
    message: dict[str, Any]


@dataclass(frozen=True)
class SlotChoice:
    """Where the next version goes, and the subscribers dropped to free it."""

    slot: int
    dropped: list[str] = field(default_factory=list)


@dataclass
class _Subscriber:
    slot: int | None = None  # the slot it serves from (None: its own loaded checkpoint)
    owed: int | None = None  # the seq of the offer it has not answered yet
    deadline: float = 0.0  # dropped when the clock passes this


class Subscribers:
    """The subscribers of one node's preparer and the slot each reads (module
    docstring). Not thread-safe: the preparer calls it under its lock.

    Args:
        timeout_s: an answer owed for longer, or silence for longer, drops a subscriber.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"Subscribers: timeout_s must be > 0, not {timeout_s}")
        self.timeout_s = timeout_s
        self.clock = clock
        self.dropped_total = 0
        self.joined_total = 0
        self._subs: dict[str, _Subscriber] = {}
        self._offers: dict[int, Offer] = {}  # the newest, and the newest served
        self._newest: Offer | None = None
        self._current: Offer | None = None  # the newest some live subscriber serves
        self._writing = False

    def __contains__(self, sid: str) -> bool:
        return sid in self._subs

    def __len__(self) -> int:
        return len(self._subs)

    @property
    def current(self) -> Offer | None:
        """The version a subscriber joining now is given (``None``: none yet)."""
        return self._current

    def slots_read(self) -> dict[str, int | None]:
        """Each live subscriber's slot (``None``: none of the preparer's)."""
        return {sid: s.slot for sid, s in self._subs.items()}

    def join(self, sid: str) -> None:
        """``sid`` subscribes (anew, if it was a subscriber): it owes an answer to
        the current version, which it is given; while a version is being
        written, to that one once offered."""
        now = self.clock()
        sub = self._subs[sid] = _Subscriber(deadline=now + self.timeout_s)
        self.joined_total += 1
        # None served yet: the newest offered (the writer waits for this
        # subscriber's answer before it writes again, so its slot stays).
        given = self._current if self._current is not None else self._newest
        if given is not None and not self._writing:
            sub.owed = given.seq

    def leave(self, sid: str) -> None:
        """``sid`` unsubscribes (it reads no slot any more)."""
        self._subs.pop(sid, None)

    def drop(self, sids: list[str]) -> list[str]:
        """Drop ``sids`` (known to read nothing any more: their process is gone);
        returns those that were subscribers."""
        gone = [sid for sid in sids if self._subs.pop(sid, None) is not None]
        self.dropped_total += len(gone)
        return gone

    def offer_for(self, sid: str) -> Offer | None:
        """The offer ``sid`` owes an answer to (``None``: nothing new); counts as a
        sign of life.

        Raises:
            KeyError: ``sid`` is not a subscriber (it was dropped, or never joined).
        """
        sub = self._subs[sid]
        if sub.owed is None:
            sub.deadline = self.clock() + self.timeout_s
            return None
        return self._offers[sub.owed]

    def answer(self, sid: str, seq: int, served: bool) -> bool:
        """``sid`` answers offer ``seq``: it serves it (``served``) or not; ``False``
        when ``sid`` is no subscriber (dropped: it must join again)."""
        sub = self._subs.get(sid)
        if sub is None:
            return False
        if sub.owed != seq:
            return True  # an answer to an offer it no longer owes (joined anew since)
        sub.owed = None
        sub.deadline = self.clock() + self.timeout_s
        if served:
            offer = self._offers[seq]
            sub.slot = offer.slot
            if self._current is None or seq > self._current.seq:
                self._current = offer
                self._keep()
        return True

    def expire(self) -> list[str]:
        """Drop the subscribers past their deadline; returns them."""
        now = self.clock()
        gone = [sid for sid, s in self._subs.items() if now > s.deadline]
        for sid in gone:
            del self._subs[sid]
        self.dropped_total += len(gone)
        return gone

    def settled(self) -> bool:
        """No live subscriber owes an answer: a slot may be chosen."""
        return all(s.owed is None for s in self._subs.values())

    def free_slot(self, proposed: int, slots: int = 2) -> SlotChoice:
        """The slot to write next (``proposed``: the writer's turn), dropping the
        readers of the older version when every slot is read; marks a write
        begun (``offer`` ends it). Call when ``settled``."""
        read = {s.slot for s in self._subs.values() if s.slot is not None}
        order = [(proposed + i) % slots for i in range(slots)]
        free = [i for i in order if i not in read]
        dropped: list[str] = []
        if free:
            slot = free[0]
        else:  # every slot read: keep the newest served version's slot, free another
            keep = self._current.slot if self._current is not None else None
            slot = next(i for i in order if i != keep)
            dropped = [sid for sid, s in self._subs.items() if s.slot == slot]
            for sid in dropped:
                del self._subs[sid]
            self.dropped_total += len(dropped)
        if self._current is not None and self._current.slot == slot:
            self._current = None  # its readers are gone: it is about to be overwritten
        self._writing = True
        return SlotChoice(slot, dropped)

    def offer(self, slot: int, message: dict[str, Any]) -> Offer:
        """A version written into ``slot``: every live subscriber now owes an
        answer to it, within ``timeout_s``."""
        seq = (self._newest.seq if self._newest is not None else 0) + 1
        offer = self._newest = Offer(seq, slot, message)
        self._offers[seq] = offer
        self._keep()
        deadline = self.clock() + self.timeout_s
        for sub in self._subs.values():
            sub.owed, sub.deadline = seq, deadline
        self._writing = False
        return offer

    def abandon(self) -> None:
        """The write begun by ``free_slot`` failed: nothing is offered."""
        self._writing = False

    def _keep(self) -> None:
        keep = {o.seq for o in (self._newest, self._current) if o is not None}
        keep |= {s.owed for s in self._subs.values() if s.owed is not None}
        for seq in [s for s in self._offers if s not in keep]:
            del self._offers[seq]
