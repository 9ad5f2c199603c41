"""``ProcessFollower``: a server follows a run, the updates prepared in a child process.

The in-process ``Follower`` reads, verifies and writes each delta on a thread
of the serving process: CPU time under the GIL that the event loop and the
prediction thread wait for. Here a child process
(``python -m estuary.serve.prepare_process``) does all of that and hands over
each new version whole, in one of two files of a memory-backed folder that it
writes in turn; the serving process maps each file once, views a version's
arrays in it (``SlotReader``), points its ``LiveTable``s at them and, when due,
refills its spare dense network: per update about a millisecond of its own CPU
(``last_cpu_s``, exported as ``estuary_serve_update_cpu_seconds``) instead of
tens (docs/serving.md).

Lifetime: the child reads its stdin; the server closes it on ``stop``, and the
kernel closes it when the server dies in any way, so the child never outlives
the server. A child that exits on its own (crashed, killed) is reported
(``on_failure``, a ``RuntimeError`` naming its exit status), and a new one is
started after ``restart_s`` (doubling up to ``max_restart_s`` while children
keep failing); requests are served meanwhile from the version held. A child
that hangs without exiting is caught by a progress deadline: while the run's
``latest`` names a checkpoint that is neither served nor offered by the child,
the child must send something (a version, an error) within
``progress_timeout_s`` (``start_timeout_s`` until it says it is ready), or it is
killed and replaced as above (``restarts["hung"]``). ``behind_s`` says how long
the version served has been behind the run's newest checkpoint. Versions
are named and dense networks swapped as the in-process follower does
(``<job>@<checkpoint>[+dense@<checkpoint>]``, ``dense_every_s``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from estuary.serve.checkpoints import job_in_manifest
from estuary.serve.follow import UpdateKind
from estuary.serve.frozen_table import FrozenTable
from estuary.serve.live_table import LiveTable
from estuary.serve.model import ServingModel
from estuary.serve.pipeline import FeaturePipeline
from estuary.serve.preparer import Prepared
from estuary.serve.slot_table import SlotTable, warm_up
from estuary.serve.slots import SlotReader
from estuary.train.checkpoint_chain import CheckpointError, resolve_checkpoint
from estuary.train.plan import TrainPlan

__all__ = ["ProcessFollower", "handoff_dir", "model_from_prepared"]

logger = logging.getLogger(__name__)


def handoff_dir() -> Path:
    """A new folder for handoff files: in ``/dev/shm`` (memory) when it exists."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shm.stat().st_mode & 0o002 else None
    return Path(tempfile.mkdtemp(prefix="estuary-serve-", dir=base))


def model_from_prepared(prepared: Prepared) -> ServingModel:
    """A ``ServingModel`` over ``LiveTable``s holding ``prepared``'s tables and dense
    network, its version ``<job>@<checkpoint>``.

    Raises:
        CheckpointError: no job in the manifest, or the dense network does not fit it.
    """
    job = job_in_manifest(prepared.manifest, prepared.checkpoint)
    pipeline = FeaturePipeline.from_job(job)
    plan = TrainPlan.from_job(job, pipeline.decoder.features)
    shards = {name: spec.shards for name, spec in plan.tables.items()}
    tables = {
        name: LiveTable(
            FrozenTable.from_sorted(name, t.ids, t.weights, t.unknown, shards.get(name, 1))
        )
        for name, t in prepared.tables.items()
    }
    model = ServingModel(job, pipeline, f"{job.name}@{prepared.checkpoint.name}", tables=tables)
    warm_up()  # the lookups of the versions to come, compiled before serving
    try:
        model.dense_model.load_state_dict(prepared.dense)
    except RuntimeError as exc:
        raise CheckpointError(f"{prepared.checkpoint / 'dense.safetensors'}: {exc}") from exc
    return model


