"""Shared by the observability tests: a tiny ``data.sources`` job and a tiny
``data.dataset`` one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest
import yaml

from ..train.test_metrics_export import write_tsv


class TinyJob(Protocol):
    def __call__(self, root: Path, **output: Any) -> Path: ...


class DatasetJob(Protocol):
    def __call__(self, root: Path, **output: Any) -> Path: ...


def _tiny_job(tmp_path: Path, **output: Any) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_tsv(tmp_path / "train.tsv", 1500)
    job = {
        "name": "tiny",
        "data": {
            "sources": [{"path": "train.tsv", "format": "tsv"}],
            "schema": {"dense": ["I1"], "sparse": ["C1", "C2"]},
            "eval_fraction": 0.2,
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": 16, "epochs": 2, "threads": 1},
        "output": {"dir": "run", "progress": False, "timeseries_every_s": 0.02, **output},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="session")
def tiny_job() -> TinyJob:
    """``tiny_job(root, **output)``: a job file in ``root`` training 1,500 rows
    (1,200 train, 300 eval; batch 16, 2 epochs = 150 steps) into ``root/run``,
    a time series sample every 0.02 s; ``output`` keys override."""
    return _tiny_job


def _dataset_job(root: Path, **output: Any) -> Path:
    rng = np.random.default_rng(0)
    for hour in range(2):
        folder = root / "data" / "20260101" / f"{hour:02d}"
        folder.mkdir(parents=True)
        lines = []
        for _ in range(200):
            c1, c2 = int(rng.integers(0, 300)), int(rng.integers(0, 20))
            lines.append(f"{int(c1 % 3 == 0)}\t{rng.integers(0, 9)}\t{c1:x}\t{c2:x}")
        (folder / "part-00000.tsv").write_text("\n".join(lines) + "\n")
        (folder / "_SUCCESS").write_text("")
    source = {
        "name": "a",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
        "columns": ["label", "I1", "C1", "C2"],
        "start": "2026-01-01T00",
        "end": "2026-01-01T02",
    }
    job = {
        "data": {
            "schema": {"dense": ["I1"], "sparse": ["C1", "C2"]},
            "dataset": {
                "streams": {"clicks": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 5},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": 16, "threads": 1, "mode": "hybrid"},
        "output": {"dir": "run", "progress": False, **output},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="session")
def dataset_job() -> DatasetJob:
    """``dataset_job(root, **output)``: a ``data.dataset`` job in ``root`` whose
    stream ``clicks`` reads two hourly partitions (2026-01-01 00 and 01, 200 rows
    each; batch 16, hybrid) into ``root/run``; ``output`` keys override."""
    return _dataset_job
