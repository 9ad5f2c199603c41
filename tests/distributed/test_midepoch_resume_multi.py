"""``output.checkpoint_every_steps`` on a two-trainer ``data.sources`` job: the
whole run (launcher, trainers, server) SIGKILLed mid-epoch after a mid-epoch
checkpoint, then ``estuary train --resume --nproc 2``, ends exactly where an
uninterrupted two-trainer run does (tables, optimizer state, dense weights,
AUC), having trained each remaining step once (no batch twice, none skipped).

The killed run is ``estuary train`` started from a small script that holds rank 0
just before a chosen step (the trainers are spawned, so they import the script's
patch too); the test SIGKILLs the process group once rank 0 holds there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from estuary.cli import main
from estuary.config import load_job
from estuary.runtime.launcher import run_distributed
from estuary.train import load_checkpoint
from estuary.train.checkpoint_chain import LATEST

from .conftest import write_job

pytestmark = pytest.mark.distributed
WORLD, EVERY = 2, 3
# 195 train rows: 97 per rank, 7 steps of 16 (the last of 1 row) per epoch, 2 epochs.
STEPS_PER_EPOCH, ROWS_PER_EPOCH = 7, WORLD * 97
HOLD = 10  # rank 0 holds before step 11: checkpoint 9 is epoch 1's step 2
TIMEOUT_S = 120

HOLDING_CLI = """
import multiprocessing, sys, time
from pathlib import Path


def _hold(state):  # every trainer process runs this module's top level
    if state.rank == 0 and state.step == {hold}:
        Path({marker!r}).write_text(str(state.step))
        time.sleep(3600)  # SIGKILLed here


# A parameter-server process (spawned: it runs this top level too) needs neither
# the patch nor the trainer's imports (torch: seconds per server started).
if multiprocessing.current_process().name != "estuary-ps":
    from estuary.train import Trainer
    from estuary.train.callbacks import FaultInjection

    Trainer.default_callbacks.append(lambda: FaultInjection(_hold))

if __name__ == "__main__":
    from estuary.cli import main

    sys.exit(main(sys.argv[1:]))
