"""Exactly once under SIGKILL (RELIABILITY.md): a training run is killed at a
seeded random step (or in the middle of writing a checkpoint), resumed, and the
row accounting of the final checkpoint must equal the input line by line: no
row missing, no row twice.

The killed runs are child processes (started together); the resumes run in
this process.
"""

from __future__ import annotations

import multiprocessing
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from estuary.config import load_job
from estuary.train import Trainer, load_checkpoint
from estuary.train.checkpoint_chain import LATEST, list_checkpoints

from .conftest import COLUMNS, PATTERN, SCHEMA, Written, assert_every_row_once, write_hours

HOURS, ROWS, FILES, BATCH, EVERY = 4, 120, 2, 32, 4

CHILD = """
import os, signal
import estuary.train.checkpoint as checkpoint
from estuary.config import load_job
from estuary.train import Trainer

os.chdir(root)
from estuary.train.callbacks import FaultInjection

def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)

trainer = Trainer(load_job(job_path))
if mode == "step":  # killed just before training step `at`
    trainer.callbacks.append(FaultInjection(die, at_step=at))
else:  # the `at`-th checkpoint dies with its files written, before its rename
    fsync_dir, seen = checkpoint._fsync_dir, [0]
    def fsync(path):
        if path.name == "tables":
            seen[0] += 1
            if seen[0] == at:
                die()
        return fsync_dir(path)
    checkpoint._fsync_dir = fsync
trainer.fit(progress=False)
"""


def start_killed_runs(root: Path, runs: list[tuple[Path, str, int]]) -> list[Any]:
    """One process per run, forked from a server that imported torch once (a fresh
    interpreter costs seconds of imports; four of them would dominate the test)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["estuary.train", "torch._dynamo"])
    children = []
    for job, mode, at in runs:
        scope = {"root": str(root), "job_path": str(job), "mode": mode, "at": at}
        child = context.Process(target=exec, args=(CHILD, scope), daemon=True)
        child.start()
        children.append(child)
    return children


def write_job(
    root: Path, name: str, mode: str = "sync", seed: int = 0, full_every: int = 1
) -> Path:
    source = {
        "name": "a",
        "path": PATTERN,
        "columns": COLUMNS,
        "start": "2026-01-01T00",
        "end": f"2026-01-01T{HOURS:02d}",
    }
    job: dict[str, Any] = {
        "data": {
            "schema": SCHEMA,
            "max_bad_row_ratio": 0.2,
            "dataset": {
                "streams": {"s": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 5},
                "executor": {"block_size_bytes": 512},
                "shuffle": {"buffer_rows": 50, "interleave_splits": 2},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": BATCH, "seed": seed, "mode": mode, "threads": 1},
        "output": {
            "dir": f"out-{name}",
            "progress": False,
            "checkpoint_every_steps": EVERY,
            "checkpoint_full_every": full_every,  # > 1: delta checkpoints between full ones
        },
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def resume(job_path: Path) -> Trainer:
    """What ``estuary train --resume`` does, in this process."""
    job = load_job(job_path)
    trainer = Trainer(job)
    out = job.resolve(job.output.dir)
    if (out / "checkpoints" / LATEST).is_file():
        trainer.load_checkpoint(out)
        saved = load_checkpoint(out)
        for name, tensor in trainer.model.state_dict().items():  # model = checkpoint's
            torch.testing.assert_close(tensor, saved.dense[name])
    return trainer


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Written]:
    root = tmp_path_factory.mktemp("kill")
    return root, write_hours(root, HOURS, ROWS, files=FILES, bad_every=11)


def test_sigkill_mid_run_and_mid_checkpoint_then_resume_trains_each_row_once(
    data: tuple[Path, Written],
) -> None:
    root, written = data
    steps = -(-written.rows // BATCH)  # ~28 steps per full run
    runs: list[tuple[Path, str, int]] = []
    for seed, mode in [(0, "sync"), (1, "hybrid"), (2, "sync")]:
        kill_at = int(np.random.default_rng(seed).integers(EVERY + 2, steps - 2))
        runs.append((write_job(root, f"step{seed}", mode, seed), "step", kill_at))
    runs.append((write_job(root, "ckpt", "sync", 3), "checkpoint", 3))  # the 3rd checkpoint
    # Delta chains (full every 3rd): killed mid-run, and while writing the 3rd
    # checkpoint, a delta (full 4 <- delta 8 <- delta 12): the chain up to 8 loads.
    kill_at = int(np.random.default_rng(4).integers(EVERY + 2, steps - 2))
    runs.append((write_job(root, "step-delta", "sync", 4, full_every=3), "step", kill_at))
    runs.append((write_job(root, "ckpt-delta", "sync", 5, full_every=3), "checkpoint", 3))
    for child in start_killed_runs(root, runs):
        child.join(timeout=240)
        assert child.exitcode == -signal.SIGKILL, child.exitcode

    for job_path, mode, at in runs:
        if mode == "checkpoint":  # killed while writing the 3rd: the 2nd loads
            folder = root / f"out-{job_path.stem}" / "checkpoints"
            assert any(".tmp-" in p.name for p in folder.iterdir())
            assert load_checkpoint(folder).manifest["step"] == 2 * EVERY
            if "delta" in job_path.stem:  # step 8 is a delta of step 4
                assert load_checkpoint(folder).manifest["chain"] == [
                    f"step-{EVERY:09d}",
                    f"step-{2 * EVERY:09d}",
                ]
            assert [p.name for p in list_checkpoints(folder)][-1] == f"step-{2 * EVERY:09d}"
        trainer = resume(job_path)
        committed_before = trainer.step
        assert committed_before == (at - 1) // EVERY * EVERY if mode == "step" else 2 * EVERY
        result = trainer.fit(progress=False)
        assert result.extra["rows_committed_before"] == committed_before * BATCH
        assert_every_row_once(job_path, written, HOURS)
        assert result.bad_rows == written.bad_rows  # the job's, not only this run's
