"""The engine's step under update plans and per-row weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from estuary.config import load_job
from estuary.data.types import Batch
from estuary.train import Trainer
from estuary.train.engine import UpdatePlan

from .test_end_to_end import write_criteo, write_job


def trainer_and_batch(tmp_path: Path, *overrides: str) -> tuple[Trainer, Batch]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_criteo(tmp_path / "train.tsv", 200)
    job = write_job(tmp_path, tmp_path / "train.tsv", mode="sync")
    trainer = Trainer(load_job(job, overrides))
    train_part, _ = trainer.dataset.split()
    batch = next(iter(trainer.dataset.batches(train_part, 32, shuffle=False, seed=0, epoch=0)))
    return trainer, batch


def step(trainer: Trainer, batch: Batch, plan: UpdatePlan | None) -> float:
    updater = trainer.sparse_updater()
    try:
        return trainer.engine.step(batch, trainer.engine.lookup(batch), updater, plan)
    finally:
        updater.close()


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def tables(trainer: Trainer) -> dict[str, dict[str, np.ndarray]]:
    return {name: t.state_dict() for name, t in trainer.tables.items()}


def test_the_default_plan_is_the_plain_step(tmp_path: Path) -> None:
    plain, batch = trainer_and_batch(tmp_path / "a")
    planned, _ = trainer_and_batch(tmp_path / "b")
    assert step(plain, batch, None) == step(planned, batch, UpdatePlan())
    for name, value in params(plain).items():
        assert torch.equal(value, params(planned)[name]), name


def test_a_plan_freezes_parameters_and_tables_it_leaves_out(tmp_path: Path) -> None:
    trainer, batch = trainer_and_batch(tmp_path)
    names = [name for name, _ in trainer.model.named_parameters()]
    first = names[0].split(".")[0] + "."  # one submodule trains, the rest is frozen
    trainer.embeddings.lookup(batch.sparse, train=True)  # the batch's ids exist
    before, rows_before = params(trainer), tables(trainer)
    step(trainer, batch, UpdatePlan(dense={first: 1.0}, tables={}))
    after = params(trainer)
    for name in names:
        changed = not torch.equal(before[name], after[name])
        assert changed == name.startswith(first), name
    for table, state in tables(trainer).items():
        for key, value in state.items():
            if key != "step" and value.dtype.kind == "f":
                np.testing.assert_array_equal(value, rows_before[table][key], err_msg=table)


def test_a_tables_lr_scale_steps_it_as_its_optimizer_at_that_learning_rate(
    tmp_path: Path,
) -> None:
    # The job's tables: adagrad at lr 0.1 (test_end_to_end.write_job), with weight
    # decay. Plan: C1 at 0.5, C2 at 1 -> C1 moves exactly as with lr 0.05, C2 as
    # before; the other tables are left out.
    decay = "model.embedding.default.optimizer.weight_decay=0.01"
    planned, batch = trainer_and_batch(tmp_path / "a", decay)
    halved, _ = trainer_and_batch(
        tmp_path / "b", decay, "model.embedding.tables.C1={optimizer: {lr: 0.05}}"
    )
    plain, _ = trainer_and_batch(tmp_path / "c", decay)
    assert halved.job.tables["C1"].optimizer.lr == 0.1 * 0.5
    for trainer in (planned, halved, plain):
        trainer.embeddings.lookup(batch.sparse, train=True)  # the batch's ids exist
    untouched = tables(planned)
    loss = step(planned, batch, UpdatePlan(tables={"C1": 0.5, "C2": 1.0}))
    assert loss == step(halved, batch, None) == step(plain, batch, None)
    got, want, unscaled = tables(planned), tables(halved), tables(plain)
    rows = [key for key in want["C1"] if not key.startswith("delta.")]  # not the chain ids
    for key in rows:
        np.testing.assert_array_equal(got["C1"][key], want["C1"][key], err_msg=key)
        np.testing.assert_array_equal(got["C2"][key], unscaled["C2"][key], err_msg=key)
    assert not np.array_equal(got["C1"]["weights"], unscaled["C1"]["weights"])
    np.testing.assert_array_equal(got["C3"]["weights"], untouched["C3"]["weights"])


def test_a_zero_lr_scale_leaves_the_dense_parameters(tmp_path: Path) -> None:
    trainer, batch = trainer_and_batch(tmp_path)
    before = params(trainer)
    step(trainer, batch, UpdatePlan(dense={"": 0.0}))
    assert all(torch.equal(before[n], v) for n, v in params(trainer).items())
    assert trainer.optimizer.param_groups[0]["lr"] == trainer.job.train.dense_optimizer.lr


def test_row_weights_weigh_the_loss(tmp_path: Path) -> None:
    ones, batch = trainer_and_batch(tmp_path / "a")
    half, _ = trainer_and_batch(tmp_path / "b")
    weights = np.ones(batch.num_rows, np.float32)
    weighted = Batch(batch.labels, batch.dense, batch.sparse, weights=weights)
    assert step(ones, weighted, None) == step(half, batch, None)
    masked, _ = trainer_and_batch(tmp_path / "c")
    weights[::2] = 0.0  # even rows count for nothing: the mean over odd rows, x 1/2
    loss = step(masked, Batch(batch.labels, batch.dense, batch.sparse, weights=weights), None)
    odd, _ = trainer_and_batch(tmp_path / "d")
    rows = np.arange(1, batch.num_rows, 2)
    want = step(odd, batch.take(rows), None) * rows.size / batch.num_rows
    assert abs(loss - want) < 1e-5 * want


def test_fit_takes_each_batch_plan_from_plan_for(tmp_path: Path) -> None:
    trainer, _ = trainer_and_batch(tmp_path)
    before = params(trainer)
    seen: list[int] = []

    def frozen(batch: Batch) -> UpdatePlan:
        seen.append(batch.num_rows)
        return UpdatePlan(dense={})  # no parameter matches: all frozen

    trainer.plan_for = frozen
    trainer.fit(progress=False)
    assert seen and sum(seen) == trainer.job.train.epochs * trainer.dataset.split()[0].num_rows
    assert all(torch.equal(before[n], v) for n, v in params(trainer).items())


@pytest.mark.parametrize("scale", [-1.0, float("nan"), float("inf")])
def test_a_plan_refuses_negative_or_non_finite_scales(scale: float) -> None:
    with pytest.raises(ValueError, match=r"UpdatePlan.tables\['C1'\]: .* finite and >= 0"):
        UpdatePlan(tables={"C1": scale})
    with pytest.raises(ValueError, match=r"UpdatePlan.dense\['tower.'\]"):
        UpdatePlan(dense={"tower.": scale})
