"""``runtime.backend: ray`` on a local Ray instance: the same run as the local
runtime, roles placed all together or a clear error, a stop that checkpoints,
and a SIGKILLed PS shard or trainer restarted from the newest checkpoint to the
undisturbed result."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from estuary.cli import main
from estuary.config import load_job
from estuary.runtime import JobState, StopRequest
from estuary.train import TrainingStopped, load_checkpoint
from estuary.train.checkpoint_chain import LATEST

from ..distributed.conftest import write_job

pytestmark = pytest.mark.ray
RAY_2X2 = ["runtime.backend=ray", "runtime.trainers=2", "runtime.ps_shards=2"]


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {k: np.asarray(state[k])[order] for k in ("ids", "weights", "opt.accum")}


def assert_same_tables(a: Path, b: Path) -> None:
    got, want = load_checkpoint(a / "checkpoints"), load_checkpoint(b / "checkpoints")
    assert set(got.tables) == set(want.tables)
    for name in want.tables:
        x, y = by_id(got.tables[name]), by_id(want.tables[name])
        np.testing.assert_array_equal(x["ids"], y["ids"])
        np.testing.assert_allclose(x["weights"], y["weights"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(x["opt.accum"], y["opt.accum"], rtol=1e-6, atol=1e-7)


def sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


@pytest.fixture(scope="module")
def local_2x2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(job file, output folder) of ``write_job``'s job on the local runtime, 2
    trainers and 2 PS shards: the run both data planes' Ray runs must equal (one
    run for both; sync mode, so it is deterministic)."""
    folder = tmp_path_factory.mktemp("local-2x2")
    job_path = write_job(folder)
    local = ["train", str(job_path), "--no-progress", "--output", str(folder / "local")]
    assert main([*local, *sets("runtime.trainers=2", "runtime.ps_shards=2")]) == 0
    return job_path, folder / "local"


@pytest.mark.parametrize("plane", ["socket", "actor"])
def test_ray_2x2_trains_what_the_local_runtime_trains(
    ray_instance: Any, local_2x2_run: tuple[Path, Path], tmp_path: Path, plane: str
) -> None:
    """Over either data plane (the servers' socket protocol, or Ray actor calls)."""
    job_path, local_out = local_2x2_run
    on_ray = ["train", str(job_path), "--no-progress", "--output", str(tmp_path / "ray")]
    assert main([*on_ray, *sets(*RAY_2X2, f"runtime.ray.data_plane={plane}")]) == 0
    want = json.loads((local_out / "summary.json").read_text())
    got = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert got["runtime"] == "ray" and got["roles"] == {"ps": 2, "trainer": 2}
    assert got["ps_shards"] == 2 and got["restarts"] == 0
    assert got["steps"] == want["steps"] == got["ps_applied_steps"]
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-9)
    assert_same_tables(tmp_path / "ray", local_out)
    if plane == "actor":  # the same tables as the socket plane's: its resume would repeat that one
        return
    # A Ray checkpoint resumes on the local runtime with other counts, and that
    # one back on Ray: checkpoints move between runtimes and shard counts.
    more = sets("train.epochs=3", "runtime.trainers=1", "runtime.ps_shards=1")
    assert main([*on_ray, "--resume", *more]) == 0
    resumed = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert resumed["train_rows"] == 195  # the third epoch, all of it, on one trainer
    again = sets(*RAY_2X2, "runtime.ps_shards=3", "train.epochs=4")
    assert main([*on_ray, "--resume", *again]) == 0
    back = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert back["steps"] == resumed["steps"] + got["steps"] // 2  # one more 2-trainer epoch
    assert back["ps_shards"] == 3


def test_roles_the_cluster_cannot_fit_fail_naming_each_role(
    ray_instance: Any, tmp_path: Path
) -> None:
    from estuary.runtime.ray import RayRuntime
    from estuary.runtime.ray.cluster import PlacementError

    job = load_job(
        write_job(tmp_path),
        [*RAY_2X2, "runtime.ray.trainer.cpus=50", "runtime.ray.ps.memory_mb=1024"],
    )
    runtime = RayRuntime()
    with pytest.raises(PlacementError) as info:
        runtime.run(job, progress=False)
    message = str(info.value)
    assert "the Ray cluster can never fit them" in message
    assert "ps x2 asks {CPU 1, memory 1,024 MiB} each" in message
    assert "trainer x2 asks {CPU 50} each" in message
    assert "the cluster has {CPU 8," in message
    assert runtime.state is JobState.FAILED