class ProcessFollower:
    """Serves ``run_dir``'s new checkpoints on ``model`` (built by
    ``model_from_prepared``), prepared in a child process (module docstring).

    Args:
        run_dir: the run's output folder (or its ``checkpoints`` folder).
        model: the model being served, over ``LiveTable``s, holding ``served``.
        served: the checkpoint folder ``model`` holds.
        poll_s: seconds between the child's looks at ``latest``.
        dense_every_s: the least seconds between dense swaps (``0``: every checkpoint).
        on_update: called after each update with its kind and the seconds from the
            checkpoint's commit to its being served.
        on_failure: called with the error when a checkpoint could not be prepared
            or applied, or the child exited.
        restart_s: seconds before a new child replaces one that exited (doubled
            while they keep exiting, up to ``max_restart_s``).
        progress_timeout_s: a child that sends nothing for this long while a
            checkpoint is pending is killed and replaced (a hung child).
        start_timeout_s: the same deadline until a new child is ready (imports
            and the served checkpoint prepared).
        on_restart: called with ``"exited"`` or ``"hung"`` when a child is replaced.
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
        restart_s: float = 1.0,
        max_restart_s: float = 30.0,
        progress_timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.model = model
        self.served = served
        self.dense_from = served.name
        self.job_name = model.job.name
        self.poll_s = poll_s
        self.dense_every_s = dense_every_s
        self.on_update = on_update
        self.on_failure = on_failure
        self.restart_s = restart_s
        self.max_restart_s = max_restart_s
        self.last_cpu_s = 0.0  # this process's CPU time for the newest update
        self.last_prepare_cpu_s = 0.0  # the child's CPU time for it
        self.progress_timeout_s = progress_timeout_s
        self.start_timeout_s = start_timeout_s
        self.on_restart = on_restart
        self.children_started = 0
        self.restarts = {"exited": 0, "hung": 0}  # children replaced, by why
        self.slot_writes = {"whole": 0, "deltas": 0}  # versions applied, by how written
        self._progress_at = time.monotonic()  # the child's last message (or start)
        self._ready = False  # the child has said it is ready
        self._offered: str | None = None  # the checkpoint of its last version
        self._behind_since: float | None = None
        self._hung: int | None = None  # the pid of a child killed as hung
        self._shards = {name: spec.shards for name, spec in model.plan.tables.items()}
        self._dense_at = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _child between the thread and stop()
        self._child: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._dir: Path | None = None
        self._reader = SlotReader()

    @property
    def child_pid(self) -> int | None:
        """The process id of the child now running (``None``: none)."""
        child = self._child
        return child.pid if child is not None and child.poll() is None else None

    @property
    def behind_s(self) -> float:
        """Seconds since the run's ``latest`` first named a checkpoint newer than the
        one served (0 when it is served; checked every ``check_s``)."""
        since = self._behind_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def check_s(self) -> float:
        """How often the watchdog reads ``latest``."""
        return min(0.5, max(0.02, self.progress_timeout_s / 4))

    def start(self) -> ProcessFollower:
        """Start the child and follow on a daemon thread until ``stop``; a second
        thread watches the child's progress."""
        self._dir = handoff_dir()
        self._start_threads()
        return self

    def _start_threads(self) -> None:
        """The following thread (``_run``) and the watchdog (``_watch``), daemons."""
        self._thread = threading.Thread(target=self._run, name="estuary-follow", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="estuary-watch", daemon=True)
        self._watchdog.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the child (its stdin closed; killed if it has not exited after
        ``timeout_s``), the thread, and the handoff folder."""
        self._stop.set()
        with self._lock:
            child = self._child
        if child is not None:
            _end(child, timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)  # Blocking wait: the follower thread ends
        if self._watchdog is not None:
            self._watchdog.join(timeout_s)  # Blocking wait: it wakes every check_s
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _spawn(self) -> subprocess.Popen[bytes]:
        assert self._dir is not None
        cmd = [sys.executable, "-m", "estuary.serve.prepare_process", str(self.run_dir)]
        cmd += [str(self._dir), "--from", str(self.served), "--poll-s", str(self.poll_s)]
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.children_started += 1
        self._ready, self._offered = False, None
        self._progress_at = time.monotonic()
        return child

    def _watch(self) -> None:
        """Every ``check_s``: is a checkpoint pending, and has the child made
        progress? A child silent past its deadline is killed (``_run`` replaces it)."""
        while not self._stop.wait(self.check_s):
            try:
                latest: str | None = resolve_checkpoint(self.run_dir).name
            except (CheckpointError, OSError):
                latest = None
            now = time.monotonic()
            if latest is None or latest == self.served.name:
                self._behind_since = None
                continue
            if self._behind_since is None:
                self._behind_since = now
            child = self._child
            if latest == self._offered or child is None or child.poll() is not None:
                continue  # offered (and not taken), or no child running
            limit = self.progress_timeout_s if self._ready else self.start_timeout_s
            silent = now - max(self._progress_at, self._behind_since)
            if silent > limit:
                logger.warning(
                    "follow %s: the preparing process %d sent nothing for %.1f s with %s "
                    "pending; killing it",
                    self.run_dir,
                    child.pid,
                    silent,
                    latest,
                )
                self._hung = child.pid
                child.kill()  # its pipe ends: _run reports and replaces it

    def _run(self) -> None:
        delay = self.restart_s
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    return
                child = self._child = self._spawn()
            applied = self._follow(child)
            if self._stop.is_set():
                return
            status = child.wait()  # Blocking wait: its pipe ended, so it has exited
            self._reader.forget()
            assert self._dir is not None
            for path in self._dir.glob(f"{child.pid}-*"):  # its files (our views live on)
                path.unlink(missing_ok=True)
            reason = "hung" if self._hung == child.pid else "exited"
            self.restarts[reason] += 1
            what = (
                f"made no progress in {self.progress_timeout_s:g} s and was killed"
                if reason == "hung"
                else f"exited with status {status}"
            )
            error = RuntimeError(
                f"the preparing process {child.pid} {what}; "
                f"a new one starts in {delay:g} s (serving {self.model.version} meanwhile)"
            )
            logger.warning("follow %s: %s", self.run_dir, error)
            if self.on_failure is not None:
                self.on_failure(error)
            if self.on_restart is not None:
                self.on_restart(reason)
            delay = self.restart_s if applied else min(2 * delay, self.max_restart_s)
            self._stop.wait(delay)

    def _follow(self, child: subprocess.Popen[bytes]) -> int:
        """Apply what ``child`` prepares until its pipe ends; returns updates applied."""
        assert child.stdout is not None and child.stdin is not None
        applied = 0
        for line in child.stdout:  # Blocking read (the GIL released): the next message
            self._progress_at = time.monotonic()
            reply = b"skipped\n"
            try:
                message = json.loads(line)
                if "ready" in message:
                    self._ready = True
                    continue
                if "error" in message:
                    self._failed(CheckpointError(message["error"]))
                    continue
                self._offered = str(message.get("checkpoint"))
                self._apply(message)
                applied += 1
                reply = b"served\n"
            except Exception as exc:  # reported; the thread follows on (serving goes on)
                logger.warning("follow %s: not applied: %s", self.run_dir, exc)
                self._failed(exc)
            try:
                child.stdin.write(reply)  # the child may prepare the next
                child.stdin.flush()
            except (BrokenPipeError, ValueError):
                break
        return applied

    def _failed(self, exc: Exception) -> None:
        if self.on_failure is not None:
            self.on_failure(exc)

    def _apply(self, message: dict[str, Any]) -> None:
        cpu = time.thread_time()
        name = str(message["checkpoint"])
        kind = UpdateKind(message["kind"])
        dense_due = (
            kind is UpdateKind.FULL or time.monotonic() - self._dense_at >= self.dense_every_s
        )
        path, size = Path(message["file"]), int(message["bytes"])
        version = self._reader.read(path, size, dense=dense_due)  # dense copied when due
        model = self.model.new_dense(version.dense) if dense_due else None
        dense_from = name if model is not None else self.dense_from
        tables = {
            table: SlotTable(table, index, weights, unknown, self._shards[table], rows)
            for table, (index, weights, unknown, rows) in version.tables.items()
        }
        if dense_from == name:
            label = f"{self.job_name}@{name}"
        else:
            label = f"{self.job_name}@{name}+dense@{dense_from}"
        self.model.serve_tables(label, tables, model)
        if model is not None:
            self._dense_at = time.monotonic()
        self.dense_from = dense_from
        self.served = self.served.parent / name
        self._behind_since = None  # until the watchdog finds a newer one pending
        self.last_cpu_s = time.thread_time() - cpu
        self.last_prepare_cpu_s = float(message.get("cpu_s", 0.0))
        self.slot_writes["whole" if message.get("whole", True) else "deltas"] += 1
        # An ``initial`` version (a node's preparer handing over the version
        # served already, estuary.serve.node_preparer) is no update.
        if self.on_update is not None and not message.get("initial"):
            self.on_update(kind, time.time() - float(message["committed"]))


def _end(child: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Close ``child``'s stdin (it exits), kill it if it has not after ``timeout_s``."""
    if child.stdin is not None:
        with contextlib.suppress(OSError):
            child.stdin.close()
    try:
        child.wait(timeout_s)  # Blocking wait: at most timeout_s
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()  # Blocking wait: killed
