"""Training from ``data.dataset``: the CLI's ``--resume``, evaluation on a held-out
stream, and the settings a streaming run refuses."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from estuary.cli import main
from estuary.config import ConfigError, load_job, to_dict
from estuary.data.graph import Progress
from estuary.data.types import Batch
from estuary.train import Trainer, TrainingStopped, load_checkpoint
from estuary.train.callbacks import FaultInjection, LoopState

from .conftest import (
    PATTERN,
    Written,
    assert_every_row_once,
    dataset_job,
    hour_dir,
    source,
    write_hours,
)


def job_file(tmp_path: Path, **train: object) -> Path:
    streams = {
        "train": {"sources": [source("a", hours=2)]},
        "holdout": {"sources": [source("b", start="2026-01-01T02", end="2026-01-01T03")]},
    }
    job = dataset_job(
        tmp_path, streams, model=True, dataset={"eval_stream": "holdout"}, train=train
    )
    data = to_dict(job)
    data["train"] = {"batch_size": 16, "threads": 1, **train}
    data["output"]["checkpoint_every_steps"] = 3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_resume_flag_starts_fresh_then_continues_without_repeating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_hours(tmp_path, 3, 40)
    path = job_file(tmp_path)
    assert main(["train", str(path), "--no-progress", "--resume"]) == 0
    printed = capsys.readouterr()
    assert "no checkpoint" in printed.err
    assert "eval AUC" in printed.out and "(40 eval rows; 80 train rows" in printed.out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["train_rows"] == 80 and summary["eval_rows"] == 40
    assert summary["rows_committed"] == 80 and summary["duplicate_rows"] == 0
    assert summary["auc"] is not None
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step-000000003", "step-000000005"]  # 2 kept

    assert main(["train", str(path), "--no-progress", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().err
    again = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert again["train_rows"] == 0 and again["rows_committed"] == 80


def test_a_requested_stop_commits_its_rows_and_resume_trains_the_rest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = write_hours(tmp_path, 3, 40)
    path = job_file(tmp_path)  # 80 train rows in batches of 16, checkpoints every 3 steps

    def stop(state: LoopState) -> None:
        state.stop.request("SIGTERM")

    stopping = FaultInjection(stop, at_step=2)
    with pytest.raises(TrainingStopped) as info:
        Trainer(load_job(path), callbacks=[stopping]).fit(progress=False)
    assert info.value.step == 2 and info.value.checkpoint is not None
    stopped = load_checkpoint(info.value.checkpoint)
    assert Progress.from_json(stopped.manifest["metadata"]["data_progress"]).rows_trained == 32

    assert main(["train", str(path), "--no-progress", "--resume"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["train_rows"] == 80 - 32 and summary["duplicate_rows"] == 0
    # The train stream's hours 00 and 01 (hour 02 is the holdout stream).
    train_only = Written(
        {k: v for k, v in written.good.items() if "/02/" not in k},
        {k: v for k, v in written.bad.items() if "/02/" not in k},
    )
    assert train_only.rows == 80
    assert_every_row_once(path, train_only, hours=2)


def test_a_stop_while_waiting_for_data_checkpoints_what_was_trained(tmp_path: Path) -> None:
    # Hours 0-1 are ready, hour 2 is not: the run trains 0-1 and waits. A stop then
    # (SIGTERM's request_stop, from the signal handler) ends the wait, checkpoints
    # the rows trained, and the resume (hour 2 ready by then) trains the rest once.
    written = write_hours(tmp_path, 2, 40)
    later = write_hours(tmp_path, 1, 40, first_hour=2, marker=False)
    streams = {"train": {"sources": [source("a", hours=3)]}}
    job = dataset_job(tmp_path, streams, model=True, dataset={"timer": {"ready_timeout_s": 120}})
    data = to_dict(job)
    data["train"] = {"batch_size": 16, "threads": 1}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    trainer = Trainer(load_job(path))

    def stop_once_idle() -> None:
        while trainer.step < 5:  # 80 rows in batches of 16: all there is for now
            time.sleep(0.01)
        time.sleep(0.5)  # waiting for hour 2 by now
        trainer.request_stop("SIGTERM")

    threading.Thread(target=stop_once_idle, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(TrainingStopped) as info:
        trainer.fit(progress=False)
    assert time.monotonic() - start < 30  # not the 120 s readiness timeout
    assert info.value.step == 5 and info.value.checkpoint is not None
    saved = load_checkpoint(info.value.checkpoint)
    assert Progress.from_json(saved.manifest["metadata"]["data_progress"]).rows_trained == 80

    (hour_dir(tmp_path, 2) / "_SUCCESS").write_text("")
    assert main(["train", str(path), "--no-progress", "--resume"]) == 0
    written.good.update(later.good)
    written.bad.update(later.bad)
    assert_every_row_once(path, written, hours=3)


def test_a_run_without_an_eval_stream_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_hours(tmp_path, 1, 8)
    job = dataset_job(tmp_path, {"s": {"sources": [source(hours=1)]}}, model=True)
    data = to_dict(job)
    data["train"] = {"batch_size": 4, "threads": 1}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no eval rows (set data.dataset.eval_stream to evaluate)  (8 train rows" in out
    assert "nan" not in out


def test_streams_are_read_once(tmp_path: Path) -> None:
    write_hours(tmp_path, 1, 4)
    job = dataset_job(
        tmp_path, {"s": {"sources": [source(hours=1)]}}, model=True, train={"epochs": 2}
    )
    with pytest.raises(ConfigError, match=r"train\.epochs: must be 1 with data\.dataset"):
        Trainer(job).fit(progress=False)


def test_each_training_batch_reaches_the_plan_with_its_origin(tmp_path: Path) -> None:
    # Two streams of 32-row hours, batches of 16, no shuffle: every batch is one
    # source's, and plan_for sees which (a mixture job picks its plan by it).
    for folder, seed in (("h", 0), ("l", 1)):
        write_hours(tmp_path / folder, 2, 32, seed=seed)
    streams = {
        name: {"sources": [source(src, hours=2, path=f"{folder}/{PATTERN}")]}
        for name, src, folder in (("hist", "a", "h"), ("live", "b", "l"))
    }
    shuffle = {"buffer_rows": 0, "interleave_splits": 1}
    job = dataset_job(
        tmp_path, streams, model=True, dataset={"shuffle": shuffle}, train={"batch_size": 16}
    )
    seen: list[str | None] = []

    def plain(batch: Batch) -> None:
        seen.append(batch.origin)  # the plain step: no plan

    trainer = Trainer(job)
    trainer.plan_for = plain
    trainer.fit(progress=False)
    assert seen == (["hist/a"] * 2 + ["live/b"] * 2) * 2
