"""How connectors ride out a lost server: retry from our own position with a
capped backoff, and give up once the server was gone for ``timeout_s``."""

from __future__ import annotations

import time
from collections.abc import Callable

from estuary.data.streams.types import StreamError

__all__ = ["Outage"]

_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 0.5


class Outage:
    """Tracks one connection's current outage (the policy; the connector acts).

    Args:
        what: the source and server, for the error message.
        timeout_s: how long an outage may last before reads fail.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self, what: str, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.clock = clock
        self.since: float | None = None
        self.next_try = 0.0
        self.failures = 0

    def ok(self) -> None:
        """A call succeeded: the outage (if any) is over."""
        self.since = None
        self.failures = 0
        self.next_try = 0.0

    def failed(self, error: BaseException) -> None:
        """A call failed with a connection error: the next try is due after a
        pause (50 ms doubling to 0.5 s), across calls.

        Raises:
            StreamError: the outage has lasted ``timeout_s``.
        """
        now = self.clock()
        if self.since is None:
            self.since = now
        if now - self.since >= self.timeout_s:
            raise StreamError(
                f"{self.what}: server unreachable for {now - self.since:.1f} s "
                f"(reconnect_timeout_s={self.timeout_s:g}): {error}"
            ) from error
        pause_s = min(_FIRST_PAUSE_S * 2 ** min(self.failures, 8), _MAX_PAUSE_S)
        self.failures += 1
        self.next_try = now + pause_s

    def wait_s(self) -> float:
        """Seconds until the next try is due (0 outside an outage)."""
        return max(self.next_try - self.clock(), 0.0)

    def pause(self, deadline: float) -> bool:
        """Sleep until the next try is due; False (after sleeping until
        ``deadline``) when that is past the caller's deadline."""
        wait_s = self.wait_s()
        if wait_s <= 0:
            return True
        remaining_s = deadline - self.clock()
        if wait_s > remaining_s:
            time.sleep(max(remaining_s, 0.0))  # blocks: nothing to do until then
            return False
        time.sleep(wait_s)  # blocks: backoff before the next try
        return True
