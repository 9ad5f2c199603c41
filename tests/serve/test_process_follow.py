"""Following a run with updates prepared in a child process (``--prepare process``):
prepared tables look up what restored tables do, each checkpoint serves what
loading it serves, a broken checkpoint or a dead child is reported and serving
goes on, and the child never outlives the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from estuary.serve.checkpoints import model_from_checkpoint
from estuary.serve.follow import Follower, UpdateKind
from estuary.serve.frozen_table import FrozenTable
from estuary.serve.prepared import PreparedTable, SlotReader, SlotWriter
from estuary.serve.preparer import Preparer
from estuary.serve.process_follow import ProcessFollower, model_from_prepared
from estuary.train.checkpoint import load_checkpoint
from estuary.train.checkpoint_chain import CheckpointError

from .conftest import TinyRun, instances
from .test_follow import D1, D2, D3, FULL, NEXT_FULL, land

WAIT_S = 120.0  # a bound for a child to start and prepare on a loaded machine


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.05)


def test_prepared_tables_look_up_what_restored_tables_do(tiny_run: TinyRun, tmp_path: Path) -> None:
    preparer = Preparer(tmp_path)
    kinds = []
    for name in (FULL, D1, D2, D3, NEXT_FULL):
        land(tiny_run, tmp_path, name)
        prepared = preparer.step()
        assert prepared is not None and prepared.checkpoint.name == name
        kinds.append(prepared.kind)
        restored = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoints" / name))
        rng = np.random.default_rng(0)
        for table_name, table in prepared.tables.items():
            shards = restored.plan.tables[table_name].shards
            frozen = FrozenTable.from_sorted(
                table_name, table.ids, table.weights, table.unknown, shards
            )
            ids = np.concatenate([table.ids, np.arange(-20, 20), rng.integers(0, 2**62, 50)])
            np.testing.assert_array_equal(
                frozen.lookup(ids, train=False),
                restored.tables[table_name].lookup(ids, train=False),
            )
    assert preparer.step() is None
    assert kinds == [UpdateKind.FULL, *[UpdateKind.DELTA] * 3, UpdateKind.FULL]


@pytest.fixture()
def followed(tiny_run: TinyRun, tmp_path: Path):  # type: ignore[no-untyped-def]
    land(tiny_run, tmp_path, FULL)
    prepared = Preparer(tmp_path).load(tmp_path / "checkpoints" / FULL)
    model = model_from_prepared(prepared)
    failures: list[Exception] = []
    kinds: list[UpdateKind] = []
    follower = ProcessFollower(
        tmp_path,
        model,
        prepared.checkpoint,
        poll_s=0.05,
        dense_every_s=1e9,  # tables only, until a full checkpoint
        on_update=lambda kind, age_s: kinds.append(kind),
        on_failure=failures.append,
        restart_s=0.1,
    )
    follower.start()
    try:
        yield follower, failures, kinds
    finally:
        follower.stop()


def test_each_checkpoint_serves_what_following_in_process_serves(
    tiny_run: TinyRun, tmp_path: Path, followed: tuple[ProcessFollower, list, list]
) -> None:
    follower, failures, kinds = followed
    model = follower.model
    reference = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoints" / FULL))
    in_process = Follower(tmp_path, reference, tmp_path / "checkpoints" / FULL, dense_every_s=1e9)
    batch = model.pipeline.parse(instances(tiny_run.eval_rows))
    np.testing.assert_array_equal(
        model.predict(batch).probabilities, reference.predict(batch).probabilities
    )
    for name in (D1, D2):
        land(tiny_run, tmp_path, name)
        in_process.poll()
        wait_for(lambda n=name: model.version == f"tiny@{n}+dense@{FULL}", f"{name} served")
        assert reference.version == model.version
        np.testing.assert_array_equal(
            model.predict(batch).probabilities, reference.predict(batch).probabilities
        )
    land(tiny_run, tmp_path, D3, NEXT_FULL)  # a new chain: prepared whole, dense swapped
    wait_for(lambda: model.version == f"tiny@{NEXT_FULL}", "the new chain served")
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoints" / NEXT_FULL))
    np.testing.assert_array_equal(
        model.predict(batch).probabilities, loaded.predict(batch).probabilities
    )
    assert kinds == [UpdateKind.DELTA, UpdateKind.DELTA, UpdateKind.FULL]
    assert failures == [] and follower.children_started == 1
    assert follower.last_cpu_s > 0  # counted per update


def test_a_broken_checkpoint_and_a_killed_child_are_reported_and_serving_goes_on(
    tiny_run: TinyRun, tmp_path: Path, followed: tuple[ProcessFollower, list, list]
) -> None:
    follower, failures, _ = followed
    model = follower.model
    land(tiny_run, tmp_path, D1)
    (tmp_path / "checkpoints" / D1 / "tables" / "C1.safetensors").write_bytes(b"torn")
    wait_for(lambda: bool(failures), "the torn file reported")
    assert isinstance(failures[0], CheckpointError) and "C1.safetensors" in str(failures[0])
    assert model.version == f"tiny@{FULL}"  # still served

    pid = follower.child_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: any(f"process {pid} exited" in str(f) for f in failures), "death reported")
    wait_for(lambda: follower.child_pid not in (None, pid), "a new child")
    torn = tmp_path / "checkpoints" / D1 / "tables" / "C1.safetensors"
    torn.write_bytes(
        (tiny_run.run_dir / "checkpoints" / D1 / "tables" / "C1.safetensors").read_bytes()
    )
    land(tiny_run, tmp_path, D2)  # D1 repaired: the new child serves D2 (by D1's delta)
    wait_for(lambda: model.version.startswith(f"tiny@{D2}"), "D2 served by the new child")
    loaded = model_from_checkpoint(load_checkpoint(tiny_run.run_dir / "checkpoints" / D2))
    batch = model.pipeline.parse(instances(tiny_run.eval_rows))
    # Tables of D2 (the dense network stays FULL's: dense_every_s); D2's tables
    # with FULL's network equal neither reference exactly, so compare the tables.
    for name, table in model.tables.items():
        ids = np.unique(batch.sparse[name].values)
        np.testing.assert_array_equal(
            table.lookup(ids, train=False), loaded.tables[name].lookup(ids, train=False)
        )
    assert follower.children_started == 2


SERVER = """
import sys, time
from pathlib import Path
from estuary.serve.server import ServeOptions, open_served
served = open_served(None, Path(sys.argv[1]), ServeOptions(poll_s=0.05))
served.follower.start()
while served.follower.child_pid is None:
    time.sleep(0.05)