def test_a_stop_reaches_every_trainer_and_checkpoints_one_step(
    ray_instance: Any, tmp_path: Path
) -> None:
    from estuary.runtime.ray import RayRuntime

    job = load_job(write_job(tmp_path), RAY_2X2)
    stop = StopRequest()
    stop.request("SIGTERM")  # asked before the run: it stops at the first poll
    with pytest.raises(TrainingStopped) as info:
        RayRuntime().run(job, stop=stop, progress=False)
    assert info.value.reason == "SIGTERM"
    newest = load_checkpoint(tmp_path / "out" / "checkpoints")
    assert newest.manifest["step"] == info.value.step >= 1


def big_job(folder: Path, **runtime: Any) -> Path:
    """Long enough (47 steps) that a kill after the first checkpoint (step 3)
    lands mid-run; a checkpoint every 3 steps; one restart allowed."""
    path = write_job(folder, rows=2000)
    raw = yaml.safe_load(path.read_text())
    raw["output"]["checkpoint_every_steps"] = 3
    raw["train"]["epochs"] = 1
    raw["runtime"] = {"trainers": 2, "ps_shards": 2, "max_restarts": 1, **runtime}
    path.write_text(yaml.safe_dump(raw))
    return path


def kill_after_first_checkpoint(runtime: Any, out: Path, role: str, rank: int) -> threading.Thread:
    """SIGKILL the role's process as soon as the first checkpoint is written."""

    def kill() -> None:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / LATEST).is_file():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        os.kill(runtime.pids[(role, rank)], signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def undisturbed_big_run(ray_instance: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The undisturbed run the kill tests compare with (one run for all of them);
    its output folder is ``<folder>/out``."""
    from estuary.runtime.ray import RayRuntime

    folder = tmp_path_factory.mktemp("ref")
    result = RayRuntime().run(load_job(big_job(folder), ["runtime.backend=ray"]), progress=False)
    return folder, result


@pytest.mark.parametrize(("role", "rank"), [("ps", 1), ("trainer", 1)])
def test_a_killed_role_restarts_from_the_newest_checkpoint_to_the_undisturbed_result(
    undisturbed_big_run: Any, tmp_path: Path, role: str, rank: int
) -> None:
    from estuary.runtime.ray import RayRuntime

    ref_folder, want = undisturbed_big_run
    (tmp_path / "hit").mkdir()
    hit = load_job(big_job(tmp_path / "hit"), ["runtime.backend=ray"])
    runtime = RayRuntime()
    killer = kill_after_first_checkpoint(runtime, tmp_path / "hit" / "out", role, rank)
    got = runtime.run(hit, progress=False)
    killer.join(timeout=5)
    assert got.extra["restarts"] == 1
    [record] = got.extra["restart_log"]
    print(f"{role} {rank} killed: {record}")  # at_s, lost_work_s, recovery_s
    assert (record["role"], record["rank"]) == (role, rank)
    assert record["reason"].startswith("died")
    assert got.extra["lost_s"] > 0 and record["recovery_s"] > 0
    assert got.auc == pytest.approx(want.auc, abs=1e-9)
    assert got.summary()["steps"] == want.summary()["steps"]
    # The restarted servers applied the steps after the checkpoint, each once.
    assert got.extra["ps_duplicate_pushes"] == 0
    assert got.extra["ps_applied_steps"] < want.extra["ps_applied_steps"]
    assert_same_tables(tmp_path / "hit" / "out", ref_folder / "out")


def kill_data_executor_after_first_checkpoint(out: Path) -> threading.Thread:
    """SIGKILL data executor 0 (an actor rank 0 started) once the first checkpoint
    is written."""
    import ray

    def kill() -> None:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / LATEST).is_file():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        [name] = [n for n in names if n.startswith("estuary-data-") and n.endswith("-0")]
        actor = ray.get_actor(name)
        os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


DATASET_HOURS = 8


def dataset_run(folder: Path, kill: tuple[str, int] | None = None) -> tuple[Any, int]:
    """A ``data.dataset`` job (rank 0 plans and routes; 2 data executors read the
    splits, each trainer fetches the blocks routed to it) with a checkpoint every
    3 steps, run on Ray in ``folder``; ``kill`` = (role, rank) is SIGKILLed after
    the first checkpoint. Checks every input row was trained exactly once;
    returns the result and the number of rows written."""
    from estuary.runtime.ray import RayRuntime

    from ..graph.conftest import assert_every_row_once, write_hours
    from ..graph.test_multi_trainer import write_job as write_dataset_job

    hours = DATASET_HOURS
    folder.mkdir(exist_ok=True)
    # 6,000 rows (120 of them bad: the job's count is checked): ~190 steps of 2 x 16
    written = write_hours(folder, hours, 750, bad_every=50)
    # The held-out hour: 3,000 rows, so the AUC compares models, not samples.
    write_hours(folder, 1, 3000, first_hour=hours, seed=9)
    path = write_dataset_job(folder, hours, mode="sync")
    raw = yaml.safe_load(path.read_text())
    dataset = raw["data"]["dataset"]
    holdout = dict(dataset["streams"]["s"]["sources"][0], name="h")
    holdout.update(start=f"2026-01-01T{hours:02d}", end=f"2026-01-01T{hours + 1:02d}")
    dataset["streams"]["holdout"] = {"sources": [holdout]}
    dataset["eval_stream"] = "holdout"
    dataset["executor"].update(lookahead_splits=1, queue_blocks=1)  # read as trained
    # A restart changes the row order (a new run re-reads the rows in flight).
    # Gentle steps keep this tiny model's AUC from depending on the order
    # (measured over 4 shuffle seeds: spread 0.004 here, 0.009 at 5x the rates).
    raw["train"]["dense_optimizer"]["lr"] = 0.002
    raw["model"]["embedding"]["default"]["optimizer"]["lr"] = 0.03
    raw["runtime"] = {
        "backend": "ray",
        "trainers": 2,
        "ps_shards": 2,
        "data_executors": 2,
        "max_restarts": 1,
    }
    path.write_text(yaml.safe_dump(raw))
    runtime = RayRuntime()
    if kill is not None and kill[0] == "data_executor":
        kill_data_executor_after_first_checkpoint(folder / "out")
    elif kill is not None:
        kill_after_first_checkpoint(runtime, folder / "out", *kill)
    result = runtime.run(load_job(path), progress=False)
    assert_every_row_once(path, written, hours)
    return result, written.rows


@pytest.fixture(scope="module")
def undisturbed_dataset_run(ray_instance: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The undisturbed dataset run (one for all the kill tests) and its row count."""
    return dataset_run(tmp_path_factory.mktemp("dataset-ref"))


@pytest.mark.parametrize(("role", "rank"), [("ps", 0), ("trainer", 0), ("data_executor", 0)])
def test_a_dataset_run_trains_every_row_once_through_a_killed_role(
    undisturbed_dataset_run: Any, tmp_path: Path, role: str, rank: int
) -> None:
    """A PS shard, trainer or data executor SIGKILLed after the first checkpoint
    of ``dataset_run``'s job. A PS shard or trainer: the run restarts from the
    newest checkpoint; a data executor: it alone is replaced and its split read
    again. Either way every input row is trained exactly once in the end (the
    data progress says so, row by row) and the AUC is an undisturbed run's,
    within 0.005."""
    want, rows = undisturbed_dataset_run
    got, _ = dataset_run(tmp_path / "hit", kill=(role, rank))
    assert want.extra["restarts"] == 0 and want.extra["data_executor_restarts"] == 0
    assert want.extra["roles"] == {"ps": 2, "trainer": 2, "data_executor": 2}
    # Direct delivery: rank 0 routed row ids; it fetched the blocks of its own
    # share of the rows only (every block goes whole to one rank).
    assert want.extra["data_delivery"] == "direct"
    assert 0.25 * rows < want.extra["rows_fetched_rank0"] < 0.75 * rows
    if role == "data_executor":  # nothing else restarted
        assert got.extra["restarts"] == 0 and got.extra["data_executor_restarts"] == 1
    else:
        assert got.extra["restarts"] == 1
        assert got.extra["restart_log"][0]["role"] == role
    assert got.summary()["steps"] == want.summary()["steps"]
    assert got.bad_rows == want.bad_rows == 120  # each once, through the kill
    assert want.auc is not None and got.auc == pytest.approx(want.auc, abs=0.005)


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_embedding_workers_train_what_the_trainers_train_themselves(
    ray_instance: Any, tmp_path: Path, mode: str
) -> None:
    """``runtime.embedding_workers``: each trainer sends its batch's ids to its
    worker and gets pooled blocks back, sends pooled gradients and the worker
    pushes per-id sums. Sync mode ends bit for bit where trainers that look up
    themselves end; hybrid applies every step once."""
    job_path = write_job(tmp_path, mode=mode, **({"staleness": 1} if mode == "hybrid" else {}))
    local = ["train", str(job_path), "--no-progress", "--output", str(tmp_path / "local")]
    assert main([*local, *sets("runtime.trainers=2", "runtime.ps_shards=2")]) == 0
    on_ray = ["train", str(job_path), "--no-progress", "--output", str(tmp_path / "ew")]
    assert main([*on_ray, *sets(*RAY_2X2, "runtime.embedding_workers=true")]) == 0
    want = json.loads((tmp_path / "local" / "summary.json").read_text())
    got = json.loads((tmp_path / "ew" / "summary.json").read_text())
    assert got["roles"] == {"ps": 2, "trainer": 2, "embedding_worker": 2}
    assert got["ps_applied_steps"] == got["steps"] == want["steps"]
    assert got["ps_duplicate_pushes"] == 0
    if mode == "sync":
        assert got["auc"] == pytest.approx(want["auc"], abs=1e-9)
        assert_same_tables(tmp_path / "ew", tmp_path / "local")
    else:
        assert 0 <= got["ps_max_behind"] <= 1


@pytest.mark.parametrize("delivery", ["rank0", "direct"])
def test_data_executors_feed_the_trainers_a_dataset_as_the_local_runtime_does(
    ray_instance: Any, tmp_path: Path, delivery: str
) -> None:
    """A ``data.dataset`` job read by 2 data executors for 2 trainers, against the
    local runtime's ``--nproc 2`` (rank 0 reads) in sync mode. ``rank0``: rank 0
    fetches the rows and shuffles them in one buffer, so the run is the local
    one, table for table. ``direct``: each trainer fetches the blocks routed to
    it, so the steps hold other rows (per-rank shuffle buffers) but every row is
    trained once and the model is as good."""
    from ..graph.conftest import assert_every_row_once, write_hours
    from ..graph.test_multi_trainer import write_job as write_dataset_job

    hours = 3
    written = write_hours(tmp_path, hours, 200)
    path = write_dataset_job(tmp_path, hours, mode="sync")
    local = ["train", str(path), "--no-progress", "--output", str(tmp_path / "local")]
    assert main([*local, *sets("runtime.trainers=2", "runtime.ps_shards=2")]) == 0
    ray = ["train", str(path), "--no-progress", "--output", str(tmp_path / "out")]
    executors = ("runtime.data_executors=2", f"runtime.ray.data_delivery={delivery}")
    assert main([*ray, *sets(*RAY_2X2, *executors)]) == 0
    assert_every_row_once(path, written, hours)  # the Ray run's progress (output.dir)
    want = json.loads((tmp_path / "local" / "summary.json").read_text())
    got = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert got["data_delivery"] == delivery and want["data_delivery"] == "rank0"
    assert got["rows_committed"] == want["rows_committed"] == written.rows
    if delivery == "rank0":
        assert got["steps"] == want["steps"]
        assert_same_tables(tmp_path / "out", tmp_path / "local")
    else:
        # Rank 0 fetched the blocks routed to it, not every row.
        assert got["rows_fetched_rank0"] < 0.75 * written.rows
        assert abs(got["steps"] - want["steps"]) <= 4  # ranks drain their own ends
        got_tables = load_checkpoint(tmp_path / "out" / "checkpoints").tables
        want_tables = load_checkpoint(tmp_path / "local" / "checkpoints").tables
        for name, table in want_tables.items():  # every id seen, as locally
            np.testing.assert_array_equal(np.sort(got_tables[name]["ids"]), np.sort(table["ids"]))
