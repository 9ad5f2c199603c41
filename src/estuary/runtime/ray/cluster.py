"""Joining a Ray cluster and placing a job's roles on it (all or none): the
core roles in one placement group, each data executor in one of its own."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from estuary.config import JobSpec
from estuary.config.roles import role_resource
from estuary.config.spec import RaySpec, RoleResources

__all__ = [
    "OWN_GROUPS",
    "Placement",
    "PlacementError",
    "RoleAsk",
    "connect",
    "place",
    "restore_environ",
]

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The cluster cannot fit the job's roles; the message names each role, what
    it asks and what the cluster has."""


@dataclass(frozen=True)
class RoleAsk:
    """``count`` processes of ``role``, each asking ``resources`` (and ``custom``:
    Ray custom resources, e.g. the role's node marker)."""

    role: str
    count: int
    resources: RoleResources
    custom: dict[str, float] = field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        """One process's ask as a Ray resource bundle."""
        out = {"CPU": float(self.resources.cpus)}
        if self.resources.gpus:
            out["GPU"] = float(self.resources.gpus)
        if self.resources.memory_mb is not None:
            out["memory"] = float(self.resources.memory_mb * 2**20)
        out.update(self.custom)
        return out

    def describe(self) -> str:
        return f"{self.role} x{self.count} asks {_fmt(self.bundle())} each"


def role_asks(job: JobSpec) -> list[RoleAsk]:
    """The job's roles in placement order: PS shards, trainers, data executors,
    embedding workers."""
    spec = job.runtime

    def ask(role: str, count: int, resources: RoleResources) -> RoleAsk:
        custom = {role_resource(role): 1.0} if spec.ray.role_resources else {}
        return RoleAsk(role, count, resources, custom)

    asks = [
        ask("ps", spec.ps_shards, spec.ray.ps),
        ask("trainer", spec.trainers, spec.ray.trainer),
    ]
    if spec.data_executors and job.data.dataset is not None:
        asks.append(ask("data_executor", spec.data_executors, spec.ray.data_executor))
    if spec.embedding_workers:
        asks.append(ask("embedding_worker", spec.trainers, spec.ray.embedding_worker))
    return asks


def connect(
    spec: RaySpec, asks: list[RoleAsk], spare_cpus: float = 0.0
) -> Callable[[], None] | None:
    """Join the cluster ``spec`` names (a local instance when ``address`` is
    ``null``, with room for ``asks`` and ``spare_cpus`` more: PS shards the
    scaling manager may add), unless this process is connected already. Returns how to leave
    it again (``None`` when it was connected before): ``ray.shutdown`` and then
    undo the variables ``ray.init`` set in this process's environment
    (``RAY_AUTH_MODE=token``, ``PYTHONBREAKPOINT``, ...), which would otherwise
    reach every subprocess the caller starts afterwards (a Ray Client server,
    for one, then fails to start)."""
    if ray.is_initialized():
        return None
    environ = dict(os.environ)
    # ray.init installs its own SIGTERM handler in the driver; the caller's
    # (the CLI's graceful stop) must stay.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if spec.address is None:
            wanted = sum(a.count * a.resources.cpus for a in asks) + spare_cpus
            cpus = spec.num_cpus or max(os.cpu_count() or 1, math.ceil(wanted))
            # "local": a new instance, never one `ray start` left running on this machine.
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
        else:
            _join(spec.address)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)

    def disconnect() -> None:
        ray.shutdown()
        restore_environ(environ)

    return disconnect


# Ray Client (``ray://``): the head's proxy starts a server process per
# connecting driver, and on a busy head that start sometimes fails at once
# ("Starting Ray client server failed", an empty server log); a new connection
# gets a new server, so the join is tried again.
CLIENT_ATTEMPTS = 3
CLIENT_RETRY_S = 2.0


def _join(address: str) -> None:
    """``ray.init`` at an existing cluster's ``address``; a Ray Client address
    (``ray://``) is tried up to ``CLIENT_ATTEMPTS`` times when the proxy aborts
    the connection, each failure logged."""
    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, logging_level=logging.WARNING)
            return
        except ConnectionAbortedError as error:
            if attempt == attempts:
                raise
            first = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
            logger.warning(
                "joining %s failed (attempt %d of %d: %s); trying again in %.0f s",
                address,
                attempt,
                attempts,
                first,
                CLIENT_RETRY_S * attempt,
            )
            ray.shutdown()  # the half-made client connection
            time.sleep(CLIENT_RETRY_S * attempt)


