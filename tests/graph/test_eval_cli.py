"""``estuary eval --checkpoint`` on a ``data.dataset`` job: it predicts the held-out
``eval_stream`` (or ``--stream NAME``), read once in order, and reproduces the
number the training run printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from estuary.cli import main
from estuary.config import load_job
from estuary.train import Trainer

from .conftest import COLUMNS, PATTERN, SCHEMA, write_hours


def write_job(root: Path, eval_stream: str | None) -> Path:
    def src(name: str, start: int, end: int) -> dict[str, Any]:
        return {
            "name": name,
            "path": PATTERN,
            "columns": COLUMNS,
            "start": f"2026-01-01T{start:02d}",
            "end": f"2026-01-01T{end:02d}",
        }

    job = {
        "data": {
            "schema": SCHEMA,
            "max_bad_row_ratio": 0.2,
            "dataset": {
                "streams": {
                    "train": {"sources": [src("a", 0, 2)]},
                    "holdout": {"sources": [src("b", 2, 3)]},
                },
                "eval_stream": eval_stream,
                "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 2},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": 32, "seed": 0},
        "output": {"dir": "out", "progress": False, "checkpoint": True},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run_eval(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["eval", *argv]) == 0
    return dict(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))


def test_eval_of_a_dataset_job_predicts_the_eval_stream_like_training_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = write_hours(tmp_path, 3, 100, bad_every=13)
    per_hour = written.rows // 3
    job_path = write_job(tmp_path, "holdout")
    result = Trainer(load_job(job_path)).fit(progress=False)
    assert result.eval is not None and result.eval_rows == per_hour
    out = str(tmp_path / "out")

    got = run_eval(capsys, str(job_path), "--checkpoint", out)
    assert got["eval_rows"] == per_hour
    assert got["auc"] == pytest.approx(result.eval.auc, abs=1e-6)
    assert got["logloss"] == pytest.approx(result.eval.logloss, abs=1e-6)

    # Any stream of the dataset by name (here: the two training hours).
    got = run_eval(capsys, str(job_path), "--checkpoint", out, "--stream", "train")
    assert got["eval_rows"] == 2 * per_hour


def test_eval_of_a_dataset_job_without_an_eval_stream_says_what_to_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_hours(tmp_path, 3, 20)
    job_path = write_job(tmp_path, None)
    Trainer(load_job(job_path)).fit(progress=False)
    out = str(tmp_path / "out")
    assert main(["eval", str(job_path), "--checkpoint", out]) == 2
    error = capsys.readouterr().err
    assert "data.dataset.eval_stream" in error and "--stream NAME" in error
    assert main(["eval", str(job_path), "--checkpoint", out, "--stream", "nope"]) == 2
    assert "no stream 'nope' (streams: holdout, train)" in capsys.readouterr().err
