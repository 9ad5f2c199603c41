"""``NodePreparer``: one preparer per node for the Ray Serve replicas following a run.

With ``--ray --replicas N --follow RUN``, a replica that started its own
preparing child (``ProcessFollower``) would make N children on a node, each
reading and verifying every checkpoint, and N x 2 slot files each holding the
whole embedding tables in ``/dev/shm``. Instead the replicas of a node share
one preparer: a named Ray actor per (application, run, node), created by the
first replica of the node (``get_if_exists``; placed on that node by a hard
node-affinity strategy; detached, so it outlives the replica that made it),
that runs ``Preparer`` and ``SlotWriter`` on a thread of its own process
(niced, as the child process is) and hands each version to every replica of the
node through the same two slot files, which each replica maps.

Protocol (calls on the actor, each replica on its own thread, ``SharedFollower``):

- ``join(sid, pid)``: subscribe (again); ``False`` while the actor is ending.
  ``pid`` (the replica's process, on this node) lets the actor drop a replica
  that died at once, not after ``timeout_s``.
- ``next(sid, answer, wait_s)``: answer the last offer (``(seq, served)`` or
  ``None``) and wait up to ``wait_s`` for what comes next: an offer (the
  message of ``prepare_process``'s protocol plus ``seq``), ``{"error": ...}``
  when the newest checkpoint does not load (each error once per subscriber),
  ``{"dropped": true}`` when the subscriber was dropped (it joins again), or
  ``None``. A call is a sign of life.
- ``leave(sid)``: unsubscribe (a replica stopping).

Which slot is written when, and who is dropped, is ``Subscribers``' decision.
Lifetime: the actor ends, removing its files, once it has had subscribers and
has none left (the last one left or was dropped: a deleted application's
replicas stop calling and are dropped after ``timeout_s``), or when no
replica joins within ``timeout_s`` of its start.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from estuary.serve.follow import UpdateKind
from estuary.serve.prepare_process import NICE, version_message
from estuary.serve.preparer import Prepared, Preparer
from estuary.serve.process_follow import handoff_dir
from estuary.serve.slots import SlotWriter
from estuary.serve.subscribers import Subscribers
from estuary.train.checkpoint_chain import CheckpointError

__all__ = ["NAMESPACE", "NodePreparer", "actor_name", "node_preparer"]

logger = logging.getLogger(__name__)

NAMESPACE = "estuary"
"""The Ray namespace of the preparers (replicas run in Ray Serve's own)."""


def actor_name(app: str, run_dir: Path, node_id: str) -> str:
    """The preparer's name: one per application, run folder and node."""
    run = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return f"estuary-preparer:{app}:{run}:{node_id}"


class NodePreparer:
    """Prepares ``run_dir``'s new checkpoints once for the subscribers of a node
    (module docstring); a Ray actor (``node_preparer`` makes it one).

    Args:
        run_dir: the run's output folder.
        start: the checkpoint folder the first subscriber serves, or ``None``. It
            is written into a slot first and offered as the first version (marked
            ``initial``: not an update), so the replicas serve the node's one
            copy from then on, not each the copy it loaded at its start.
        poll_s: seconds between looks at the run's ``latest``.
        timeout_s: a subscriber that does not answer an offer, or calls nothing,
            for this long is dropped.
    """

    def __init__(self, run_dir: str, start: str | None, poll_s: float, timeout_s: float) -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.nice(NICE)  # yields the CPU to the replicas, as the child process does
        import torch

        torch.set_num_threads(1)
        self.run_dir = Path(run_dir)
        self.poll_s = poll_s
        self.folder = handoff_dir()
        self.subs = Subscribers(timeout_s)
        self.cpu_s: list[float] = []  # this process's CPU time per version written
        self._preparer = Preparer(self.run_dir)
        self._slots = SlotWriter(self.folder)
        self._start: Prepared | None = None
        if start is not None:
            with contextlib.suppress(CheckpointError, OSError):  # else: the next one whole
                self._start = self._preparer.load(Path(start))
        self._lock = threading.Condition()
        self._errors: list[str] = []
        self._seen_errors: dict[str, int] = {}
        # Each subscriber's process: its pid and start time (``_birth``).
        self._procs: dict[str, tuple[int, str | None]] = {}
        self.drops: collections.Counter[str] = collections.Counter()  # by reason
        self._ending = False
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="estuary-prepare", daemon=True)
        self._thread.start()

    def join(self, sid: str, pid: int) -> bool:
        """``sid`` (a replica, process ``pid``) subscribes; ``False``: the actor is
        ending (look it up again)."""
        with self._lock:
            if self._ending:
                return False
            self.subs.join(sid)
            self._procs[sid] = (pid, _birth(pid))
            self._seen_errors[sid] = len(self._errors)
            self._lock.notify_all()
            return True

    def leave(self, sid: str) -> None:
        """``sid`` unsubscribes."""
        with self._lock:
            self.subs.leave(sid)
            self._procs.pop(sid, None)
            self._lock.notify_all()

    def next(
        self, sid: str, answer: tuple[int, bool] | None, wait_s: float
    ) -> dict[str, Any] | None:
        """Answer the last offer, then the next thing for ``sid`` (module docstring)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            if answer is not None and not self.subs.answer(sid, *answer):
                return {"dropped": True}
            self._lock.notify_all()
            while True:
                if sid not in self.subs:
                    return {"dropped": True}
                seen = self._seen_errors.get(sid, 0)
                if seen < len(self._errors):
                    self._seen_errors[sid] = seen + 1
                    return {"error": self._errors[seen]}
                offer = self.subs.offer_for(sid)
                if offer is not None:
                    return {**offer.message, "seq": offer.seq}
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)  # Blocking wait: an offer, an error, or wait_s

    def state(self) -> dict[str, Any]:
        """What the tests and operators look at: the folder, its files, this
        process, the subscribers (pid and slot read), versions written, drops."""
        with self._lock:
            current = self.subs.current
            return {
                "folder": str(self.folder),
                "files": sorted(p.name for p in self.folder.glob("*")),
                "pid": os.getpid(),
                "subscribers": {
                    sid: {"pid": self._procs.get(sid, (None,))[0], "slot": slot}
                    for sid, slot in self.subs.slots_read().items()
                },
                "current": None if current is None else current.message,
                "current_slot": None if current is None else current.slot,
                "writes": self._slots.writes,
                "dropped": self.subs.dropped_total,
                "drops": dict(self.drops),
                "cpu_s": list(self.cpu_s),
            }

    def _run(self) -> None:
        try:
            start, self._start = self._start, None
            if start is None or self._write(start, time.process_time(), initial=True):
                while self._step():
                    pass
        except Exception:  # the replicas see the actor gone, report it and make a new one
            logger.exception("preparer of %s: failed, ending", self.run_dir)
        finally:
            self._slots.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            logger.info("preparer of %s: no subscribers left, ending", self.run_dir)
            os._exit(0)  # the actor ends with its thread (a detached actor: nobody else ends it)

    def _step(self) -> bool:
        """Wait until a slot may be written, prepare the newest checkpoint and offer
        it; ``False`` when the actor should end."""
        with self._lock:
            if not self._settle():
                return False
            self._lock.wait(self.poll_s)  # Blocking wait: the poll interval (a leave wakes it)
            if self._should_end():
                self._ending = True
                return False
        cpu = time.process_time()
        try:
            prepared = self._preparer.step()
        except (CheckpointError, OSError) as exc:
            logger.warning("prepare %s: not prepared (retrying): %s", self.run_dir, exc)
            with self._lock:
                self._errors.append(str(exc))
                self._lock.notify_all()
            return True
        if prepared is None:
            return True
        return self._write(prepared, cpu)

    def _write(self, prepared: Prepared, cpu: float, *, initial: bool = False) -> bool:
        """Write ``prepared`` into a slot no live subscriber reads and offer it
        (``initial``: the version the replicas serve already, handed over);
        ``False`` when the actor should end."""
        with self._lock:
            if not self._settle():  # one joined meanwhile: it answers its version first
                return False
            choice = self.subs.free_slot(self._slots_next())
            self._drop(choice.dropped, "slot")
            if choice.slot != self._slots_next():
                self._slots.served()  # the writer's turn moves to the free slot
        try:
            if prepared.kind is UpdateKind.DELTA:
                path, size = self._slots.write_deltas(prepared.links, prepared.dense)
            else:
                path, size = self._slots.write_whole(prepared.tables, prepared.dense)
        except Exception:
            with self._lock:
                self.subs.abandon()
            raise
        message = version_message(
            prepared, path, size, time.process_time() - cpu, self._slots.last_whole
        )
        message["initial"] = initial
        with self._lock:
            self.subs.offer(choice.slot, message)
            self.cpu_s.append(float(message["cpu_s"]))
            self._lock.notify_all()
        return True

    def _settle(self) -> bool:
        """Under the lock: wait until no live subscriber owes an answer (dropping
        those past their deadline); ``False`` when the actor should end."""
        while True:
            self._drop(self.subs.drop(self._exited()), "exited")
            self._drop(self.subs.expire(), "timeout")
            if self._should_end():
                self._ending = True
                return False
            if self.subs.settled():
                return True
            self._lock.wait(min(self.poll_s, self.subs.timeout_s / 4))  # Blocking wait

    def _slots_next(self) -> int:
        return int(self._slots.next_slot)

    def _exited(self) -> list[str]:
        """The subscribers whose process is gone (a replica killed or crashed):
        they read no slot, so they need not hold a write for ``timeout_s``. The
        replicas are on this node (the actor is placed on theirs), so their pids
        are this node's; a pid reused by a new process has another start time."""
        return [
            sid
            for sid, (pid, born) in self._procs.items()
            if pid > 0 and sid in self.subs and _birth(pid) != born
        ]

    def _drop(self, gone: list[str], reason: str) -> None:
        """Log and count the subscribers ``gone``, dropped for ``reason``: ``exited``
        (its process is gone), ``timeout`` (no answer or call within the
        deadline) or ``slot`` (it reads the slot the next version needs)."""
        why = {
            "exited": "its process is gone",
            "timeout": f"no answer or call in {self.subs.timeout_s:g} s",
            "slot": "it reads the slot the next version is written into",
        }[reason]
        for sid in gone:
            self.drops[reason] += 1
            logger.warning(
                "preparer of %s: subscriber %s (pid %s) dropped: %s",
                self.run_dir,
                sid,
                self._procs.pop(sid, (None,))[0],
                why,
            )

    def _should_end(self) -> bool:
        if len(self.subs):
            return False
        if self.subs.joined_total:
            return True  # it had subscribers and has none left
        return time.monotonic() - self._started > self.subs.timeout_s


def _birth(pid: int) -> str | None:
    """Process ``pid``'s start time (``/proc/PID/stat`` field 22, clock ticks since
    boot), ``None`` when there is no such process (or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def node_preparer(
    app: str, run_dir: Path, start: Path | None, poll_s: float, timeout_s: float
) -> Any:
    """The handle of this node's preparer for ``app`` and ``run_dir``, created if
    there is none (on this node: hard node affinity; detached; 0 CPUs, as it
    mostly waits and its work is niced). Call inside a Ray worker or driver."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    actor = ray.remote(NodePreparer).options(
        name=actor_name(app, run_dir, node_id),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=64,  # each subscriber's ``next`` waits on a thread of its own
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    )
    return actor.remote(str(run_dir), None if start is None else str(start), poll_s, timeout_s)
