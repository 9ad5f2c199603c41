"""The scaling controller: every interval it takes a ``Snapshot``, asks the
policy, drops decisions that would flap (``Hysteresis``), applies the rest, and
logs each with its trigger and, one interval later, its measured effect.

::

    thread "estuary-scaling", every interval_s:
      snapshot = sample()            (the job's clocks and stats)
      decisions = policy.decide(history)
      allowed = hysteresis.allow(d)  -> actuator.apply(d) -> Timeline
      next interval: each applied decision gets its effect (rows/s, memory before/after)

The actuator owns the knobs (``Actuator``): the Ray data executor pool resizes
itself live, a table caps its rows, the Ray PS shards move a hot shard's slots
(``estuary.runtime.ray.scaling``). A knob it does not own is logged as
``applied: false``, with the reason. An actuator may leave what an applied
decision did in ``last_detail`` (a dict: a migration's rows and pause); the
timeline records it with the decision.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from estuary.runtime.scaling.metrics import Snapshot
from estuary.runtime.scaling.policy import Decision, Hysteresis, Policy
from estuary.runtime.scaling.timeline import Timeline

__all__ = ["Actuator", "Controller"]

logger = logging.getLogger(__name__)


class Actuator(Protocol):
    def apply(self, decision: Decision) -> str | None:
        """Carry ``decision`` out; ``None`` when done, else why it was not."""
        ...


class Controller:
    """Runs ``policy`` over ``sample()`` every ``interval_s`` (see module docstring).

    Args:
        policy: decides.
        sample: the job's snapshot now (``t`` is filled in by the controller).
        actuator: applies.
        interval_s: seconds between two snapshots.
        hold_intervals: see ``Hysteresis``.
        out: folder for ``scaling.json`` and ``scaling.png`` at ``close``; ``None``: none.
        clock: seconds, monotonic (tests pass a simulated one).
        name: the timeline's file names (``NAME.json``, ``NAME.png``).
    """

    def __init__(
        self,
        policy: Policy,
        sample: Callable[[float], Snapshot],
        actuator: Actuator,
        *,
        interval_s: float,
        hold_intervals: int = 2,
        out: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "scaling",
    ) -> None:
        self.name = name
        self.clock = clock
        self.policy = policy
        self.sample = sample
        self.actuator = actuator
        self.interval_s = interval_s
        self.hysteresis = Hysteresis(hold_intervals)
        self.timeline = Timeline(policy.name, interval_s)
        self.out = out
        self.history: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = clock()

    def start(self) -> Controller:
        self._started = self.clock()
        self._thread = threading.Thread(target=self._loop, name="estuary-scaling", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):  # Blocking wait: one interval
            try:
                self.step()
            except Exception:  # a failed look is logged; the job goes on
                logger.exception("scaling: an interval failed")

    def step(self) -> list[Decision]:
        """One interval: snapshot, decide, apply (also called by tests directly)."""
        snapshot = self.sample(self.clock() - self._started)
        self.history.append(snapshot)
        interval = len(self.history)
        self.timeline.observe(interval, snapshot)
        applied = []
        for decision in self.policy.decide(self.history):
            if not self.hysteresis.allow(decision, interval):
                self.timeline.refuse(interval, snapshot.t, decision)
                continue
            why_not = self.actuator.apply(decision)
            detail = getattr(self.actuator, "last_detail", None)
            self.timeline.decide(interval, snapshot.t, decision, why_not, detail)
            if why_not is None:
                applied.append(decision)
                logger.info(
                    "scaling: %s %g -> %g (%s)",
                    decision.knob,
                    decision.old,
                    decision.new,
                    decision.trigger,
                )
        return applied

    def close(self) -> Timeline:
        """Stop the thread; write the timeline (and its plot) when ``out`` is set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 10)
        if self.out is not None:
            self.timeline.write(self.out, self.name)
        return self.timeline
