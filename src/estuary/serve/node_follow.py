"""``SharedFollower``: a Ray Serve replica follows a run through its node's one
preparer (``estuary.serve.node_preparer``), not a preparing child of its own.

It subscribes to the node's ``NodePreparer`` actor (creating it if it is the
first replica of the node), and on a thread of its own asks it for the next
version, serves it from the shared slot file (mapped once, as
``ProcessFollower`` maps its child's: the same ``_apply``) and answers
``served`` or ``skipped`` with its next call. Versions are named, dense networks
swapped, updates and failures counted as ``ProcessFollower`` does; ``behind_s``
is watched the same way.

Failures: a preparing error is reported (``on_failure``); a replica dropped by
the preparer (it answered too late, or skipped a version its peers serve) is
reported, counted (``restarts["dropped"]``) and joins again, getting the
version its peers serve; a preparer that died (its node's actor gone) is
reported, counted (``restarts["exited"]``), its folder removed (a preparer
killed could not) and looked up again (the first replica to do so makes a new
one, which writes new files).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from estuary.serve.model import ServingModel
from estuary.serve.node_preparer import node_preparer
from estuary.serve.process_follow import ProcessFollower

__all__ = ["SharedFollower"]

logger = logging.getLogger(__name__)


class SharedFollower(ProcessFollower):
    """Serves ``run_dir``'s new checkpoints on ``model``, prepared by the node's
    ``NodePreparer`` (module docstring). Arguments as ``ProcessFollower``'s, and:

    Args:
        app: the application's name (one preparer per application, run and node).
        wait_s: the longest one call waits for the next version (a sign of life
            to the preparer at least this often; keep it below ``progress_timeout_s``).
    """

    def __init__(
        self,
        run_dir: Path,
        model: ServingModel,
        served: Path,
        *,
        app: str = "estuary",
        wait_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(run_dir, model, served, **kwargs)
        self.app = app
        self.wait_s = wait_s if wait_s is not None else min(1.0, self.progress_timeout_s / 4)
        self.sid = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.restarts["dropped"] = 0
        self._actor: Any = None
        self._folder: Path | None = None  # the preparer's folder (of the files offered)

    def start(self) -> SharedFollower:
        """Subscribe and follow on a daemon thread until ``stop``; a second thread
        watches how far behind the served version is."""
        self._start_threads()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Unsubscribe (the preparer ends with its last subscriber) and end the threads."""
        self._stop.set()
        actor = self._actor
        if actor is not None:
            import ray

            try:
                ray.get(actor.leave.remote(self.sid), timeout=timeout_s)
            except Exception as exc:  # the actor gone already: nothing to leave
                logger.debug("follow %s: leave: %s", self.run_dir, exc)
        super().stop(timeout_s)

    def _subscribe(self) -> Any:
        """The node's preparer, subscribed to (retried while one is ending)."""
        while not self._stop.is_set():
            actor = node_preparer(
                self.app, self.run_dir, self.served, self.poll_s, self.progress_timeout_s
            )
            import ray

            if ray.get(actor.join.remote(self.sid, os.getpid())):  # Blocking: the actor's answer
                self._actor = actor
                self.children_started += 1
                self._ready = True
                return actor
            self._stop.wait(self.poll_s)  # it is ending: its name is freed soon
        return None

    def _run(self) -> None:
        import ray

        delay = self.restart_s
        while not self._stop.is_set():
            try:
                actor = self._subscribe()
                if actor is None or self._follow_actor(actor) is None:
                    return  # stopped
                reason = "dropped"
                error = RuntimeError(
                    f"dropped by the node's preparer (no answer in {self.progress_timeout_s:g} "
                    f"s, or a version skipped); joining again (serving {self.model.version})"
                )
            except ray.exceptions.RayActorError as exc:
                reason = "exited"
                error = RuntimeError(f"the node's preparer ended: {exc}")
                self._reader.forget()  # a new preparer writes new files
                # A preparer killed leaves its files (our views of them live on).
                if self._folder is not None:
                    shutil.rmtree(self._folder, ignore_errors=True)
                    self._folder = None
            if self._stop.is_set():
                return
            self.restarts[reason] += 1
            logger.warning("follow %s: %s", self.run_dir, error)
            self._failed(error)
            if self.on_restart is not None:
                self.on_restart(reason)
            if reason == "exited":
                self._stop.wait(delay)  # Blocking wait: before looking the preparer up again
                delay = min(2 * delay, self.max_restart_s)

    def _follow_actor(self, actor: Any) -> str | None:
        """Apply what the preparer offers until dropped (``"dropped"``) or
        stopped (``None``)."""
        import ray

        answer: tuple[int, bool] | None = None
        while not self._stop.is_set():
            # Blocking: waits up to wait_s in the actor for the next version.
            message = ray.get(actor.next.remote(self.sid, answer, self.wait_s))
            self._progress_at = time.monotonic()
            answer = None
            if message is None:
                continue
            if message.get("dropped"):
                return "dropped"
            if "error" in message:
                self._failed(RuntimeError(message["error"]))
                continue
            self._offered = str(message.get("checkpoint"))
            self._folder = Path(message["file"]).parent
            try:
                self._apply(message)
                answer = (int(message["seq"]), True)
            except Exception as exc:  # reported; serving goes on with the version held
                logger.warning("follow %s: not applied: %s", self.run_dir, exc)
                self._failed(exc)
                answer = (int(message["seq"]), False)
        return None
