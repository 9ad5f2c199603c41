"""Shared pieces of the task-graph tests: tiny hourly partitions and jobs.

Partitions look like the synthetic writer's (``ROOT/YYYYMMDD/HH/part-*.tsv`` +
``_SUCCESS``), small enough that a test reads them in milliseconds. Every file
records which of its lines are good rows, so tests can compare the row
accounting with the input line by line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from estuary.config import JobSpec, job_from_dict, load_job
from estuary.data.graph import Progress
from estuary.train import load_checkpoint

COLUMNS = ["label", "I1", "I2", "C1", "C2"]
SCHEMA = {"dense": ["I1", "I2"], "sparse": ["C1", "C2"]}
START = datetime(2026, 1, 1, tzinfo=UTC)
PATTERN = "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv"


def hour_dir(root: Path, hour: int, name: str = "data") -> Path:
    when = START + timedelta(hours=hour)
    return root / name / when.strftime("%Y%m%d") / when.strftime("%H")


@dataclass
class Written:
    """What ``write_hours`` wrote: file (relative to root) -> its good line
    numbers, and -> its bad ones."""

    good: dict[str, list[int]] = field(default_factory=dict)
    bad: dict[str, list[int]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(len(v) for v in self.good.values())

    @property
    def bad_rows(self) -> int:
        return sum(len(v) for v in self.bad.values())


def write_hours(
    root: Path,
    hours: int,
    rows: int,
    *,
    files: int = 1,
    seed: int = 0,
    marker: bool = True,
    bad_every: int = 0,
    first_hour: int = 0,
) -> Written:
    """Hourly partitions of Criteo-like TSV (``COLUMNS``, no header).

    Args:
        bad_every: every n-th line is a bad row (a label of 7); 0 = none.
    """
    rng = np.random.default_rng(seed)
    written = Written()
    for hour in range(first_hour, first_hour + hours):
        folder = hour_dir(root, hour)
        folder.mkdir(parents=True, exist_ok=True)
        for part in range(files):
            lines, good, bad = [], [], []
            for line in range(1, rows + 1):
                c1 = int(rng.integers(0, 30))
                label = int(rng.random() < (0.8 if c1 % 3 == 0 else 0.1))
                if bad_every and line % bad_every == 0:
                    label = 7
                    bad.append(line)
                else:
                    good.append(line)
                i1, i2 = int(rng.integers(0, 9)), int(rng.integers(0, 4))
                lines.append(f"{label}\t{i1}\t{i2}\t{c1:04x}\t{int(rng.integers(0, 9)):04x}")
            path = folder / f"part-{part:05d}.tsv"
            path.write_text("\n".join(lines) + "\n")
            written.good[path.relative_to(root).as_posix()] = good
            written.bad[path.relative_to(root).as_posix()] = bad
        if marker:
            (folder / "_SUCCESS").write_text("")
    return written


def source(name: str = "a", hours: int = 2, **extra: Any) -> dict[str, Any]:
    """A batch source over ``data/`` from 2026-01-01T00 for ``hours`` hours."""
    end = (START + timedelta(hours=hours)).strftime("%Y-%m-%dT%H")
    return {
        "name": name,
        "path": PATTERN,
        "columns": COLUMNS,
        "start": "2026-01-01T00",
        "end": end,
        **extra,
    }


def dataset_job(
    root: Path,
    streams: dict[str, Any],
    *,
    model: bool = False,
    data: dict[str, Any] | None = None,
    **sections: Any,
) -> JobSpec:
    """A job reading ``streams``; fast timer defaults; ``model`` adds a tiny DLRM."""
    extra = dict(sections.pop("dataset", {}))
    timer = {"poll_interval_s": 0.01, "ready_timeout_s": 2, **extra.pop("timer", {})}
    dataset = {"streams": streams, "timer": timer, **extra}
    job: dict[str, Any] = {
        "data": {"schema": SCHEMA, "dataset": dataset, "max_bad_row_ratio": 0.2, **(data or {})}
    }
    if model:
        job["model"] = {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        }
        job["output"] = {"dir": "out", "progress": False}
    job.update(sections)
    return job_from_dict(job, base_dir=root)


def assert_every_row_once(job_path: Path, written: Written, hours: int) -> Progress:
    """The job's newest checkpoint says every good row of ``written`` was trained
    exactly once, over ``hours`` committed tasks, and counts its bad rows once."""
    job = load_job(job_path)
    final = load_checkpoint(job.resolve(job.output.dir))
    progress = Progress.from_json(final.manifest["metadata"]["data_progress"])
    assert progress.duplicate_rows == 0
    assert progress.rows_trained == written.rows
    trained: dict[str, list[int]] = {}
    for splits in progress.accounting().values():
        for split, ranges in splits.items():
            trained.setdefault(split, []).extend(r for a, b in ranges for r in range(a, b))
    assert {split: sorted(rows) for split, rows in trained.items()} == written.good
    assert progress.tasks_committed == hours
    # and every bad row counted once, however many runs read it
    assert progress.bad_rows == written.bad_rows
    assert progress.rows_read == written.rows + written.bad_rows
    return progress
