"""``train.precision`` (bf16 autocast), ``train.device`` and
``train.sparse_placement``: the dense part runs where and how the job says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from estuary.config import ConfigError, load_job
from estuary.train import Trainer
from estuary.train.trainer import resolve_device

from .test_end_to_end import write_criteo, write_job


class RecordingModel(nn.Module):
    """Logistic regression over pooled embeddings that records the dtype of its
    matmul output: bfloat16 under autocast, float32 without."""

    def __init__(self, num_dense: int, num_sparse: int, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_dense + num_sparse * dim, 1)
        self.seen: set[torch.dtype] = set()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        out = self.linear(torch.cat([dense, sparse.flatten(1)], dim=1))
        self.seen.add(out.dtype)
        return out.squeeze(1)


def train(tmp_path: Path, rows: int = 1500, **train: object) -> tuple[Trainer, float]:
    write_criteo(tmp_path / "train.tsv", rows)
    job = load_job(write_job(tmp_path, tmp_path / "train.tsv", **train))
    trainer = Trainer(job)
    result = trainer.fit(progress=False)
    return trainer, result.auc


def test_bf16_trains_under_autocast_and_keeps_float32_state(tmp_path: Path) -> None:
    write_criteo(tmp_path / "train.tsv", 400)
    job = load_job(write_job(tmp_path, tmp_path / "train.tsv", precision="bf16", epochs=1))
    model = RecordingModel(13, 26, 8)
    trainer = Trainer(job, model)
    result = trainer.fit(progress=False)
    assert model.seen == {torch.bfloat16}  # forward ran under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = trainer.tables["C1"].state_dict()
    assert state["weights"].dtype.name == "float32"
    assert result.extra["precision"] == "bf16"
    assert result.eval is not None and 0.0 <= result.auc <= 1.0


def test_bf16_learns_as_well_as_fp32(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, auc_fp32 = train(tmp_path / "a")
    _, auc_bf16 = train(tmp_path / "b", precision="bf16")
    assert auc_fp32 > 0.65  # the label depends on C1 and I1
    assert abs(auc_bf16 - auc_fp32) < 0.02, (auc_fp32, auc_bf16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"train\.device: 'cuda' requested but torch sees no"):
        resolve_device("cuda")
    write_criteo(tmp_path / "train.tsv", 50)
    job = load_job(write_job(tmp_path, tmp_path / "train.tsv", device="cuda"))
    with pytest.raises(ValueError, match=r"train\.device"):
        Trainer(job)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dense_model_matches_cpu(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "gpu").mkdir()
    _, auc_cpu = train(tmp_path / "cpu")
    trainer, auc_gpu = train(tmp_path / "gpu", device="cuda")
    assert next(trainer.model.parameters()).is_cuda
    assert abs(auc_gpu - auc_cpu) < 0.01, (auc_cpu, auc_gpu)


@pytest.mark.parametrize("placement", ["inline", "background"])
def test_sparse_placement_can_be_forced(tmp_path: Path, placement: str) -> None:
    write_criteo(tmp_path / "train.tsv", 300)
    job = load_job(
        write_job(
            tmp_path, tmp_path / "train.tsv", mode="hybrid", staleness=2, sparse_placement=placement
        )
    )
    result = Trainer(job).fit(progress=False)
    assert result.extra["sparse_placement"] == placement
    assert result.extra["max_staleness_seen"] <= 2


def test_background_placement_is_refused_in_sync_mode(tmp_path: Path) -> None:
    write_criteo(tmp_path / "train.tsv", 10)
    path = write_job(tmp_path, tmp_path / "train.tsv", sparse_placement="background")
    with pytest.raises(ConfigError, match=r"train\.sparse_placement"):
        load_job(path)
