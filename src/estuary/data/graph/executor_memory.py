"""A data executor's resident memory, as the scaling manager reads it (the
vertical memory knob, ``estuary.runtime.scaling``).

::

    base   resident bytes when the executor last had no read in flight: what it
           keeps between reads (code, JIT caches, the allocator's arenas)
    peak   the most resident bytes seen since the previous ``take``, sampled at
           every block a read emits (a read's blocks are its memory high points)

``peak - base`` over the concurrent reads is what one read costs, so the policy
can forecast the executor at another thread count.
"""

from __future__ import annotations

import os
import resource
import sys
import threading

__all__ = ["MemoryWatch", "resident_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set now (Linux: ``/proc/self/statm``); elsewhere
    its peak so far (``getrusage``), an upper bound."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryWatch:
    """``base`` and ``peak`` of one executor process (see the module docstring);
    safe across the actor's concurrent reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self.base = resident_bytes()
        self._peak = self.base

    def read_started(self) -> None:
        with self._lock:
            self._inflight += 1

    def sample(self) -> None:
        """A read's high point (it is about to hand on a block)."""
        now = resident_bytes()
        with self._lock:
            self._peak = max(self._peak, now)

    def read_ended(self) -> None:
        now = resident_bytes()
        with self._lock:
            self._inflight -= 1
            self._peak = max(self._peak, now)
            if self._inflight == 0:
                self.base = now

    def take(self) -> tuple[int, int]:
        """``(base, peak)``; the peak starts again from now."""
        now = resident_bytes()
        with self._lock:
            peak = max(self._peak, now)
            self._peak = now
            if self._inflight == 0:
                self.base = now
            return self.base, peak
