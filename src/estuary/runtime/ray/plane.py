"""The actor data plane (``runtime.ray.data_plane: actor``): trainers reach the
PS shards through Ray actor calls, arrays through Ray's object store, instead of
the parameter server's socket protocol.

``ActorPSClient`` is a ``PSClient`` whose transport is ``ServerActor.call``: the
same requests (``RemoteTable``, ``ShardedPSClient`` and everything above them
are unchanged), served by the same ``ParameterServer.handle``. Which plane is
faster is measured by ``bench/ps_plane.py`` (docs/results.md); the socket plane
is the default.

Splits and merges (``estuary.ps.migration``) hand every client of the job the
servers it has now as the slot map's ``members``; on this plane an entry names
the server's Ray actor (``ServerActor.member``: its name and namespace; the
runtime names every server actor), and ``connect_actor`` finds a joined one by
that name (``ray.get_actor``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from estuary.ps.client import PSClient, member_identity
from estuary.ps.protocol import Arrays, Header
from estuary.ps.types import PSConnectionError, PSError, PSTimeoutError

__all__ = ["ActorPSClient", "actor_clients", "connect_actor"]


class ActorPSClient(PSClient):
    """A ``PSClient`` of one ``ServerActor`` over Ray actor calls.

    Args:
        actor: the server's actor handle.
        timeout_s: longest wait for any reply.
        member: the server's ``members`` entry (``ServerActor.member``), if at
            hand (``actor_clients`` fetches them up front, while every server
            is alive); else asked of the actor the first time it is needed.
    """

    def __init__(
        self, actor: Any, *, timeout_s: float = 600.0, member: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(f"ray actor {actor}", b"", timeout_s=timeout_s)
        self.actor = actor
        self._member = None if member is None else _with_namespace(member)

    def _send(
        self,
        op: str,
        fields: Mapping[str, Any] | None,
        arrays: Mapping[str, Any] | None,
    ) -> tuple[Header, Arrays]:
        ref = self.actor.call.remote({"op": op, **(fields or {})}, dict(arrays or {}))
        return self._get(ref, op)

    def _get(self, ref: Any, op: str) -> Any:
        return _reply(ref, op, self.timeout_s)

    def member(self) -> dict[str, Any]:
        """The server's ``members`` entry: its address, its actor's name and
        namespace (``ServerActor.member``; an empty key: reached by actor calls).

        Raises:
            PSError: the actor has no name (started without one: no other
                client could find it).
        """
        if self._member is None:
            self._member = _with_namespace(self._get(self.actor.member.remote(), "member"))
        if not self._member.get("actor"):
            raise PSError(
                f"split/merge: the server actor at {self._member.get('address')!r} has no "
                "name, so the job's other clients cannot find it; start it with a name"
            )
        return dict(self._member)

    @property
    def identity(self) -> Hashable:
        """Which server this is: its actor (name and namespace). A client whose
        entry was never fetched and whose actor is gone (a retired server,
        stopped) is no server of the job: it matches no ``members`` entry."""
        try:
            return member_identity(self.member())
        except PSConnectionError:
            return ("gone", id(self))

    def close(self) -> None:
        """Nothing to close (Ray owns the channel)."""


def _reply(refs: Any, op: str, timeout_s: float) -> Any:
    """``ray.get(refs)`` with Ray's errors as the PS client's: no reply in time
    (``PSTimeoutError``), the server actor gone (``PSConnectionError``)."""
    try:
        # Blocking wait: the server's reply (may include a staleness wait).
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as exc:
        raise PSTimeoutError(
            f"parameter server actor: no reply to {op!r} within {timeout_s:g} s"
        ) from exc
    except RayActorError as exc:
        raise PSConnectionError(f"parameter server actor died during {op!r}: {exc}") from exc


def _with_namespace(member: Mapping[str, Any]) -> dict[str, Any]:
    # No namespace: the caller's, as ray.get_actor reads it (so identities match).
    out = dict(member)
    if out.get("actor") and not out.get("namespace"):
        out["namespace"] = ray.get_runtime_context().namespace
    return out


def actor_clients(actors: Sequence[Any], *, timeout_s: float = 600.0) -> list[ActorPSClient]:
    """One ``ActorPSClient`` per server actor, each with its ``members`` entry
    fetched now, while every server is up (a later split or merge then
    matches them without a call to an actor that may be gone)."""
    members = _reply([a.member.remote() for a in actors], "member", timeout_s)
    return [
        ActorPSClient(a, timeout_s=timeout_s, member=m)
        for a, m in zip(actors, members, strict=True)
    ]


def connect_actor(member: Mapping[str, Any], timeout_s: float) -> PSClient:
    """An ``ActorPSClient`` of the server a ``members`` entry names (its actor's
    name and namespace): how a client on the actor plane reaches a server that
    joined the job (``ShardedPSClient(connect=connect_actor)``)."""
    name = member.get("actor")
    if not name:
        raise PSError(
            f"server at {member.get('address')!r} joined without an actor name; "
            "a client on the actor data plane cannot reach it"
        )
    member = _with_namespace(member)
    try:
        actor = ray.get_actor(str(name), namespace=member["namespace"])
    except ValueError as exc:  # no actor of that name (any more)
        raise PSConnectionError(f"parameter server actor {name!r} not found: {exc}") from exc
    return ActorPSClient(actor, timeout_s=timeout_s, member=member)
