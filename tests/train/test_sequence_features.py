"""A job with an unpooled (``pooling: none``) history feature trains end to end:
the reference models reach it through attention pooling, a custom model gets
the padded sequence and mask, and a model that cannot take it fails early."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import estuary
from estuary.config.loader import job_from_dict, to_dict
from estuary.nn import Sequences

ITEMS = 30


def write_clicks(path: Path, rows: int, seed: int = 0) -> None:
    """Rows ``label,price,user,item,hist``: a click is likely when the candidate
    item is in the user's history (DIN's signal), and more likely the more
    "good" items (even ids) the history holds. ``hist`` is 0-8 items, ``|``-joined."""
    rng = np.random.default_rng(seed)
    lines = ["label,price,user,item,hist"]
    for _ in range(rows):
        hist = rng.integers(0, ITEMS, size=int(rng.integers(0, 9)))
        item = (
            int(rng.choice(hist))
            if len(hist) and rng.random() < 0.5
            else int(rng.integers(0, ITEMS))
        )
        good = float(np.mean(hist % 2 == 0)) if len(hist) else 0.5
        logit = 4.0 * (item in hist) + 5.0 * (good - 0.5) - 1.5
        label = int(rng.random() < 1 / (1 + np.exp(-logit)))
        price = f"{rng.lognormal(1, 1):.2f}"
        user = f"u{int(rng.integers(0, 50))}"
        lines.append(f"{label},{price},{user},i{item},{'|'.join(f'i{v}' for v in hist)}")
    path.write_text("\n".join(lines) + "\n")


def clicks_job(tmp_path: Path, model: dict[str, Any], **embedding: Any) -> estuary.JobSpec:
    write_clicks(tmp_path / "clicks.csv", 3000)
    spec = {
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
            **model,
            "embedding": {
                "default": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 0.1}},
                "tables": {"hist": {"pooling": "none"}},
                **embedding,
            },
        },
        "train": {
            "batch_size": 64,
            "epochs": 3,
            "seed": 3,
            "shuffle": True,
            "dense_optimizer": {"name": "adam", "lr": 0.01},
        },
        "output": {"dir": "out", "progress": False, "checkpoint": False},
    }
    return job_from_dict(spec, tmp_path)


@pytest.mark.parametrize(
    "model",
    [
        {"type": "dlrm", "params": {"bottom_mlp": [8], "top_mlp": [16]}},
        {"type": "deepfm", "params": {"mlp": [16]}},
        {"type": "dcnv2", "params": {"cross_layers": 1, "mlp": [16]}},
    ],
    ids=["dlrm", "deepfm", "dcnv2"],
)
def test_reference_models_learn_from_an_attention_pooled_history(
    tmp_path: Path, model: dict[str, Any]
) -> None:
    trainer = estuary.Trainer(clicks_job(tmp_path, model))
    assert trainer.embeddings.sequence_features == ["hist"]
    result = trainer.fit(progress=False)
    assert result.auc > 0.62, result.auc  # chance: 0.5


def test_din_target_attention_over_a_table_shared_with_the_candidate(tmp_path: Path) -> None:
    # item and hist share table "items" with pooling: none; item has one id per
    # row, so it stays pooled and serves as DIN's query.
    model = {
        "type": "dlrm",
        "params": {
            "bottom_mlp": [8],
            "top_mlp": [16],
            "sequence_pooling": {"hist": {"type": "target_attention", "query": "item"}},
        },
    }
    job = clicks_job(
        tmp_path, model, tables={"items": {"pooling": "none"}}, shared={"items": ["item", "hist"]}
    )
    job = job_from_dict({**to_dict(job), "output": {"dir": "out", "progress": False}}, tmp_path)
    trainer = estuary.Trainer(job)
    assert trainer.embeddings.pooling == {"user": "sum", "item": "sum", "hist": "none"}
    result = trainer.fit(progress=False)
    assert result.auc > 0.75, result.auc  # history content alone: at most ~0.65
    assert result.checkpoint is not None
    restored = estuary.Trainer(job, dataset=trainer.dataset)
    restored.load_checkpoint(result.checkpoint)
    assert restored.evaluate().auc == pytest.approx(result.auc, abs=1e-9)


def test_a_custom_model_gets_the_padded_history_and_its_mask(tmp_path: Path) -> None:
    shapes: list[tuple[int, ...]] = []

    class MaskedMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1 + 3 * 8 + 8, 1)

        def forward(
            self, dense: torch.Tensor, sparse: torch.Tensor, sequences: Sequences
        ) -> torch.Tensor:
            hist = sequences["hist"]  # values (B, L, D), mask (B, L)
            shapes.append((*hist.values.shape, *hist.mask.shape))
            weights = hist.mask.float().unsqueeze(-1)  # (B, L, 1)
            mean = (hist.values * weights).sum(1) / weights.sum(1).clamp(min=1)  # (B, D)
            x = torch.cat([dense, sparse.flatten(1), mean], dim=1)
            return self.linear(x).squeeze(1)

    job = clicks_job(tmp_path, {"type": "dlrm"})
    result = estuary.Trainer(job, model=MaskedMean()).fit(progress=False)
    assert result.auc > 0.6, result.auc
    assert all(b == mb and length == ml and d == 8 for b, length, d, mb, ml in shapes)
    assert max(s[1] for s in shapes) == 8  # the longest history in a batch


def test_a_model_without_a_sequences_argument_fails_before_training(tmp_path: Path) -> None:
    class Flat(nn.Module):
        def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return sparse.sum(dim=(1, 2))

    with pytest.raises(TypeError, match="SequencePooling"):
        estuary.Trainer(clicks_job(tmp_path, {"type": "dlrm"}), model=Flat())
