"""Train your own torch module on Estuary's embedding tables (Criteo sample).

python examples/custom_model.py
"""

from pathlib import Path

import torch
from torch import nn

import estuary

DATA = Path(__file__).resolve().parents[2] / "shared/data/criteo_dac_sample_34k.tsv.gz"


class TwoTower(nn.Module):
    """Any module with forward(dense (B, Dd), sparse (B, F, D)) -> logits (B,)."""

    def __init__(self, num_dense: int, num_sparse: int, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_dense + num_sparse * dim, 128), nn.ReLU(), nn.Linear(128, 1)
        )

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([dense, sparse.flatten(1)], dim=1)).squeeze(1)


job = estuary.job_from_dict(
    {
        "data": {
            "sources": [{"path": str(DATA), "format": "criteo_tsv"}],
            "schema": {
                "dense": [f"I{i}" for i in range(1, 14)],  # declare the features
                "sparse": [f"C{i}" for i in range(1, 27)],
            },
        },
        "model": {"embedding": {"default": {"dim": 8, "admission": {"min_count": 2}}}},
        "train": {"batch_size": 256, "epochs": 1},
        "output": {"dir": "runs/custom", "checkpoint": False},
    }
)
result = estuary.Trainer(job, model=TwoTower(13, 26, 8)).fit()
print(f"eval AUC {result.auc:.4f}  logloss {result.logloss:.4f}")
