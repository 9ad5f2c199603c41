"""``Follower``: a server follows a training run's checkpoints while it serves.

Every ``poll_s`` it reads the run's ``checkpoints/latest``; a new checkpoint is
applied by a decision of ``plan_update`` (a policy; the follower acts on it):

- ``DELTA``: the new checkpoint's chain holds the one being served, so the
  deltas after it (``read_link``: each one's changed rows only) are applied to
  the live tables in order, in one atomic update; the dense network is swapped
  in the same update when ``dense_every_s`` has passed since the last swap
  (``0``: with every checkpoint), else it stays;
- ``FULL``: anything else (a new full checkpoint, a chain the served one is not
  part of, a link pruned before it was read): the whole checkpoint is loaded
  into new tables off to the side, then swapped in at once (``adopt``);
- ``NONE``: nothing new.

A delta that does not apply on the served tables (their version is not its
base) is not retried: the checkpoint is reloaded whole at once.

Requests never wait for a file read: files are read and the new network built
before the model's lock is taken; inside it, only delta rows are written and
references swapped (see ``estuary.serve.model``). A checkpoint that fails to
load is counted (``estuary_serve_update_failures``), logged, and retried at the
next poll; the served version stays as it was.

The version served is ``<job>@<checkpoint>`` when the dense network is the
checkpoint's own, else ``<job>@<checkpoint>+dense@<its checkpoint>``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from estuary.serve.checkpoints import model_from_checkpoint, serving_key, serving_rows
from estuary.serve.link_reader import read_link
from estuary.serve.model import ServingModel
from estuary.train.checkpoint import load_checkpoint
from estuary.train.checkpoint_chain import (
    MANIFEST,
    CheckpointError,
    chain_of,
    read_manifest,
    resolve_checkpoint,
)

__all__ = ["Follower", "UpdateDecision", "UpdateKind", "plan_update"]

logger = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""Nice value of the follower thread: reading and verifying checkpoint files
competes less with request handling on a busy machine. A trade-off, measured
both ways (docs/serving.md): on an overloaded machine the thread is preempted
while it holds the GIL and requests wait for it (a delta took 280-530 ms of wall
time against 80-110 ms at nice 0); on a less loaded one, at nice 0 it takes the
CPU from requests (bench p99 ratio 1.16-1.36 at nice 0, 1.05 at nice 10)."""


class UpdateKind(StrEnum):
    """How a new checkpoint reaches the served model."""

    NONE = "none"
    DELTA = "delta"
    FULL = "full"


@dataclass(frozen=True)
class UpdateDecision:
    """What to apply for the newest checkpoint.

    Args:
        kind: see ``UpdateKind``.
        links: ``DELTA``: the checkpoint folder names to apply, oldest first.
        dense: ``DELTA``: also swap in the newest link's dense network.
    """

    kind: UpdateKind
    links: list[str] = field(default_factory=list)
    dense: bool = False


def plan_update(served: str, latest: str, chain: list[str], dense_due: bool) -> UpdateDecision:
    """The decision for checkpoint ``latest`` (whose chain, full first, is
    ``chain``) while ``served`` is served; ``dense_due``: a dense swap is due."""
    if latest == served:
        return UpdateDecision(UpdateKind.NONE)
    if served in chain[:-1]:
        links = chain[chain.index(served) + 1 :]
        return UpdateDecision(UpdateKind.DELTA, links, dense=dense_due)
    return UpdateDecision(UpdateKind.FULL)


