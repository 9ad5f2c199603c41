"""The job's roles as Ray actor classes: a parameter-server shard and a trainer.

Both are threaded actors (``max_concurrency``): a trainer's ``run`` trains
while ``stop`` can still reach it; a server's ``serve`` returns only when it
stops, so a finished ``serve`` call is a server gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from typing import Any

import ray

from estuary.data.graph.routing import RankPart
from estuary.ps import ParameterServer, ServerConfig
from estuary.ps.types import Address
from estuary.runtime.ray.delivery import take_part
from estuary.runtime.worker import WorkerLaunch, run_trainer
from estuary.train import FitResult, TrainingStopped

__all__ = ["ServerActor", "StopFlag", "TrainerActor", "server_name"]


class StopFlag:
    """The trainer's stop signal: ``value`` is a signal number once a stop is
    asked (``CollectiveStop`` polls it)."""

    def __init__(self) -> None:
        self.value = 0


def server_name() -> str:
    """A fresh name for a ``ServerActor``: on the actor data plane the job's
    clients find a server that joined by it (``estuary.runtime.ray.plane``)."""
    return f"estuary-ps-{uuid.uuid4().hex}"


# Many threads: with the actor data plane, a lookup waiting at the staleness
# barrier holds one while the pushes that release it need others.
@ray.remote(max_concurrency=64)  # type: ignore[call-overload]
class ServerActor:
    """One parameter-server shard: a ``ParameterServer`` on TCP at this node's
    address, also served through ``call`` (the actor data plane)."""

    def __init__(self, config: ServerConfig, authkey: bytes) -> None:
        host = ray.util.get_node_ip_address()
        self.server = ParameterServer(config, address=(host, 0), authkey=authkey)
        self._done = threading.Event()
        threading.Thread(target=self._serve, name="estuary-ps", daemon=True).start()

    def _serve(self) -> None:
        try:
            self.server.serve_forever()
        finally:
            self._done.set()

    def endpoint(self) -> tuple[Address, int]:
        """(where trainers connect, this process's pid)."""
        return self.server.address, os.getpid()

    def member(self) -> dict[str, Any]:
        """This server as a slot map's ``members`` name it on the actor data
        plane (``ActorPSClient.member``): address, no key, this actor's name and
        namespace (an unnamed actor: no name, so no other client could find it)."""
        context = ray.get_runtime_context()
        return {
            "address": self.server.address,
            "authkey": "",
            "actor": context.get_actor_name() or "",
            "namespace": context.namespace,
        }

    def call(self, header: dict[str, Any], arrays: dict[str, Any]) -> tuple[Any, Any]:
        """One request of the actor data plane (``ActorPSClient``)."""
        return self.server.handle(header, arrays)

    def table_stats(self) -> dict[str, tuple[int, int, int, int | None, int, int | None]]:
        """Per hosted table: (rows, memory bytes, ids looked up, row cap or
        ``None``, rows its arrays hold before they grow, admission
        ``min_count`` or ``None``), for the scaling manager
        (``estuary.runtime.ray.scaling``)."""
        out = {}
        for name, table in self.server.tables.items():
            stats = table.stats()
            out[name] = (
                stats.rows,
                stats.bytes,
                stats.lookups,
                table.capacity_rows,
                table.allocated_rows,
                table.admission_min_count,
            )
        return out

    def raise_admission(self, min_count: int) -> dict[str, int | None]:
        """Raise every hosted table's admission ``min_count`` to ``min_count``
        (``EmbeddingTable.raise_admission``); per table its ``min_count`` now
        (``None``: the table admits every id, nothing to raise)."""
        return {
            name: table.raise_admission(min_count) for name, table in self.server.tables.items()
        }

    def cap_rows(self, rows: int) -> int:
        """Cap this shard's rows at ``rows`` over its tables, each its share by
        the rows it holds now (``EmbeddingTable.cap_rows``); returns the cap now."""
        tables = self.server.tables
        held = {name: max(1, t.stats().rows) for name, t in tables.items()}
        total = sum(held.values())
        return sum(
            table.cap_rows(max(1, rows * held[name] // total)) for name, table in tables.items()
        )

    def serve(self) -> None:
        """Return when the server stops (shutdown or a crash)."""
        self._done.wait()

    def shutdown(self) -> None:
        self.server.close()


# Threads: ``run``, ``stop``, and on rank 0 with direct delivery one
# ``next_part`` per other rank (the runtime raises it to 2 + W).
@ray.remote(max_concurrency=2)  # type: ignore[call-overload]
class TrainerActor:
    """One trainer rank; ``run`` trains (see ``run_trainer``)."""

    def __init__(self) -> None:
        self.flag = StopFlag()

    def rendezvous(self) -> tuple[str, int, int]:
        """(this node's address, a free TCP port there, this process's pid): rank 0's
        answer is the process group's ``tcp://`` rendezvous."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        return host, port, os.getpid()

    def run(self, rank: int, launch: WorkerLaunch) -> FitResult | TrainingStopped | None:
        return run_trainer(rank, launch, self.flag)

    def next_part(self, rank: int) -> RankPart | None:
        """Rank 0, direct delivery: rank ``rank``'s next part (``RayPartRoutes``)."""
        return take_part(rank)

    def stop(self, signum: int) -> None:
        """Ask for a stop: the ranks agree on a step, checkpoint it and return."""
        self.flag.value = int(signum)


def kill_all(actors: list[Any]) -> None:
    """Kill ``actors`` at once (no restart by Ray: the controller decides)."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