"""


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {k: np.asarray(state[k])[order] for k in ("ids", "weights", "opt.accum")}


def start_held(script: Path, job_path: Path) -> subprocess.Popen[bytes]:
    """``estuary train JOB --nproc 2`` as ``script`` runs it, in its own process
    group (a session), so one SIGKILL reaches the launcher, trainers and server."""
    argv = ["train", str(job_path), "--nproc", str(WORLD), "--no-progress"]
    return subprocess.Popen([sys.executable, str(script), *argv], start_new_session=True)


def test_two_trainers_killed_mid_epoch_resume_to_the_uninterrupted_result(
    tmp_path: Path,
) -> None:
    start_s = time.monotonic()
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    ref.mkdir()
    job_path = write_job(ref)  # sync mode: the runs are deterministic
    raw = yaml.safe_load(job_path.read_text())
    raw["output"]["checkpoint_every_steps"] = EVERY
    job_path.write_text(yaml.safe_dump(raw))
    shutil.copytree(ref, crashed)
    marker = tmp_path / "held"
    script = tmp_path / "estuary_held.py"
    script.write_text(HOLDING_CLI.format(hold=HOLD, marker=str(marker)))

    # The killed run starts first and holds at step 10 whatever the other one does.
    killed = start_held(script, crashed / "job.yaml")
    try:
        assert main(["train", str(ref / "job.yaml"), "--nproc", str(WORLD), "--no-progress"]) == 0
        while not marker.is_file():
            assert killed.poll() is None, f"the run ended first (exit {killed.returncode})"
            assert time.monotonic() - start_s < TIMEOUT_S, f"no step {HOLD} within {TIMEOUT_S} s"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # launcher, trainers, server
            os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert killed.returncode == -signal.SIGKILL
    assert marker.read_text() == str(HOLD)
    folder = crashed / "out" / "checkpoints"
    assert (folder / LATEST).is_file()
    newest = load_checkpoint(folder)
    assert newest.manifest["step"] == 9  # steps 3, 6, 9; step 10 trained, not saved
    assert newest.manifest["metadata"]["epoch"] == 1
    assert newest.manifest["metadata"]["epoch_step"] == 9 - STEPS_PER_EPOCH
    killed_s = time.monotonic() - start_s

    # The resume as ``estuary train --nproc 2 --resume`` runs it, with short process
    # group timeouts: ranks that disagree on the step fail in a minute, not ten.
    job = load_job(crashed / "job.yaml")
    result = run_distributed(
        job,
        trainers=WORLD,
        progress=False,
        resume=True,
        pg_timeout_s=60.0,
        ps_wait_timeout_s=60.0,
    )
    want = json.loads((ref / "out" / "summary.json").read_text())
    got = json.loads(json.dumps(result.summary()))
    assert want["steps"] == got["steps"] == 2 * STEPS_PER_EPOCH
    assert want["train_rows"] == 2 * ROWS_PER_EPOCH
    # Only the rest was trained: epoch 1 from its step 3, each step once at the server.
    assert got["train_rows"] == want["train_rows"] - (ROWS_PER_EPOCH + 2 * WORLD * 16)
    assert got["ps_applied_steps"] == 2 * STEPS_PER_EPOCH - 9
    assert got["ps_duplicate_pushes"] == want["ps_duplicate_pushes"] == 0

    a, b = load_checkpoint(crashed / "out"), load_checkpoint(ref / "out")
    assert a.manifest["step"] == b.manifest["step"] == 2 * STEPS_PER_EPOCH
    assert a.manifest["metadata"]["epoch"] == b.manifest["metadata"]["epoch"] == 2
    assert set(a.tables) == set(b.tables) == {"s1", "ids"}
    for name in b.tables:
        got_t, want_t = by_id(a.tables[name]), by_id(b.tables[name])
        for key, value in want_t.items():
            np.testing.assert_allclose(got_t[key], value, rtol=1e-6, atol=1e-7, err_msg=name)
    for key, value in b.dense.items():
        torch.testing.assert_close(a.dense[key], value, rtol=1e-6, atol=1e-7)
    assert a.optimizer is not None and b.optimizer is not None
    for index, state in b.optimizer["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                a.optimizer["state"][index][key], value, rtol=1e-6, atol=1e-7
            )
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-6)
    print(f"killed after {killed_s:.1f} s; all: {time.monotonic() - start_s:.1f} s")


def test_sigterm_stops_two_trainers_at_an_agreed_step_with_a_checkpoint(
    tmp_path: Path, signal_in_step_6: Callable[[list[str], signal.Signals], tuple[int, str]]
) -> None:
    # SIGTERM to the launcher: the ranks agree at the next poll (step 8, the first
    # of epoch 1), rank 0 checkpoints it, the run exits 143; --resume trains the rest.
    job_path = write_job(tmp_path)  # sync, 2 epochs of 7 steps, no periodic checkpoints
    argv = ["train", str(job_path), "--nproc", str(WORLD), "--no-progress"]
    code, err = signal_in_step_6(argv, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after step 8; checkpoint " in err
    saved = load_checkpoint(tmp_path / "out")
    assert saved.manifest["step"] == 8
    assert (saved.manifest["metadata"]["epoch"], saved.manifest["metadata"]["epoch_step"]) == (1, 1)

    job = load_job(job_path)
    result = run_distributed(
        job, trainers=WORLD, progress=False, resume=True, pg_timeout_s=60.0, ps_wait_timeout_s=60.0
    )
    got = result.summary()
    assert got["steps"] == 2 * STEPS_PER_EPOCH
    assert got["train_rows"] == ROWS_PER_EPOCH - WORLD * 16  # epoch 1 but its first step
    assert got["ps_applied_steps"] == 2 * STEPS_PER_EPOCH - 8
    assert got["ps_duplicate_pushes"] == 0
