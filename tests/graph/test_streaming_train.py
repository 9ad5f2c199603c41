"""Training from ``data.dataset``: the CLI's ``--resume``, evaluation on a held-out
stream, and the settings a streaming run refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from estuary.cli import main
from estuary.config import ConfigError, to_dict
from estuary.train import Trainer

from .conftest import dataset_job, source, write_hours


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
