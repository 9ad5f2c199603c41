"""Automatic recovery on the local runtime (``runtime.max_restarts``): a trainer
or a parameter-server shard SIGKILLed mid-run is noticed, every process starts
again from the newest checkpoint, and the run ends where an undisturbed one
does (sync mode: the same tables and AUC); past ``max_restarts`` the job fails
naming the role and its cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from estuary.cli import main
from estuary.train import load_checkpoint

from .conftest import write_job

pytestmark = pytest.mark.distributed
WORLD = 2
TIMEOUT_S = 240

# Every trainer process imports this script (multiprocessing's __mp_main__); the
# killing rank kills (SIGKILL) itself or a server before step AT, once per marker file.
KILLING_CLI = """
import multiprocessing, os, signal, sys
from pathlib import Path

KILLS = {kills!r}  # marker files: one kill each, in order


def _kill(state):
    if state.rank != {rank} or state.step + 1 != {at}:
        return
    for marker in map(Path, KILLS):
        if not marker.exists():
            marker.write_text(str(state.step))
            victim = os.getpid()
            if {role!r} == "ps":  # a server: the first parameter-server child of the launcher
                victim = int(Path({ps_pid_file!r}).read_text().split()[0])
            os.kill(victim, signal.SIGKILL)
            return


# A parameter-server process (spawned: it runs this top level too) needs neither
# the patch nor the trainer's imports (torch: seconds per server started).
if multiprocessing.current_process().name != "estuary-ps":
    from estuary.train import Trainer
    from estuary.train.callbacks import FaultInjection

    Trainer.default_callbacks.append(lambda: FaultInjection(_kill))

if __name__ == "__main__":
    import estuary.ps.process as process

    started = process.ServerProcess.__init__

    def noting_pid(self, *args, **kwargs):
        started(self, *args, **kwargs)
        with open({ps_pid_file!r}, "a") as f:
            f.write(f"{{self.pid}}\\n")

    process.ServerProcess.__init__ = noting_pid
    from estuary.cli import main

    sys.exit(main(sys.argv[1:]))
"""


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {k: np.asarray(state[k])[order] for k in ("ids", "weights", "opt.accum")}


def run_killing(
    tmp_path: Path, job_path: Path, *, role: str, kills: int, extra: list[str]
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"estuary_kill_{role}.py"
    markers = [str(tmp_path / f"killed-{role}-{i}") for i in range(kills)]
    script.write_text(
        KILLING_CLI.format(
            kills=markers,
            rank=1,
            at=5,
            role=role,
            ps_pid_file=str(tmp_path / "ps-pids"),
        )
    )
    argv = ["train", str(job_path), "--nproc", str(WORLD), "--no-progress", *extra]
    return subprocess.run(
        [sys.executable, str(script), *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def write_disturbable_job(folder: Path) -> Path:
    """Sync mode, a checkpoint every 3 steps, 2 PS shards, 1 restart allowed."""
    folder.mkdir()
    path = write_job(folder)
    raw = yaml.safe_load(path.read_text())
    raw["output"]["checkpoint_every_steps"] = 3
    raw["runtime"] = {"ps_shards": 2, "max_restarts": 1}
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def ref_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job run undisturbed, once for every test here (its run in ``out/``)."""
    path = write_disturbable_job(tmp_path_factory.mktemp("recovery") / "ref")
    assert main(["train", str(path), "--nproc", str(WORLD), "--no-progress"]) == 0
    return path


@pytest.fixture
def hit_job(tmp_path: Path) -> Path:
    """The same job, to disturb."""
    return write_disturbable_job(tmp_path / "hit")


@pytest.mark.parametrize("role", ["trainer", "ps"])
def test_a_killed_role_is_restarted_and_the_run_ends_as_an_undisturbed_one(
    tmp_path: Path, ref_job: Path, hit_job: Path, role: str
) -> None:
    done = run_killing(tmp_path, hit_job, role=role, kills=1, extra=[])
    assert done.returncode == 0, done.stderr[-3000:]
    rank = "1" if role == "trainer" else "0"
    assert f"restart 1/1: {role} rank {rank} exited with signal SIGKILL" in done.stderr
    summary = json.loads((hit_job.parent / "out" / "summary.json").read_text())
    want = json.loads((ref_job.parent / "out" / "summary.json").read_text())
    assert summary["restarts"] == 1
    [record] = summary["restart_log"]
    assert (record["role"], record["reason"]) == (role, "exited with signal SIGKILL")
    assert record["recovery_s"] > 0 and summary["lost_s"] >= record["recovery_s"]
    # Killed before step 5, resumed from step 3's checkpoint: the same end state.
    assert summary["steps"] == want["steps"] == 14
    assert summary["auc"] == pytest.approx(want["auc"], abs=1e-9)
    got = load_checkpoint(hit_job.parent / "out" / "checkpoints")
    ref = load_checkpoint(ref_job.parent / "out" / "checkpoints")
    for name in ref.tables:
        a, b = by_id(got.tables[name]), by_id(ref.tables[name])
        np.testing.assert_array_equal(a["ids"], b["ids"])
        np.testing.assert_allclose(a["weights"], b["weights"], rtol=1e-6, atol=1e-7)


def test_past_max_restarts_the_job_fails_naming_the_role(tmp_path: Path, hit_job: Path) -> None:
    done = run_killing(tmp_path, hit_job, role="trainer", kills=2, extra=[])
    assert done.returncode != 0
    assert "restart 1/1: trainer rank 1 exited with signal SIGKILL" in done.stderr
    assert (
        "trainer rank 1 exited with signal SIGKILL (after 1 restart(s); "
        "runtime.max_restarts is 1)" in done.stderr
    )
