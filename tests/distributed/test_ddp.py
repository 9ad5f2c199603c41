"""Two trainer processes (gloo DDP) sharing one parameter server.

Acceptance: the run ends with the same sparse tables and dense weights as a
one-process reference that, per step, computes both ranks' gradients, averages
the dense ones (as DDP does), sums the two ranks' per-id sparse gradients
(each scaled by 1/2, as the trainers push them) and applies ONE optimizer step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from estuary.cli import main
from estuary.config import JobSpec, load_job
from estuary.runtime.launcher import DistributedError, run_distributed
from estuary.train import Trainer, load_checkpoint
from estuary.train.distributed import rank_batches

from .conftest import write_job

pytestmark = pytest.mark.distributed
WORLD = 2


def reference_run(job: JobSpec) -> Trainer:
    """The summed-gradient reference, in one process with in-memory tables."""
    trainer = Trainer(job)  # same seeds: same initial model and rows as every rank
    model, embeddings = trainer.model, trainer.embeddings
    train_part, _ = trainer.dataset.split()
    params = list(model.parameters())
    t = job.train
    for epoch in range(t.epochs):
        shares = [
            rank_batches(
                train_part,
                t.batch_size,
                r,
                WORLD,
                shuffle=t.shuffle,
                seed=t.seed,
                epoch=epoch,
            )
            for r in range(WORLD)
        ]
        for batches in zip(*shares, strict=True):
            # Sync mode: both ranks look up after step t-1 landed, before step t does.
            looked_up = [embeddings.lookup(b.sparse, train=True) for b in batches]
            dense_grads, sparse_grads = [], []
            for batch, rows in zip(batches, looked_up, strict=True):
                model.train()
                embeddings.train()
                logits = model(torch.from_numpy(batch.dense), embeddings(rows))
                loss = trainer.loss_fn(logits, torch.from_numpy(batch.labels))
                model.zero_grad(set_to_none=True)
                loss.backward()
                dense_grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
                sparse_grads += embeddings.gradients()
            for p, *grads in zip(params, *dense_grads, strict=True):
                p.grad = torch.stack(grads).sum(0) / WORLD  # DDP: the mean over ranks
            trainer.optimizer.step()
            for name, table in trainer.tables.items():
                ids = np.concatenate([g.ids for g in sparse_grads if g.table == name])
                grads = np.concatenate([g.grads for g in sparse_grads if g.table == name])
                unique, inverse = np.unique(ids, return_inverse=True)
                summed = np.zeros((unique.size, table.dim), np.float32)
                np.add.at(summed, inverse, grads * np.float32(1 / WORLD))
                table.apply_gradients(unique, summed)  # ONE step per table per step
    return trainer


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {k: state[k][order] for k in ("ids", "weights", "opt.accum")}


@pytest.mark.parametrize("ps_shards", [1, 2])
def test_two_trainers_equal_one_step_of_the_summed_gradients(
    tmp_path: Path, ps_shards: int
) -> None:
    """Also with the tables split across two parameter servers (``ps_shards``)."""
    job_path = write_job(tmp_path)  # 195 train rows -> 97 per rank, 7 steps x 2 epochs
    start = time.monotonic()
    args = ["--nproc", str(WORLD), "--set", f"runtime.ps_shards={ps_shards}", "--no-progress"]
    assert main(["train", str(job_path), *args]) == 0
    wall_s = time.monotonic() - start
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["trainers"] == WORLD and summary["train_rows"] == 2 * 194
    assert summary["ps_shards"] == ps_shards
    assert summary["ps_applied_steps"] == summary["steps"] == 14  # every step, once
    assert summary["ps_duplicate_pushes"] == 0

    job = load_job(job_path)
    reference = reference_run(job)
    ckpt = load_checkpoint(tmp_path / "out" / "checkpoints")
    assert int(ckpt.manifest["step"]) == 14
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(ckpt.dense[key], value, rtol=1e-5, atol=1e-6)
    assert set(ckpt.tables) == set(reference.tables) == {"s1", "ids"}
    for name, table in reference.tables.items():
        got, want = by_id(ckpt.tables[name]), by_id(table.state_dict())
        np.testing.assert_array_equal(got["ids"], want["ids"])
        np.testing.assert_allclose(got["weights"], want["weights"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["opt.accum"], want["opt.accum"], rtol=1e-5, atol=1e-7)
    assert summary["auc"] == pytest.approx(reference.evaluate().auc, abs=1e-6)
    print(f"2-trainer run, {ps_shards} server(s): {wall_s:.1f} s")
    if ps_shards > 1:  # the split checkpoint loads into one in-memory trainer
        alone = Trainer(job)
        alone.load_checkpoint(tmp_path / "out")
        assert alone.evaluate().auc == pytest.approx(summary["auc"], abs=1e-9)


def test_a_failing_trainer_stops_the_run_with_its_rank_and_cause(tmp_path: Path) -> None:
    job_path = write_job(tmp_path)
    raw = yaml.safe_load(job_path.read_text())
    raw["data"]["sources"][0]["path"] = "missing.csv"  # each trainer reads the data itself
    job_path.write_text(yaml.safe_dump(raw))
    job = load_job(job_path)
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"trainer rank \d failed: .*missing\.csv"):
        run_distributed(job, trainers=WORLD, startup_timeout_s=60)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(("mode", "staleness"), [("hybrid", 2), ("async", 1)])
def test_two_trainers_in_hybrid_and_async_modes_apply_every_step_once(
    tmp_path: Path, mode: str, staleness: int
) -> None:
    """Background sparse work on two ranks: every step's pushes land exactly once,
    in order, and in hybrid mode no training lookup misses more than
    ``staleness`` updates (the server measures it)."""
    job_path = write_job(tmp_path, mode=mode, staleness=staleness)
    assert main(["train", str(job_path), "--nproc", str(WORLD), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mode"] == mode and summary["train_rows"] == 2 * 194
    assert summary["ps_applied_steps"] == summary["steps"] == 14
    assert summary["ps_duplicate_pushes"] == 0
    assert summary["sparse_placement"] == "background"  # remote tables: waits overlap
    if mode == "hybrid":
        assert 0 <= summary["ps_max_behind"] <= staleness
    ckpt = load_checkpoint(tmp_path / "out" / "checkpoints")
    assert int(ckpt.manifest["step"]) == 14
    for name, state in ckpt.tables.items():
        assert np.isfinite(state["weights"]).all(), name
    assert summary["logloss"] is not None and summary["logloss"] < 1.0
