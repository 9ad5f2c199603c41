"""A job with every role sized differently, for the render tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from estuary.config import JobSpec, load_job

JOB = """\
name: Criteo DLRM
data:
  dataset:
    streams:
      train:
        sources:
          - {name: hist, path: "/data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
             start: "2026-01-01T00", end: "2026-01-01T02"}
  schema: {dense: [I1, I2], sparse: [C1, C2]}
output: {dir: /mnt/runs/criteo}       # a path every node can reach
runtime:
  backend: ray
  max_restarts: 2
  roles:
    driver: {cpus: 2, memory_mb: 4096}
    trainer: {count: 2, max: 4, cpus: 4, memory_mb: 8192, gpus: 1}
    ps: {min: 2, max: 6, cpus: 2.5, memory_mb: 16384}
    data_executor: {count: 3, min: 1, max: 8, cpus: 0.5, memory_mb: 2048}
    embedding_worker: {count: 2, cpus: 1}
"""


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(JOB, encoding="utf-8")
    return path


@pytest.fixture
def job(job_file: Path) -> JobSpec:
    return load_job(job_file)
