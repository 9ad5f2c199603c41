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
keep failing); requests are served meanwhile from the version held. Versions
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
from estuary.serve.prepared import SlotReader
from estuary.serve.preparer import Prepared
from estuary.train.checkpoint_chain import CheckpointError
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
        self.children_started = 0
        self._shards = {name: spec.shards for name, spec in model.plan.tables.items()}
        self._dense_at = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _child between the thread and stop()
        self._child: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._dir: Path | None = None
        self._reader = SlotReader()

    @property
    def child_pid(self) -> int | None:
        """The process id of the child now running (``None``: none)."""
        child = self._child
        return child.pid if child is not None and child.poll() is None else None

    def start(self) -> ProcessFollower:
        """Start the child and follow on a daemon thread until ``stop``."""
        self._dir = handoff_dir()
        self._thread = threading.Thread(target=self._run, name="estuary-follow", daemon=True)
        self._thread.start()
        return self

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
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _spawn(self) -> subprocess.Popen[bytes]:
        assert self._dir is not None
        cmd = [sys.executable, "-m", "estuary.serve.prepare_process", str(self.run_dir)]
        cmd += [str(self._dir), "--from", str(self.served), "--poll-s", str(self.poll_s)]
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.children_started += 1
        return child

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
            error = RuntimeError(
                f"the preparing process {child.pid} exited with status {status}; "
                f"a new one starts in {delay:g} s (serving {self.model.version} meanwhile)"
            )
            logger.warning("follow %s: %s", self.run_dir, error)
            if self.on_failure is not None:
                self.on_failure(error)
            delay = self.restart_s if applied else min(2 * delay, self.max_restart_s)
            self._stop.wait(delay)

    def _follow(self, child: subprocess.Popen[bytes]) -> int:
        """Apply what ``child`` prepares until its pipe ends; returns updates applied."""
        assert child.stdout is not None and child.stdin is not None
        applied = 0
        for line in child.stdout:  # Blocking read (the GIL released): the next message
            reply = b"skipped\n"
            try:
                message = json.loads(line)
                if "error" in message:
                    self._failed(CheckpointError(message["error"]))
                    continue
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
        version = self._reader.read(Path(message["file"]), int(message["bytes"]))
        name = str(message["checkpoint"])
        kind = UpdateKind(message["kind"])
        dense_due = (
            kind is UpdateKind.FULL or time.monotonic() - self._dense_at >= self.dense_every_s
        )
        model = self.model.new_dense(version.dense) if dense_due else None
        dense_from = name if model is not None else self.dense_from
        tables = {
            table: FrozenTable.from_sorted(table, ids, weights, unknown, self._shards[table])
            for table, (ids, weights, unknown) in version.tables.items()
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
        self.last_cpu_s = time.thread_time() - cpu
        self.last_prepare_cpu_s = float(message.get("cpu_s", 0.0))
        if self.on_update is not None:
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