print(served.follower.child_pid, flush=True)
time.sleep(600)
"""


def test_the_preparing_process_dies_with_the_server(tiny_run: TinyRun, tmp_path: Path) -> None:
    land(tiny_run, tmp_path, FULL)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        child = int(server.stdout.readline())
        os.kill(child, 0)  # running
    finally:
        server.kill()  # SIGKILL: no clean-up runs in the server
        server.wait()

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, f"the preparing process {child} ends")


def test_slots_keep_the_served_version_and_grow_in_new_files(tmp_path: Path) -> None:
    def table(n: int, value: float) -> PreparedTable:
        ids = np.arange(n, dtype=np.int64) * 3
        weights = np.full((n, 2), value, np.float32)
        return PreparedTable("t", ids, weights, np.zeros((1, 2), np.float32), 1, n)

    dense = {"w": torch.arange(4, dtype=torch.bfloat16), "b": torch.ones(2)}
    writer, reader = SlotWriter(tmp_path), SlotReader()
    first, size = writer.write({"t": table(4, 1.0)}, dense)
    served = reader.read(first, size)
    writer.served()
    skipped, _ = writer.write({"t": table(4, 2.0)}, dense)  # the server did not take it
    second, size = writer.write({"t": table(4000, 3.0)}, dense)  # same slot, grown: a new file
    assert skipped != first and second != first and not skipped.exists()
    ids, weights, _ = served.tables["t"]  # the version served is untouched
    np.testing.assert_array_equal(ids, np.arange(4) * 3)
    assert (weights == 1.0).all()
    ids, weights, _ = reader.read(second, size).tables["t"]
    assert ids.size == 4000 and (weights == 3.0).all()
    assert served.dense["w"].dtype == torch.bfloat16
    torch.testing.assert_close(served.dense["w"], dense["w"])
    writer.close()
    assert list(tmp_path.iterdir()) == []
