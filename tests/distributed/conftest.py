"""Shared pieces of the distributed tests: a tiny CTR file, a job, table specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from estuary.config import JobSpec, load_job
from estuary.config.spec import InitializerSpec, SparseOptimizerSpec, TableSpec

DIM = 4
SPEC = TableSpec(
    dim=DIM,
    initializer=InitializerSpec("uniform", 0.1),
    optimizer=SparseOptimizerSpec(name="adagrad", lr=0.1),
    initial_capacity_rows=8,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: spawns trainer / parameter-server processes (seconds each)"
    )


def write_ctr_csv(path: Path, rows: int, seed: int = 0) -> None:
    """Rows ``label,d1,d2,s1,s2,s3``; small vocabularies, so the ranks' batches
    share many ids; the label depends on s1 and d1."""
    rng = np.random.default_rng(seed)
    lines = ["label,d1,d2,s1,s2,s3"]
    for _ in range(rows):
        s1, d1 = int(rng.integers(0, 30)), int(rng.integers(0, 10))
        p = 1 / (1 + np.exp(-((s1 % 3) - 1 + (d1 - 5) * 0.2)))
        s2, s3 = int(rng.integers(0, 20)), int(rng.integers(0, 20))
        lines.append(f"{int(rng.random() < p)},{d1},{rng.integers(0, 5)},a{s1},b{s2},b{s3}")
    path.write_text("\n".join(lines) + "\n")


def job_dict(**train: Any) -> dict[str, Any]:
    """DLRM on three sparse features, two of them sharing one table (``ids``)."""
    return {
        "data": {
            "sources": [{"path": "train.csv", "format": "csv"}],
            "schema": {"label": "label", "dense": ["d1", "d2"], "sparse": ["s1", "s2", "s3"]},
            "eval_fraction": 0.25,
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [8, DIM], "top_mlp": [8]},
            "embedding": {
                "default": {"dim": DIM, "optimizer": {"name": "adagrad", "lr": 0.1}},
                "shared": {"ids": ["s2", "s3"]},
            },
        },
        "train": {
            "batch_size": 16,
            "epochs": 2,
            "seed": 3,
            "shuffle": True,
            "dense_optimizer": {"name": "adam", "lr": 0.01},
            **train,
        },
        "output": {"dir": "out", "progress": False},
    }


def write_job(folder: Path, rows: int = 260, **train: Any) -> Path:
    write_ctr_csv(folder / "train.csv", rows)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict(**train)))
    return path


@pytest.fixture
def job(tmp_path: Path) -> JobSpec:
    return load_job(write_job(tmp_path))
