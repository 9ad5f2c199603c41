"""Stop signals: how a running fit learns it should stop after a step.

A stop (SIGTERM, SIGINT, a caller's ``request``) ends the fit after the step in
progress, with a checkpoint of that step. One process needs only a flag
(``LocalStop``). Several trainers must stop after the *same* step, so they agree
on it (``CollectiveStop``: a one-int all-reduce every few steps).

Two questions, asked in different places:

* ``asked()`` — was a stop asked of *this* process? Cheap, any thread, no
  collective (a reader waiting for data polls it while idle).
* ``poll(step)`` — stop now, after ``step``? Called between steps by the fit
  loop; with several trainers every rank calls it and all get the same answer.
"""

from __future__ import annotations

import signal
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["STOP_POLL_STEPS", "CollectiveStop", "LocalStop", "StopSignal"]

STOP_POLL_STEPS = 8
"""Ranks agree whether to stop every this many steps (``CollectiveStop``)."""


class StopSignal(Protocol):
    """What the fit loop asks whether to stop (see module docstring)."""

    def request(self, reason: str) -> None:
        """Ask for a stop (safe from a signal handler)."""
        ...

    def asked(self) -> bool:
        """Whether a stop was asked of this process (no collective; any thread)."""
        ...

    def reason(self) -> str:
        """What asked for the stop (e.g. ``SIGTERM``)."""
        ...

    def poll(self, step: int) -> bool:
        """Whether to stop now, after ``step`` steps (every rank gets one answer)."""
        ...


class LocalStop:
    """One process: a flag set by ``request``."""

    def __init__(self) -> None:
        self._reason: str | None = None

    def request(self, reason: str) -> None:
        self._reason = reason

    def asked(self) -> bool:
        return self._reason is not None

    def reason(self) -> str:
        return self._reason or "a stop request"

    def poll(self, step: int) -> bool:
        return self._reason is not None


class CollectiveStop:
    """W trainers: a stop asked of any rank (``request``, or the launcher setting
    the shared ``value`` to a signal number) stops every rank after one step
    they agree on: every ``every`` steps the ranks all-reduce (MAX) the signal
    asked of each.

    Args:
        value: a shared int (``multiprocessing.Value``; 0 = keep going) the
            launcher sets on SIGTERM / SIGINT, or ``None``.
        world_size: W; with W = 1 no collective runs.
        group: a process group used only for these polls (W > 1), so they never
            interleave with other collectives.
        every: poll period in steps.
    """

    def __init__(
        self, value: Any, world_size: int, group: Any = None, every: int = STOP_POLL_STEPS
    ) -> None:
        self.value, self.world_size, self.group, self.every = value, world_size, group, every
        self._reason: str | None = None

    def request(self, reason: str) -> None:
        self._reason = reason

    def asked(self) -> bool:
        return bool(self._signal())

    def reason(self) -> str:
        if self._reason is not None:
            return self._reason
        asked = self._signal()
        return signal.Signals(asked).name if asked else "a stop request"

    def poll(self, step: int) -> bool:
        asked = self._signal()
        if self.world_size > 1:
            if step % self.every:
                return False
            flag = torch.tensor([asked], dtype=torch.int64)
            # Blocking wait: every rank's answer (a one-int all-reduce).
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            asked = int(flag.item())
        if asked and self._reason is None:
            self._reason = signal.Signals(asked).name
        return bool(asked)

    def _signal(self) -> int:
        # The launcher's shared value, else request's reason (a signal name, or
        # SIGTERM for any other reason); 0 = keep going.
        if self.value is not None and self.value.value:
            return int(self.value.value)
        if self._reason is None:
            return 0
        known = self._reason in signal.Signals.__members__
        return int(signal.Signals[self._reason] if known else signal.SIGTERM)
