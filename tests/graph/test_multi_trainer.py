"""Two gloo trainers and one parameter server on one ``data.dataset``: rank 0
reads and accounts for every row, each rank trains its part of each step.

- a fresh run trains every input line exactly once and ends with the tables and
  dense weights of a one-process run with batch W x B (the same batches; a W-rank
  step follows the gradient of the mean over the whole batch), including a last
  step where rank 1's part is empty;
- the whole run (launcher, trainers, server) SIGKILLed mid-way, then
  ``--resume``d with two trainers, and (a copy) with one: every line trained
  exactly once overall.
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
from typing import Any

import numpy as np
import torch
import yaml

from estuary.cli import main
from estuary.config import load_job
from estuary.data.graph import Progress
from estuary.runtime.launcher import run_distributed
from estuary.train import Trainer, load_checkpoint
from estuary.train.batch_scatter import split_rows
from estuary.train.checkpoint_chain import LATEST

from .conftest import (
    COLUMNS,
    PATTERN,
    SCHEMA,
    assert_every_row_once,
    hour_dir,
    write_hours,
)

WORLD, BATCH, EVERY = 2, 16, 3
CLI = "import sys; from estuary.cli import main; sys.exit(main(sys.argv[1:]))"


def write_job(root: Path, hours: int, *, mode: str, ready_timeout_s: float = 5) -> Path:
    source = {
        "name": "a",
        "path": PATTERN,
        "columns": COLUMNS,
        "start": "2026-01-01T00",
        "end": f"2026-01-01T{hours:02d}",
    }
    job: dict[str, Any] = {
        "data": {
            "schema": SCHEMA,
            "max_bad_row_ratio": 0.2,
            "dataset": {
                "streams": {"s": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.01, "ready_timeout_s": ready_timeout_s},
                "executor": {"block_size_bytes": 512},
                "shuffle": {"buffer_rows": 50, "interleave_splits": 2},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.1}}},
        },
        "train": {
            "batch_size": BATCH,
            "seed": 7,
            "mode": mode,
            "threads": 1,
            "dense_optimizer": {"name": "adam", "lr": 0.01},
        },
        "output": {"dir": "out", "progress": False, "checkpoint_every_steps": EVERY},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_split_rows_gives_each_rank_a_contiguous_part() -> None:
    from estuary.data.types import Batch, JaggedIds

    ids = np.arange(5, dtype=np.int64)
    batch = Batch(
        labels=np.zeros(5, np.float32),
        dense=np.zeros((5, 1), np.float32),
        sparse={"c": JaggedIds.single(ids)},
        row_ids=ids + 100,
    )
    parts = split_rows(batch, 2)  # rows [0 1 2 | 3 4]
    assert [p.row_ids.tolist() for p in parts] == [[100, 101, 102], [103, 104]]  # type: ignore[union-attr]
    one = split_rows(batch.slice(0, 1), 3)  # [0 | - | -]: two empty parts
    assert [p.num_rows for p in one] == [1, 0, 0]
    assert one[1].sparse["c"].offsets.tolist() == [0]


def test_two_trainers_train_each_row_once_and_equal_one_trainer_on_the_whole_batch(
    tmp_path: Path,
) -> None:
    hours = 3
    written = write_hours(tmp_path, hours, 75)  # 225 rows: 7 steps of 2 x 16, then 1 row
    job_path = write_job(tmp_path, hours, mode="sync")
    job = load_job(job_path)
    start = time.monotonic()
    result = run_distributed(job, trainers=WORLD, startup_timeout_s=60)
    wall_s = time.monotonic() - start
    assert result.train_rows == written.rows == 225
    assert result.extra["steps"] == 8 and result.extra["ps_applied_steps"] == 8
    assert result.extra["ps_duplicate_pushes"] == 0
    assert_every_row_once(job_path, written, hours)

    raw = yaml.safe_load(job_path.read_text())
    raw["train"]["batch_size"] = WORLD * BATCH
    raw["output"] = {"dir": "ref", "progress": False}
    (tmp_path / "ref.yaml").write_text(yaml.safe_dump(raw))
    reference = Trainer(load_job(tmp_path / "ref.yaml"))
    assert reference.fit(progress=False).extra["steps"] == 8
    ckpt = load_checkpoint(tmp_path / "out")
    assert int(ckpt.manifest["step"]) == 8
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(ckpt.dense[key], value, rtol=1e-5, atol=1e-6)
    for name, table in reference.tables.items():
        want, got = table.state_dict(), ckpt.tables[name]
        order_w, order_g = np.argsort(want["ids"]), np.argsort(got["ids"])
        np.testing.assert_array_equal(got["ids"][order_g], want["ids"][order_w])
        for key in ("weights", "opt.accum"):
            np.testing.assert_allclose(
                got[key][order_g], want[key][order_w], rtol=1e-5, atol=1e-6, err_msg=key
            )
    print(f"2-trainer data.dataset run: {wall_s:.1f} s")


def test_sigkill_of_a_two_trainer_run_then_resume_trains_each_row_once(tmp_path: Path) -> None:
    """The run reads hours 0-1 and waits for hour 2 (no ``_SUCCESS`` yet); it is
    killed (process group, SIGKILL) at a seeded delay after its first checkpoint,
    mid-step or while waiting, then the hours are completed and the run resumed."""
    hours = 4
    written = write_hours(tmp_path, 2, 120, files=2, bad_every=11)
    later = write_hours(tmp_path, 2, 120, files=2, bad_every=11, first_hour=2, marker=False)
    written.good.update(later.good)
    written.bad.update(later.bad)
    job_path = write_job(tmp_path, hours, mode="hybrid", ready_timeout_s=120)
    checkpoints = tmp_path / "out" / "checkpoints"
    argv = ["train", str(job_path), "--nproc", str(WORLD), "--no-progress"]
    start = time.monotonic()
    run = subprocess.Popen([sys.executable, "-c", CLI, *argv], start_new_session=True)
    try:
        while not (checkpoints / LATEST).is_file():
            assert run.poll() is None, f"the run ended first (exit {run.returncode})"
            assert time.monotonic() - start < 120, "no checkpoint within 120 s"
            time.sleep(0.05)
        time.sleep(float(np.random.default_rng(0).uniform(0.0, 1.0)))
    finally:
        with contextlib.suppress(ProcessLookupError):  # launcher, trainers, server
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert run.returncode == -signal.SIGKILL
    saved = int(load_checkpoint(checkpoints).manifest["step"])
    killed_s = time.monotonic() - start
    assert saved >= EVERY and saved % EVERY == 0

    for hour in (2, 3):
        (hour_dir(tmp_path, hour) / "_SUCCESS").write_text("")
    # Any W resumes: a copy of the killed run's output, resumed by one trainer.
    one = tmp_path / "one"
    one.mkdir()
    shutil.copytree(tmp_path / "out", one / "out")
    shutil.copy(job_path, one / "job.yaml")
    shutil.copytree(tmp_path / "data", one / "data")
    single = Trainer(load_job(one / "job.yaml"))
    single.load_checkpoint(one / "out")
    assert single.fit(progress=False).extra["rows_committed_before"] == saved * WORLD * BATCH
    assert_every_row_once(one / "job.yaml", written, hours)

    assert main([*argv, "--resume"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows_committed_before"] == saved * WORLD * BATCH
    assert summary["duplicate_rows"] == 0 and summary["ps_duplicate_pushes"] == 0
    assert summary["rows_committed"] == written.rows
    assert_every_row_once(job_path, written, hours)
    print(
        f"killed after {killed_s:.1f} s (checkpoint {saved}); all: {time.monotonic() - start:.1f} s"
    )


def test_sigterm_of_a_two_trainer_stream_run_commits_its_rows_and_resume_trains_the_rest(
    tmp_path: Path, signal_in_step_6: Callable[[list[str], signal.Signals], tuple[int, str]]
) -> None:
    # Stops after step 8 (the ranks' first poll after the signal), with the data
    # progress of that step in rank 0's checkpoint; --resume trains every other row.
    written = write_hours(tmp_path, 2, 120, files=2, bad_every=11)
    job_path = write_job(tmp_path, 2, mode="sync")
    argv = ["train", str(job_path), "--nproc", str(WORLD), "--no-progress"]
    code, err = signal_in_step_6(argv, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after step 8; checkpoint " in err
    saved = load_checkpoint(tmp_path / "out")
    assert saved.manifest["step"] == 8

    assert main([*argv, "--resume"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows_committed_before"] == 8 * WORLD * BATCH
    assert summary["duplicate_rows"] == 0 and summary["ps_duplicate_pushes"] == 0
    assert_every_row_once(job_path, written, 2)


def test_sigterm_while_two_trainers_wait_for_data_checkpoints_and_resume_finishes(
    tmp_path: Path,
) -> None:
    # Hours 0-1 are ready, 2-3 not: the ranks train 0-1 and wait. SIGTERM then ends
    # the wait (rank 0's reader stops), rank 0 checkpoints every row trained, the
    # run exits 143; the resume, with the hours ready, trains the rest once.
    written = write_hours(tmp_path, 2, 120, files=2, bad_every=11)
    later = write_hours(tmp_path, 2, 120, files=2, bad_every=11, first_hour=2, marker=False)
    job_path = write_job(tmp_path, 4, mode="sync", ready_timeout_s=120)
    argv = ["train", str(job_path), "--nproc", str(WORLD), "--no-progress"]
    run = subprocess.Popen([sys.executable, "-c", CLI, *argv], stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "out" / "checkpoints"
    try:
        deadline = time.monotonic() + 120
        while not (checkpoints / LATEST).is_file():
            assert run.poll() is None, run.stderr.read() if run.stderr else ""
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        time.sleep(3.0)  # the 218 ready rows take a few steps: idle by now
        sent = time.monotonic()
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
        stopped_s = time.monotonic() - sent
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGTERM, err
    assert stopped_s < 30  # not the 120 s readiness timeout
    saved = load_checkpoint(tmp_path / "out")
    trained = Progress.from_json(saved.manifest["metadata"]["data_progress"]).rows_trained
    # All ready rows but those the reader still held: the shuffle buffer (50) and
    # the W x B step being assembled, plus the buffer's batch margin.
    assert written.rows - 50 - 2 * WORLD * BATCH <= trained <= written.rows
    assert saved.manifest["step"] * WORLD * BATCH >= trained

    for hour in (2, 3):
        (hour_dir(tmp_path, hour) / "_SUCCESS").write_text("")
    assert main([*argv, "--resume"]) == 0
    written.good.update(later.good)
    written.bad.update(later.bad)
    assert_every_row_once(job_path, written, 4)
