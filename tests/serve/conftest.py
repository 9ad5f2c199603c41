"""A tiny trained run shared by the serving tests (trained once per session,
~3 s): 2 dense and 2 sparse columns, checkpoints every 10 steps, every 5th one
full and the ones between deltas."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from estuary.cli import main
from estuary.serve.export import export_checkpoint

FIELDS = ("I1", "I2", "C1", "C2")


@dataclass(frozen=True)
class TinyRun:
    """A trained job: its file, output folder, data rows and an export of it."""

    job: Path
    run_dir: Path
    rows: list[dict[str, Any]]  # every data row, as a request's instance (plus label)
    export_dir: Path

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        """The job's eval split: the last 20% of the rows (no bad rows)."""
        return self.rows[len(self.rows) - len(self.rows) // 5 :]


def write_data(path: Path, rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """A TSV of ``rows`` rows (I2 missing in ~10% of them); returns them as dicts."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    lines = ["label\tI1\tI2\tC1\tC2"]
    for _ in range(rows):
        c1, c2 = int(rng.integers(0, 400)), int(rng.integers(0, 50))
        label = int(rng.random() < (0.7 if c1 % 3 == 0 else 0.2))
        i1 = int(rng.integers(0, 9))
        i2 = None if rng.random() < 0.1 else int(rng.integers(0, 100))
        lines.append(f"{label}\t{i1}\t{'' if i2 is None else i2}\t{c1:x}\t{c2:x}")
        out.append({"label": label, "I1": i1, "I2": i2, "C1": f"{c1:x}", "C2": f"{c2:x}"})
    path.write_text("\n".join(lines) + "\n")
    return out


def write_job(folder: Path, **output: Any) -> Path:
    job = {
        "name": "tiny",
        "data": {
            "sources": [{"path": "train.tsv", "format": "tsv"}],
            "schema": {"dense": ["I1", "I2"], "sparse": ["C1", "C2"]},
            "eval_fraction": 0.2,
        },
        "model": {
            # DeepFM: its first-order and FM terms are linear in each row, so a
            # changed row always changes the prediction (a tiny DLRM has dead ReLUs).
            "type": "deepfm",
            "params": {"mlp": [8]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": 32, "epochs": 2, "threads": 1},
        "output": {"dir": "out", "progress": False, **output},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    folder = tmp_path_factory.mktemp("tiny")
    rows = write_data(folder / "train.tsv", 2000)
    job = write_job(folder, checkpoint_every_steps=10, checkpoint_full_every=5)
    assert main(["train", str(job), "-q"]) == 0
    export_dir = folder / "export"
    export_checkpoint(folder / "out", export_dir)
    return TinyRun(job, folder / "out", rows, export_dir)


def instances(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as a request sends them (without the label)."""
    return [{k: row[k] for k in FIELDS} for row in rows]


Call = tuple[str, str, bytes | None]  # (method, path, body)


def request_all(app: Any, calls: list[Call], *, concurrent: bool = False) -> list[httpx.Response]:
    """Send ``calls`` to the ASGI ``app`` in-process (httpx's ASGI transport), one
    after another or all at once; then close the app's batcher."""

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:

            async def one(call: Call) -> httpx.Response:
                method, path, body = call
                return await client.request(method, path, content=body)

            try:
                if concurrent:
                    return list(await asyncio.gather(*(one(c) for c in calls)))
                return [await one(c) for c in calls]
            finally:
                await app.state.batcher.close()

    return asyncio.run(run())


def predict_call(rows: list[dict[str, Any]]) -> Call:
    return ("POST", "/predict", json.dumps({"instances": instances(rows)}).encode())
