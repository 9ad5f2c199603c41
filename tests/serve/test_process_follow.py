"""Following a run with updates prepared in a child process (``--prepare process``).

One follower (and so one child at a time: each child imports torch, seconds on a
loaded machine) serves the whole module; the tests run in order along the run's
checkpoints, each starting from what the one before left served:

1. a torn checkpoint is reported and the version served stays; repaired, it is
   served, with what following the run in process serves;
2. a killed child is reported and replaced; the next checkpoint is served by the
   new one;
3. a child that hangs (stopped: it neither exits nor sends anything) is killed by
   the progress deadline, counted and replaced, the run's staleness grows while
   it hangs, and the next checkpoint is served;
4. a new chain is prepared whole and served as loading it serves;

and, apart, the child never outlives its parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from estuary.serve.checkpoints import model_from_checkpoint
from estuary.serve.follow import Follower, UpdateKind
from estuary.serve.model import ServingModel
from estuary.serve.preparer import Preparer
from estuary.serve.process_follow import ProcessFollower, model_from_prepared
from estuary.train.checkpoint import load_checkpoint
from estuary.train.checkpoint_chain import CheckpointError

from .conftest import TinyRun, instances
from .test_follow import D1, D2, D3, FULL, NEXT_FULL, land

WAIT_S = 120.0  # a bound for a child to start and prepare on a loaded machine
PROGRESS_S = 3.0  # the followed child's progress deadline


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.02)


@dataclass
class Followed:
    """The module's follower, the folder it follows, and an in-process follower
    of the same folder as the reference."""

    folder: Path
    follower: ProcessFollower
    reference: Follower
    failures: list[Exception] = field(default_factory=list)
    kinds: list[UpdateKind] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)

    @property
    def model(self) -> ServingModel:
        return self.follower.model

    def serves_what_the_reference_serves(self, run: TinyRun) -> None:
        self.reference.poll()
        assert self.reference.model.version == self.model.version
        batch = self.model.pipeline.parse(instances(run.eval_rows))
        np.testing.assert_array_equal(
            self.model.predict(batch).probabilities,
            self.reference.model.predict(batch).probabilities,
        )


@pytest.fixture(scope="module")
def followed(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Followed]:
    folder = tmp_path_factory.mktemp("followed")
    land(tiny_run, folder, FULL)
    prepared = Preparer(folder).load(folder / "checkpoints" / FULL)
    reference = model_from_checkpoint(load_checkpoint(folder / "checkpoints" / FULL))
    in_process = Follower(folder, reference, folder / "checkpoints" / FULL, dense_every_s=1e9)
    out: Followed
    follower = ProcessFollower(
        folder,
        model_from_prepared(prepared),
        prepared.checkpoint,
        poll_s=0.02,
        dense_every_s=1e9,  # tables only, until a full checkpoint
        on_update=lambda kind, age_s: out.kinds.append(kind),
        on_failure=lambda exc: out.failures.append(exc),
        on_restart=lambda reason: out.restarts.append(reason),
        restart_s=0.05,
        progress_timeout_s=PROGRESS_S,
        start_timeout_s=WAIT_S,
    )
    out = Followed(folder, follower, in_process)
    follower.start()
    try:
        yield out
    finally:
        follower.stop()


def served(followed: Followed, name: str) -> Callable[[], bool]:
    return lambda: followed.model.version.startswith(f"tiny@{name}")


def test_a_torn_checkpoint_is_reported_and_served_once_repaired(
    tiny_run: TinyRun, followed: Followed
) -> None:
    torn = followed.folder / "checkpoints" / D1 / "tables" / "C1.safetensors"
    land(tiny_run, followed.folder, D1)
    torn.write_bytes(b"torn")
    wait_for(lambda: bool(followed.failures), "the torn file reported")
    failure = followed.failures[0]
    assert isinstance(failure, CheckpointError) and "C1.safetensors" in str(failure)
    assert followed.model.version == f"tiny@{FULL}"  # still served
    assert followed.follower.behind_s > 0  # and known to be behind the run
    torn.write_bytes((tiny_run.run_dir / "checkpoints" / D1 / "tables" / torn.name).read_bytes())
    wait_for(served(followed, D1), "D1 served once repaired")
    assert followed.model.version == f"tiny@{D1}+dense@{FULL}"
    followed.serves_what_the_reference_serves(tiny_run)
    assert followed.kinds == [UpdateKind.DELTA]
    assert followed.follower.last_cpu_s > 0  # counted per update
    followed.failures.clear()


def test_a_killed_child_is_reported_and_replaced(tiny_run: TinyRun, followed: Followed) -> None:
    pid = followed.follower.child_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: any(f"process {pid} exited" in str(f) for f in followed.failures),
        "the death reported",
    )
    assert "exited" in followed.restarts
    land(tiny_run, followed.folder, D2)  # the new child starts from D1: D2 by its delta
    wait_for(served(followed, D2), "D2 served by the new child")
    followed.serves_what_the_reference_serves(tiny_run)
    assert followed.follower.child_pid not in (None, pid)
    followed.failures.clear()


def test_a_hung_child_is_killed_at_its_deadline_and_replaced(
    tiny_run: TinyRun, followed: Followed
) -> None:
    follower = followed.follower
    pid = follower.child_pid
    assert pid is not None
    started = follower.children_started
    os.kill(pid, signal.SIGSTOP)  # hangs: neither exits nor sends anything
    land(tiny_run, followed.folder, D3)
    wait_for(lambda: follower.behind_s > PROGRESS_S / 2, "the version served falls behind")
    assert followed.model.version.startswith(f"tiny@{D2}")  # served meanwhile
    wait_for(
        lambda: any(f"process {pid} made no progress" in str(f) for f in followed.failures),
        "the hung child killed",
    )
    assert follower.restarts["hung"] >= 1 and "hung" in followed.restarts
    wait_for(served(followed, D3), "D3 served by the next child")
    assert follower.children_started > started and follower.child_pid != pid
    assert follower.behind_s == 0
    followed.serves_what_the_reference_serves(tiny_run)


def test_a_new_chain_is_served_whole(tiny_run: TinyRun, followed: Followed) -> None:
    land(tiny_run, followed.folder, NEXT_FULL)
    wait_for(lambda: followed.model.version == f"tiny@{NEXT_FULL}", "the new chain served")
    loaded = model_from_checkpoint(load_checkpoint(followed.folder / "checkpoints" / NEXT_FULL))
    batch = followed.model.pipeline.parse(instances(tiny_run.eval_rows))
    np.testing.assert_array_equal(
        followed.model.predict(batch).probabilities, loaded.predict(batch).probabilities
    )
    assert followed.kinds == [UpdateKind.DELTA] * 3 + [UpdateKind.FULL]
    assert sum(followed.follower.slot_writes.values()) == 4  # one slot write a version


PARENT = """
import subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-m", "estuary.serve.prepare_process", sys.argv[1], sys.argv[2]],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
)
print(child.pid, flush=True)
child.stdout.readline()  # ready: started, its stdin read from now on
print("ready", flush=True)
time.sleep(600)
"""


def test_the_preparing_process_dies_with_its_parent(tiny_run: TinyRun, tmp_path: Path) -> None:
    land(tiny_run, tmp_path, FULL)
    (tmp_path / "slots").mkdir()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), str(tmp_path / "slots")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        os.kill(child, 0)  # running
    finally:
        parent.kill()  # SIGKILL: no clean-up runs in the parent
        parent.wait()

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, f"the preparing process {child} ends")
    assert not (tmp_path / "slots").exists()  # its files removed, and the folder
