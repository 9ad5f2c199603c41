"""``output.checkpoint_every_steps`` on a ``data.sources`` job: a run that dies
mid-epoch and resumes from its newest checkpoint ends exactly where an
uninterrupted run does (tables, optimizer state, dense weights, AUC)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from estuary.config import load_job
from estuary.train import Trainer, TrainingStopped
from estuary.train.callbacks import FaultInjection, LoopState
from estuary.train.checkpoint import load_checkpoint
from estuary.train.checkpoint_chain import list_checkpoints

from .test_end_to_end import write_criteo, write_job


class Crash(RuntimeError):
    pass


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {k: np.asarray(state[k])[order] for k in ("ids", "weights", "opt.accum")}


@pytest.mark.parametrize(("mode", "full_every"), [("sync", 1), ("hybrid", 3)])
def test_a_run_killed_mid_epoch_resumes_to_the_uninterrupted_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, full_every: int
) -> None:
    write_criteo(tmp_path / "train.tsv", 700)  # 560 train rows: 9 steps of 64 per epoch
    # Inline placement: hybrid's prefetch path, with deterministic update timing.
    settings = {"mode": mode, "staleness": 2, "threads": 1, "shuffle": True}
    if mode == "hybrid":
        settings["sparse_placement"] = "inline"
    path = write_job(tmp_path, tmp_path / "train.tsv", **settings)
    job = load_job(path)
    reference = Trainer(job)
    want = reference.fit(progress=False)

    output = {"checkpoint_every_steps": 4, "checkpoint_full_every": full_every}
    job = load_job(
        path,
        overrides=[f"output.dir={tmp_path / 'crashed'}"]
        + [f"output.{k}={v}" for k, v in output.items()],
    )

    def crash(state: LoopState) -> None:  # dies in epoch 2 (steps 10-18), after checkpoint 12
        raise Crash

    crashed = Trainer(job, callbacks=[FaultInjection(crash, at_step=14)])
    with pytest.raises(Crash):
        crashed.fit(progress=False)
    folder = tmp_path / "crashed" / "checkpoints"
    newest = load_checkpoint(folder)
    assert newest.manifest["step"] == 12
    assert newest.manifest["metadata"]["epoch"] == 1
    assert newest.manifest["metadata"]["epoch_step"] == 3
    assert len(list_checkpoints(folder)) <= 2 + full_every  # older ones pruned

    resumed = Trainer(job)
    resumed.load_checkpoint(folder)
    got = resumed.fit(progress=False)
    assert resumed.step == reference.step == 18
    assert got.train_rows == want.train_rows - (560 + 3 * 64)  # only the rest was trained
    for name, table in reference.tables.items():
        a, b = by_id(resumed.tables[name].state_dict()), by_id(table.state_dict())
        for key, value in b.items():
            np.testing.assert_allclose(a[key], value, rtol=1e-6, atol=1e-7, err_msg=name)
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert got.auc == pytest.approx(want.auc, abs=1e-6)


def test_a_requested_stop_checkpoints_its_step_and_resumes_to_the_uninterrupted_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Trainer.request_stop is what `estuary train` calls on SIGTERM / SIGINT.
    write_criteo(tmp_path / "train.tsv", 700)  # 9 steps of 64 per epoch, 2 epochs
    path = write_job(tmp_path, tmp_path / "train.tsv", mode="sync", threads=1, shuffle=True)
    reference = Trainer(load_job(path))
    want = reference.fit(progress=False)

    job = load_job(path, overrides=[f"output.dir={tmp_path / 'stopped'}"])

    def stop(state: LoopState) -> None:  # arrives mid-step: the step completes
        state.stop.request("SIGTERM")

    stopped = Trainer(job, callbacks=[FaultInjection(stop, at_step=13)])
    with pytest.raises(TrainingStopped) as info:
        stopped.fit(progress=False)
    assert info.value.step == 13 and info.value.reason == "SIGTERM"
    assert info.value.checkpoint is not None
    saved = load_checkpoint(info.value.checkpoint)
    assert saved.manifest["step"] == 13
    assert (saved.manifest["metadata"]["epoch"], saved.manifest["metadata"]["epoch_step"]) == (1, 4)

    resumed = Trainer(job)
    resumed.load_checkpoint(tmp_path / "stopped")
    got = resumed.fit(progress=False)
    assert resumed.step == reference.step == 18
    assert got.train_rows == want.train_rows - (560 + 4 * 64)
    for name, table in reference.tables.items():
        a, b = by_id(resumed.tables[name].state_dict()), by_id(table.state_dict())
        for key, value in b.items():
            np.testing.assert_allclose(a[key], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert got.auc == pytest.approx(want.auc, abs=1e-6)
