"""Shared by the observability tests: a tiny ``data.sources`` job."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest
import yaml


class TinyJob(Protocol):
    def __call__(self, root: Path, **output: Any) -> Path: ...


def write_tsv(path: Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lines = ["label\tI1\tC1\tC2"]
    for _ in range(rows):
        c1, c2 = int(rng.integers(0, 400)), int(rng.integers(0, 50))
        label = int(rng.random() < (0.7 if c1 % 3 == 0 else 0.2))
        lines.append(f"{label}\t{rng.integers(0, 9)}\t{c1:x}\t{c2:x}")
    path.write_text("\n".join(lines) + "\n")


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
