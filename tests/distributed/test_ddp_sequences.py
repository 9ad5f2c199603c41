"""Two trainers (gloo DDP + a parameter server) on a job with an unpooled
(``pooling: none``) history feature: DDP carries the sequences to the model,
every step's sparse gradients (sequence positions included) land once, and it
learns the history signal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from estuary.cli import main
from estuary.train import load_checkpoint

pytestmark = pytest.mark.distributed


def test_two_trainers_train_a_din_model_on_a_sequence_feature(tmp_path: Path) -> None:
    from tests.train.test_sequence_features import write_clicks

    write_clicks(tmp_path / "clicks.csv", 2000)
    job = {
        "data": {
            "sources": [{"path": "clicks.csv", "format": "csv"}],
            "schema": {
                "dense": ["price"],
                "sparse": ["user", "item"],
                "features": [{"name": "hist", "kind": "sequence", "columns": ["hist"]}],
            },
            "eval_fraction": 0.2,
        },
        "model": {
            "type": "dlrm",
            "params": {
                "bottom_mlp": [8],
                "top_mlp": [16],
                "sequence_pooling": {"hist": {"type": "target_attention", "query": "item"}},
            },
            "embedding": {
                "default": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 0.1}},
                "tables": {"items": {"pooling": "none"}},
                "shared": {"items": ["item", "hist"]},
            },
        },
        "train": {
            "batch_size": 32,
            "epochs": 2,
            "seed": 3,
            "shuffle": True,
            "dense_optimizer": {"name": "adam", "lr": 0.01},
        },
        "output": {"dir": "out", "progress": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["train", str(path), "--nproc", "2", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["trainers"] == 2 and summary["train_rows"] == 2 * 1600
    assert summary["ps_applied_steps"] == summary["steps"] == 50
    assert summary["ps_duplicate_pushes"] == 0
    assert summary["auc"] > 0.7  # the candidate-in-history signal needs the sequence
    ckpt = load_checkpoint(tmp_path / "out" / "checkpoints")
    assert set(ckpt.tables) == {"user", "items"}