class Follower:
    """Applies a run's new checkpoints to ``model`` (see module docstring).

    Args:
        run_dir: the run's output folder (or its ``checkpoints`` folder).
        model: the model being served, loaded from ``served``.
        served: the checkpoint folder ``model`` holds.
        poll_s: seconds between looks at ``latest``.
        dense_every_s: the least seconds between dense swaps (``0``: every checkpoint).
        on_update: called after each applied update with its kind and the
            seconds from the checkpoint's commit to its being served.
        on_failure: called with the error when a checkpoint could not be applied.
        standby: a full reload keeps a standby copy of the tables, as ``model``
            should (``model_from_checkpoint(..., standby=True)``), so deltas are
            written off the request path.
    """

    def __init__(
        self,
        run_dir: Path,
        model: ServingModel,
        served: Path,
        *,
        poll_s: float = 0.1,
        dense_every_s: float = 0.0,
        on_update: Callable[[UpdateKind, float], None] | None = None,
        on_failure: Callable[[Exception], None] | None = None,
        standby: bool = True,
    ) -> None:
        self.run_dir = run_dir
        self.model = model
        self.served = served
        self.dense_from = served.name
        self.job_name = model.job.name
        self.standby = standby
        self.poll_s = poll_s
        self.dense_every_s = dense_every_s
        self.on_update = on_update
        self.on_failure = on_failure
        self._dense_at = time.monotonic()
        self.last_cpu_s = 0.0  # this thread's CPU time for the newest update
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Follower:
        """Poll on a daemon thread until ``stop``."""
        self._thread = threading.Thread(target=self._run, name="estuary-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; waits for an update in progress (Blocking wait: join)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        # Updates yield the CPU to requests: this thread runs at a lower priority
        # (Linux sets a nice value per thread; elsewhere this is skipped).
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except (CheckpointError, OSError) as exc:
                logger.warning("follow %s: not applied (retrying): %s", self.run_dir, exc)
                if self.on_failure is not None:
                    self.on_failure(exc)

    def poll(self) -> UpdateKind:
        """Apply the newest checkpoint if it is new; returns what was done.

        Raises:
            CheckpointError: the checkpoint does not load (the served model is unchanged).
        """
        latest = resolve_checkpoint(self.run_dir)
        if latest.name == self.served.name:  # nothing new: no manifest parsed
            return UpdateKind.NONE
        cpu = time.thread_time()
        manifest = read_manifest(latest)
        dense_due = time.monotonic() - self._dense_at >= self.dense_every_s
        decision = plan_update(self.served.name, latest.name, chain_of(latest, manifest), dense_due)
        if decision.kind is UpdateKind.DELTA:
            # Each file read once, only what lookups read parsed, as views of the
            # bytes read (read_link: the GIL is held briefly; requests run meanwhile).
            links = [
                read_link(
                    latest.parent / name,
                    manifest if name == latest.name else None,
                    table_keys=serving_key,
                )
                for name in decision.links
            ]
            model = self.model.new_dense(links[-1].dense) if decision.dense else None
            dense_from = latest.name if model is not None else self.dense_from
            # Applied in order, in one update; only what lookups read.
            deltas = [{n: serving_rows(s) for n, s in link.tables.items()} for link in links]
            version = self._version(latest.name, dense_from)
            try:
                self.model.update(version, deltas=deltas, model=model)
            except ValueError as exc:  # tables not at the delta's base: start over
                logger.warning("follow %s: %s; reloading %s whole", self.run_dir, exc, latest)
                decision = UpdateDecision(UpdateKind.FULL)
            else:
                if model is not None:
                    self.dense_from, self._dense_at = latest.name, time.monotonic()
        if decision.kind is UpdateKind.FULL:
            fresh = model_from_checkpoint(load_checkpoint(latest), standby=self.standby)
            self.dense_from = latest.name
            self._dense_at = time.monotonic()
            self.model.adopt(fresh)
        elif decision.kind is UpdateKind.NONE:
            return decision.kind
        self.served = latest
        self.last_cpu_s = time.thread_time() - cpu
        if self.on_update is not None:
            committed = (latest / MANIFEST).stat().st_mtime
            self.on_update(decision.kind, time.time() - committed)
        return decision.kind

    def _version(self, tables_from: str, dense_from: str) -> str:
        if dense_from == tables_from:
            return f"{self.job_name}@{tables_from}"
        return f"{self.job_name}@{tables_from}+dense@{dense_from}"
