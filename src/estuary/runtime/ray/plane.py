"""The actor data plane (``runtime.ray.data_plane: actor``): trainers reach the
PS shards through Ray actor calls, arrays through Ray's object store, instead of
the parameter server's socket protocol.

``ActorPSClient`` is a ``PSClient`` whose transport is ``ServerActor.call``: the
same requests (``RemoteTable``, ``ShardedPSClient`` and everything above them
are unchanged), served by the same ``ParameterServer.handle``. Which plane is
faster is measured by ``bench/ps_plane.py`` (docs/results.md); the socket plane
is the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from estuary.ps.client import PSClient
from estuary.ps.protocol import Arrays, Header
from estuary.ps.types import PSConnectionError, PSTimeoutError

__all__ = ["ActorPSClient"]


class ActorPSClient(PSClient):
    """A ``PSClient`` of one ``ServerActor`` over Ray actor calls.

    Args:
        actor: the server's actor handle.
        timeout_s: longest wait for any reply.
    """

    def __init__(self, actor: Any, *, timeout_s: float = 600.0) -> None:
        super().__init__(f"ray actor {actor}", b"", timeout_s=timeout_s)
        self.actor = actor

    def _send(
        self,
        op: str,
        fields: Mapping[str, Any] | None,
        arrays: Mapping[str, Any] | None,
    ) -> tuple[Header, Arrays]:
        ref = self.actor.call.remote({"op": op, **(fields or {})}, dict(arrays or {}))
        try:
            # Blocking wait: the server's reply (may include a staleness wait).
            header, out = ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError as exc:
            raise PSTimeoutError(
                f"parameter server actor: no reply to {op!r} within {self.timeout_s:g} s"
            ) from exc
        except RayActorError as exc:
            raise PSConnectionError(f"parameter server actor died during {op!r}: {exc}") from exc
        return header, out

    def close(self) -> None:
        """Nothing to close (Ray owns the channel)."""
