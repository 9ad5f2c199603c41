"""Data executors on Ray (``runtime.data_executors``): actors that read whole
splits of a ``data.dataset`` for the driver on rank 0, and leave the rows in the
object store for the trainers (direct delivery, ``estuary.data.graph.routing``).

::

    rank 0: Driver (plans, waits for readiness, routes, accounts)
      worker thread --read(split)--> RayExecutorPool --> DataExecutorActor e
                                       an idle executor takes the split and
                                       streams, per block, its rows (left in the
                                       object store) and its accounting (to rank 0)
    rank r: fetches the blocks routed to it from the object store
    executor e dies mid-split: the pool starts a new one in e's placement group
      and reads the split again there (no row of it was handed out: a split's
      blocks are handed on whole), nothing else restarts
    executor e replaced (a memory change) or retired and stopped: its placement
      group (one bundle, ``cluster.place``) is removed at once, its reservation
      back to the cluster while the job runs; no later executor takes it
    executor added (a grow), replacing one (a memory change, with the new ask),
      or started where the job's group is gone (a restarted attempt): the pool
      reserves it a one-bundle group of its own as ``cluster.place`` does (the
      role's custom resources, near the first trainer's node), removed with it

The blocks' rows are the executor call's return objects, owned by rank 0 and
kept by the node's object store: they outlive the executor process that made
them, and are freed once the rank that trained them lets go.

Executors lost and replaced are counted (``data_executor_restarts`` in
summary.json); past ``runtime.max_restarts`` replacements the read fails with
an error naming the executor and its cause.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from estuary.config.spec import JobSpec, RoleResources
from estuary.data.errors import DataError
from estuary.data.graph.executor_actor import DataExecutorActor
from estuary.data.graph.executors import SplitReader
from estuary.runtime.ray.cluster import RoleAsk
from estuary.runtime.scaling.metrics import BusyClock, ExecutorMemory

__all__ = ["DataExecutorActor", "DataExecutorLost", "PoolClosed", "RayExecutorPool", "RayExecutors"]

_T = TypeVar("_T")


class DataExecutorLost(DataError):
    """A data executor died more often than ``runtime.max_restarts`` allows."""


class PoolClosed(DataError):
    """The pool was closed while a read waited for (or ran on) an executor."""


@dataclass(frozen=True)
class RayExecutors:
    """What rank 0 needs to run the job's data executors (picklable: it travels
    in the ``WorkerLaunch``); calling it starts them (a ``RayExecutorPool``).

    Args:
        count: E.
        resources: each executor's ask.
        groups: executor e's own placement group (one bundle) for e < E;
            ``None``: none (removed in an earlier attempt: the pool reserves
            e a new one).
        max_restarts: executors that may be lost and replaced in one run.
        name: prefix of the executors' actor names (``NAME-e``).
        direct: the pool hands on ``RemoteBlock``s (direct delivery); else
            rank 0 fetches the rows and hands on ``Block``s.
        max_threads: most concurrent reads per executor (vertical scaling).
        bridge: most extra splits one running executor reads in place of
            executors starting (``runtime.scaling.bridge_reads``; 0: none).
        custom: Ray custom resources each executor's bundle asks for too (the
            role's node marker, ``runtime.ray.role_resources``).
        near: the node (hex id) the pool's own groups ask for (a soft target:
            the first trainer's); ``None``: anywhere.
    """

    count: int
    resources: RoleResources
    groups: tuple[Any, ...]
    max_restarts: int
    name: str
    direct: bool = True

    max_threads: int = 1
    bridge: int = 0
    custom: dict[str, float] = dataclasses.field(default_factory=dict)
    near: str | None = None

    def __call__(self) -> RayExecutorPool:
        return RayExecutorPool(self, max_threads=self.max_threads, bridge=self.bridge)


class RayExecutorPool:
    """E data executor actors behind the driver's ``SplitPool`` interface.

    Resizable while it runs (the scaling manager, ``estuary.runtime.scaling``):
    ``resize(n)`` starts executors at once (each in a placement group of its
    own, as the first E; while one starts, a running executor
    reads one more split at once in its place, up to ``bridge`` such loans per
    executor, handed back once it is up) or retires the newest ones: a retired
    executor takes no new split and is stopped once its split in flight is
    handed on whole, so no split is lost or read twice; an executor stopped for
    good gives its placement group back (``released``). ``set_threads(t)`` lets
    each executor read ``t`` splits at once (its actor takes ``max_threads``
    concurrent calls). ``set_memory(mb)`` replaces each executor by one asking
    ``mb`` of memory, swapped in once it is up (the old one then retires as
    above); ``memory_usage`` reads what the executors hold. ``clock`` measures
    the executors' busy time and the readers waiting for one (``metrics``).
    """

    def __init__(self, spec: RayExecutors, *, max_threads: int = 1, bridge: int = 0) -> None:
        self.spec = spec
        self.max_threads = max_threads
        self.bridge = bridge
        self.threads = 1
        self.clock = BusyClock()
        self._lock = threading.Lock()
        # Free read slots (one entry per slot), handed out oldest request first:
        # the driver asks in plan order, and its batches wait for the oldest split.
        self._free: collections.deque[int] = collections.deque()
        self._turns: collections.deque[object] = collections.deque()  # waiting requests
        self._freed = threading.Condition(self._lock)
        self._closed = False
        self._inflight: dict[int, int] = {}
        self._retired: set[int] = set()
        self._excess: dict[int, int] = {}  # slots to drop per executor (threads lowered)
        self._starting: set[int] = set()  # added, process not up yet
        # Bridging: while an added executor starts, a running one reads one
        # more split at once in its place (starting executor -> lender).
        self._lent: dict[int, int] = {}
        self._loans: collections.Counter[int] = collections.Counter()  # lender -> slots lent
        self._handles: dict[int, Any] = {}  # every executor started and not stopped
        self.actors: dict[int, Any] = {}  # those taking splits
        self._next = 0
        self.restarts: list[dict[str, Any]] = []
        self.resizes: list[dict[str, Any]] = []
        self.memory_changes: list[dict[str, Any]] = []
        self.bridged = 0  # slots lent to bridge an added executor's start-up
        self.released: list[int] = []  # executors whose placement group was removed
        # Groups the pool reserved itself (executors past the job's E, or whose
        # group an earlier attempt gave back), by executor; removed with it.
        self.reserved: dict[int, PlacementGroup] = {}
        self.reservations = 0  # groups the pool reserved over the run
        with self._lock:
            for _ in range(spec.count):
                self._add()
        self.clock.set_slots(len(self.actors))

    @property
    def count(self) -> int:
        """Executors taking splits now."""
        with self._lock:
            return len(self.actors)

    @property
    def running(self) -> int:
        """Executor processes running now (retired ones with a split in flight too)."""
        with self._lock:
            return len(self._handles)

    @property
    def starting(self) -> int:
        """Executors added by ``resize`` that are not up yet (they take no split)."""
        with self._lock:
            return len(self._starting)

    def _add(self, *, when_up: bool = False) -> None:
        """Start an executor; its read slots open at once, or (``when_up``) once
        its process is up, so no split waits behind an executor's start."""
        executor = self._next
        self._next += 1
        handle = self._start(executor)
        self._handles[executor] = self.actors[executor] = handle
        self._inflight[executor] = 0
        if not when_up:
            self._open(executor)
            return
        self._starting.add(executor)
        self._lend(executor)
        threading.Thread(target=self._open_when_up, args=(executor, handle), daemon=True).start()

    def _lend(self, executor: int) -> None:
        """While ``executor`` starts, a running executor with fewer than
        ``bridge`` loans reads one more split at once (the fewest-loaded first),
        so the reads in flight grow at once, not after a process start-up. Lock held."""
        room = [e for e in self.actors if e not in self._starting and self._loans[e] < self.bridge]
        if not room:
            return
        lender = min(room, key=lambda e: (self._loans[e], e))
        self._loans[lender] += 1
        self._lent[executor] = lender
        self.bridged += 1
        self._open(lender, 1)

    def _repay(self, executor: int) -> None:
        """``executor`` handed on its first split (or is gone): its lender drops
        the slot it lent. Lock held."""
        lender = self._lent.pop(executor, None)
        if lender is None:
            return
        self._loans[lender] -= 1
        if lender in self.actors:  # a retired lender's slots are dropped anyway
            self._excess[lender] = self._excess.get(lender, 0) + 1

    def _open(self, executor: int, slots: int | None = None) -> None:
        """Free ``slots`` (default: ``threads``) read slots of ``executor``; lock held."""
        self._free.extend([executor] * (self.threads if slots is None else slots))
        self._freed.notify_all()

    def _open_when_up(self, executor: int, handle: Any) -> None:
        # Blocking wait: the executor's process starts. If it died, its first
        # read finds it dead and replaces it.
        with contextlib.suppress(RayActorError):
            ray.get(handle.pid.remote())
        with self._lock:
            self._starting.discard(executor)
            if executor in self._retired or executor not in self.actors:
                self._repay(executor)
                return
            # The loan is repaid once this executor hands on its first split
            # (``_give_back``), not when its process is up: a first read is a
            # cold one (files opened, the parsers' compiled code loaded), and
            # giving the lent slot back before it ends left the trainer short of
            # rows for a moment (bench/elastic.py: trainer wait 0.23-0.30 in the
            # interval right after every executor was up).
            self._open(executor)

    def _start(self, executor: int) -> Any:
        """Start ``executor``'s actor in its placement group (the job's, or one
        reserved now with the pool's current ask). Lock held."""
        res = self.spec.resources
        options: dict[str, Any] = {
            "num_cpus": res.cpus,
            "num_gpus": res.gpus,
            "name": f"{self.spec.name}-{executor}",
            # Its reads, the splits it may read for executors starting, and one
            # call more: ``memory`` is answered while they run.
            "max_concurrency": self.max_threads + self.bridge + 1,
        }
        group = self._group(executor)
        if group is None:  # the ask may have changed (a memory change): reserved as it is now
            bundle = RoleAsk("data_executor", 1, res, dict(self.spec.custom)).bundle()
            # Not waited for: the actor starts once the group is ready, as an
            # actor with no group would once its resources are free.
            group = self.reserved[executor] = placement_group(
                [bundle], strategy="STRICT_PACK", _soft_target_node_id=self.spec.near
            )
            self.reservations += 1
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0
        )
        if res.memory_mb is not None:
            options["memory"] = res.memory_mb * 2**20
        return DataExecutorActor.options(**options).remote()  # type: ignore[attr-defined]

    def _group(self, executor: int) -> PlacementGroup | None:
        """``executor``'s placement group (the job's, or one the pool reserved);
        ``None``: it has none yet (added later, or its group given back)."""
        if executor in self.reserved:
            return self.reserved[executor]
        if executor >= len(self.spec.groups) or executor in self.released:
            return None
        group: PlacementGroup | None = self.spec.groups[executor]
        return group

    def resize(self, count: int) -> None:
        """``count`` executors from now on (>= 1; see the class docstring)."""
        if count < 1:
            raise ValueError(f"a data executor pool needs >= 1 executor, got {count}")
        with self._lock:
            before = len(self.actors)
            while len(self.actors) < count:
                self._add(when_up=True)
            for executor in sorted(self.actors, reverse=True)[: max(0, len(self.actors) - count)]:
                self._retire(executor)
            self.resizes.append({"from": before, "to": count})
            self.clock.set_slots(len(self.actors) * self.threads)

    def _retire(self, executor: int) -> None:
        """No new split for ``executor``; stopped once its reads in flight end. Lock held."""
        self._retired.add(executor)
        del self.actors[executor]
        if executor not in self._starting:  # up: no first split to wait for now
            self._repay(executor)
        if self._inflight.get(executor, 0) == 0:
            self._stop(executor)

    def set_memory(self, memory_mb: int) -> None:
        """Every executor from now on asks ``memory_mb`` MiB (its budget): each
        running one is replaced by one asking that much, in a placement group
        reserved with that ask (a bundle's resources are fixed), and swapped in
        once its process is up; the old one's group is then given back."""
        if memory_mb < 1:
            raise ValueError(f"a data executor's memory ask must be >= 1 MiB, got {memory_mb}")
        with self._lock:
            before = self.spec.resources.memory_mb
            resources = dataclasses.replace(self.spec.resources, memory_mb=memory_mb)
            self.spec = dataclasses.replace(self.spec, resources=resources)
            for old in sorted(self.actors):
                executor = self._next
                self._next += 1
                handle = self._handles[executor] = self._start(executor)
                self._inflight[executor] = 0
                self._starting.add(executor)
                threading.Thread(
                    target=self._swap_when_up, args=(executor, handle, old), daemon=True
                ).start()
            self.memory_changes.append({"from_mb": before, "to_mb": memory_mb})

    def _swap_when_up(self, executor: int, handle: Any, old: int) -> None:
        # Blocking wait: the replacement's process starts (if it died, its first
        # read finds it dead and replaces it).
        with contextlib.suppress(RayActorError):
            ray.get(handle.pid.remote())
        with self._lock:
            self._starting.discard(executor)
            if self._closed:
                return
            if old not in self.actors:  # retired meanwhile (a shrink): not needed
                self._stop(executor)
                return
            self.actors[executor] = handle
            self._retire(old)
            self._open(executor)

    def memory_usage(self, timeout_s: float = 5.0) -> ExecutorMemory | None:
        """The executor that peaked highest since the last call (``None``: none
        answered within ``timeout_s``)."""
        with self._lock:
            handles = [h for e, h in self.actors.items() if e not in self._starting]
        refs = [h.memory.remote() for h in handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        seen: list[tuple[int, int]] = []
        for ref in ready:
            with contextlib.suppress(RayActorError):
                seen.append(ray.get(ref))
        if not seen:
            return None
        base, peak = max(seen, key=lambda bp: bp[1])
        budget = self.spec.resources.memory_mb
        return ExecutorMemory(base, peak, None if budget is None else budget * 2**20)

    def set_threads(self, threads: int) -> None:
        """Concurrent reads per executor, 1 .. ``max_threads``."""
        if not 1 <= threads <= self.max_threads:
            raise ValueError(f"executor threads must be in 1..{self.max_threads}, got {threads}")
        with self._lock:
            for executor in self.actors:
                if executor in self._starting:
                    continue  # its slots open once it is up, at the new count
                if threads > self.threads:
                    self._open(executor, threads - self.threads)
                else:
                    self._excess[executor] = self._excess.get(executor, 0) + self.threads - threads
            self.threads = threads
            self.clock.set_slots(len(self.actors) * threads)

    def _take(self) -> int:
        """A free slot of a live executor, oldest request first (``Blocking
        wait``: until one frees and every older request has one)."""
        turn = object()
        with self._lock:
            self._turns.append(turn)
            self.clock.waiting += 1
            try:
                while True:
                    while not (self._closed or (self._free and self._turns[0] is turn)):
                        self._freed.wait()  # Blocking wait: a free slot, our turn
                    if self._closed:
                        raise PoolClosed("the data executor pool was closed")
                    executor = self._free.popleft()
                    if executor in self._retired:
                        continue  # a retired executor's slot: dropped
                    if self._excess.get(executor, 0) > 0:
                        self._excess[executor] -= 1
                        continue
                    self._inflight[executor] += 1
                    return executor
            finally:
                self._turns.remove(turn)
                self.clock.waiting -= 1
                self._freed.notify_all()  # the next request's turn

    def _give_back(self, executor: int) -> None:
        with self._lock:
            self._inflight[executor] -= 1
            self._repay(executor)  # its first split is handed on: the bridge's loan ends
            if executor in self._retired:
                if self._inflight[executor] == 0:
                    self._stop(executor)
                return
            self._open(executor, 1)

    def _stop(self, executor: int) -> None:
        """Stop ``executor`` for good (retired or replaced) and give its
        placement group back: no later executor takes it. Lock held."""
        handle = self._handles.pop(executor, None)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        group = self._group(executor)
        if group is not None:
            remove_placement_group(group)  # asynchronous: Ray frees the bundle
            self.reserved.pop(executor, None)
            self.released.append(executor)

    def read(self, reader: SplitReader) -> tuple[list[Any], int, int]:
        """The split's ``RemoteBlock``s (payloads: object-store references, not
        fetched here; ``Block``s unless ``direct``), its good rows and last row."""
        executor = self._take()
        token = self.clock.start()
        cpu_s: float | None = None
        try:
            while True:
                actor = self._handles[executor]
                try:
                    call = actor.read.options(num_returns="streaming").remote(reader)
                    refs = list(call)  # Blocking wait: the executor reads the whole split.
                    # Blocking wait: the accounting only (small); the rows stay put.
                    metas = ray.get(refs[1:-1:2])
                    good, last, cpu_s = ray.get(refs[-1])
                except RayActorError as exc:
                    self._replace(executor, exc, reader)
                    continue
                payloads = refs[0:-1:2]
                if not self.spec.direct:  # Blocking wait: every row comes here
                    rows = ray.get(payloads)
                    return [m.with_rows(r) for m, r in zip(metas, rows, strict=True)], good, last
                blocks = [
                    dataclasses.replace(meta, payload=ref)
                    for meta, ref in zip(metas, payloads, strict=True)
                ]
                return blocks, good, last
        finally:
            self.clock.stop(token, cpu_s)
            self._give_back(executor)

    def _replace(self, executor: int, exc: RayActorError, reader: SplitReader) -> None:
        with self._lock:
            if self._closed:
                raise PoolClosed("the data executor pool was closed") from exc
            if len(self.restarts) >= self.spec.max_restarts:
                raise DataExecutorLost(
                    f"data executor {executor} died reading split {reader.split.name} "
                    f"({_first_line(exc)}) after {len(self.restarts)} restart(s); "
                    f"runtime.max_restarts is {self.spec.max_restarts}"
                ) from exc
            self.restarts.append({"executor": executor, "split": reader.split.name})
            ray.kill(self._handles[executor], no_restart=True)
            self._handles[executor] = self._start(executor)
            if executor in self.actors:
                self.actors[executor] = self._handles[executor]

    def scaled(
        self, job: JobSpec, steps: Iterator[_T], rows_of: Callable[[_T], int]
    ) -> Iterator[_T]:
        """``steps`` (rank 0's) with the scaling manager resizing this pool
        while they last (``runtime.scaling``; ``estuary.train.feeds.ScaledPool``)."""
        from estuary.runtime.scaling.pool import scaled_steps  # only where scaling is on

        return scaled_steps(job, self, steps, rows_of)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "data_executors": self.spec.count,
            "data_executor_restarts": len(self.restarts),
            "data_executor_restart_log": list(self.restarts),
        }
        if self.resizes:
            out["data_executor_resizes"] = list(self.resizes)
        if self.memory_changes:
            out["data_executor_memory_changes"] = list(self.memory_changes)
        if self.bridged:
            out["data_executor_bridged_starts"] = self.bridged
        if self.released:
            out["data_executor_groups_released"] = len(self.released)
        if self.reservations:
            out["data_executor_groups_reserved"] = self.reservations
        return out

    def close(self) -> None:
        """Stop every executor; reads waiting for one raise ``PoolClosed``. The
        job's placement groups still held stay (a next attempt's executors take
        them; the runtime removes them when the job ends); those the pool
        reserved itself are removed."""
        with self._lock:
            self._closed = True
            self._freed.notify_all()
            handles = list(self._handles.values())
            self._handles.clear()
            # Executors still starting are stopped with the rest: nothing is lent.
            self._starting.clear()
            self._lent.clear()
            self._loans.clear()
            groups, self.reserved = list(self.reserved.values()), {}
        for actor in handles:
            try:
                ray.kill(actor, no_restart=True)
            except ValueError:  # not an actor handle any more
                continue
        for group in groups:
            remove_placement_group(group)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