def restore_environ(saved: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``saved`` again: drop added variables, put
    back changed or removed ones."""
    for name in [n for n in os.environ if n not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


# Roles placed in groups of their own, one bundle per process, outside the
# job's core group: a data executor replaced (a memory change) or retired gives
# its reservation back while the job runs (``remove_placement_group``), which a
# bundle of a shared group cannot (Ray does not shrink a placement group).
OWN_GROUPS = ("data_executor",)


@dataclass
class Placement:
    """The job's ready placement groups: the core group (PS shards, trainers,
    embedding workers; ``first_bundle``: which bundle each role's process takes)
    and one group per data executor (``executor_groups[e]``: executor e's one
    bundle; the executor pool removes it once executor e is gone for good)."""

    group: PlacementGroup
    first_bundle: dict[str, int]
    executor_groups: tuple[PlacementGroup, ...] = ()

    def strategy(self, role: str, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.first_bundle[role] + rank,
        )

    def node_of(self, role: str, rank: int = 0) -> str | None:
        """The node (hex id) role ``role``'s process ``rank`` was reserved on (a
        core role: PS shards, trainers, embedding workers)."""
        return _bundle_node(self.group, self.first_bundle[role] + rank)

    def nodes(self) -> int:
        """Distinct nodes the bundles landed on (groups removed already aside)."""
        nodes: set[str] = set()
        for group in (self.group, *self.executor_groups):
            table = ray.util.placement_group_table(group)
            nodes.update(table.get("bundles_to_node_id", {}).values())
        return len(nodes) or 1

    def live_executor_groups(self) -> tuple[PlacementGroup | None, ...]:
        """``executor_groups`` with ``None`` for those removed (a pool of an
        earlier attempt gave them back: its executor e gets one the pool
        reserves)."""
        return tuple(
            None if ray.util.placement_group_table(g).get("state") == "REMOVED" else g
            for g in self.executor_groups
        )

    def remove(self) -> None:
        """Give every group back (those the executor pool removed already are skipped)."""
        for group in (self.group, *self.executor_groups):
            if ray.util.placement_group_table(group).get("state") != "REMOVED":
                remove_placement_group(group)


def place(asks: list[RoleAsk], timeout_s: float) -> Placement:
    """Reserve every role's resources together: the core roles in one group
    (``PACK``: as few nodes as fit), then each data executor in a group of its
    own (``OWN_GROUPS``), on the first trainer's node where it fits (a soft
    target: elsewhere when that node is full), where the old shared group's
    ``PACK`` kept them; the job starts once all of them are ready, or none is kept.

    Raises:
        PlacementError: a role asks for more than the cluster has in all, or the
            groups did not all fit within ``timeout_s``.
    """
    bundles: list[dict[str, float]] = []
    own: list[dict[str, float]] = []
    first: dict[str, int] = {}
    for ask in asks:
        if ask.role in OWN_GROUPS:
            own += [ask.bundle()] * ask.count
            continue
        first[ask.role] = len(bundles)
        bundles += [ask.bundle()] * ask.count
    total: Counter[str] = Counter()
    for bundle in bundles + own:
        total.update(bundle)
    have = ray.cluster_resources()
    short = {k: v for k, v in total.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        raise PlacementError(_explain(asks, total, have, "can never fit them"))
    deadline = time.monotonic() + timeout_s
    group = placement_group(bundles, strategy="PACK")
    groups = [group]
    # Blocking wait: the core group reserved first, so the executors' groups can
    # ask for the first trainer's node (the rows they read go to the trainers).
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready and own:
        near = _bundle_node(group, first.get("trainer", 0))
        groups += [
            placement_group([b], strategy="STRICT_PACK", _soft_target_node_id=near) for b in own
        ]
        # Blocking wait: every executor's group reserved (all or none: gang start-up).
        left = max(deadline - time.monotonic(), 0.0)
        pending = [g.ready() for g in groups[1:]]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=left)
        ready = ready if len(ready) == len(pending) else []
    if not ready:
        for g in groups:
            remove_placement_group(g)
        free = ray.available_resources()
        raise PlacementError(
            _explain(asks, total, free, f"has not had room for them within {timeout_s:g} s")
            + " (free now; runtime.ray.placement_timeout_s waits longer)"
        )
    return Placement(group, first, tuple(groups[1:]))


def _bundle_node(group: PlacementGroup, bundle: int) -> str | None:
    """The node (hex id) bundle ``bundle`` of the ready ``group`` landed on."""
    nodes = ray.util.placement_group_table(group).get("bundles_to_node_id", {})
    node = nodes.get(bundle)
    return str(node) if node else None


def _explain(asks: list[RoleAsk], total: Counter[str], have: dict[str, float], what: str) -> str:
    roles = "; ".join(a.describe() for a in asks)
    return (
        f"the Ray cluster {what}: {roles} (in all {_fmt(dict(total))}); "
        f"the cluster has {_fmt({k: have.get(k, 0.0) for k in total})}"
    )


def _fmt(resources: dict[str, float]) -> str:
    parts = []
    for key, value in resources.items():
        if key == "memory":
            parts.append(f"memory {value / 2**20:,.0f} MiB")
        else:
            parts.append(f"{key} {value:g}")
    return "{" + ", ".join(parts) + "}"
