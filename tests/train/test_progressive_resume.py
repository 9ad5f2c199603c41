"""Progressive evaluation survives a resume: its figures (and the seen-ids
bitmap) are saved with each checkpoint, so a stopped and resumed run reports
what an uninterrupted one does; an older checkpoint without them still resumes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from estuary.data.synthetic import SynthOutput, write_synthetic
from estuary.data.types import Batch, JaggedIds
from estuary.metrics import progressive_groups
from estuary.metrics.progressive import ProgressiveStats
from estuary.train import Trainer, TrainingStopped, checkpointer
from estuary.train.callbacks import FaultInjection, LoopState
from estuary.train.checkpoint import MANIFEST, read_extra
from estuary.train.pending_scores import PendingScores
from estuary.train.progressive import CHECKPOINT_NAME, HELD_NEW, ProgressiveEval, SeenIds

from .test_progressive_eval import ROWS, STEADY, job_for

STOP_AT = 130  # of 240 steps (50 rows each): in hour 3, before the burst of new ids


def stop(state: LoopState) -> None:  # arrives mid-step: the step completes, then a checkpoint
    state.stop.request("SIGTERM")


def stopped_run(root: Path) -> Path:
    """Train ``root``'s job until ``STOP_AT``; the stop's checkpoint folder."""
    trainer = Trainer(job_for(root), callbacks=[FaultInjection(stop, at_step=STOP_AT)])
    with pytest.raises(TrainingStopped) as info:
        trainer.fit(progress=False)
    assert info.value.step == STOP_AT and info.value.checkpoint is not None
    return Path(info.value.checkpoint)


def resumed_report(root: Path, checkpoint: Path) -> dict[str, Any]:
    trainer = Trainer(job_for(root))
    trainer.load_checkpoint(checkpoint)
    report: dict[str, Any] = trainer.fit(progress=False).extra["progressive"]
    return report


def without_lag(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "lag_s"}


def test_a_stopped_and_resumed_run_reports_what_an_uninterrupted_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small bounds, so the saved state has every kind of group: rows kept, a
    # histogram (origins, windows past 1,000 rows), folded windows (all but 2).
    monkeypatch.setattr(progressive_groups, "EXACT_ROWS", 1000)
    monkeypatch.setattr(progressive_groups, "OPEN_WINDOWS", 2)
    write_synthetic(STEADY, tmp_path / "data", SynthOutput(format="criteo_tsv"))
    want = Trainer(job_for(tmp_path)).fit(progress=False).extra["progressive"]
    checkpoint = stopped_run(tmp_path)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert CHECKPOINT_NAME in manifest["extras"]
    got = resumed_report(tmp_path, checkpoint)
    assert got["rows"] == want["rows"] == STEADY.hours * ROWS
    assert without_lag(got) == without_lag(want)  # every window and origin, new_ids too
    # The lag is wall time minus January 2026: the two runs' differ by seconds.
    for q in ("p50", "p99"):
        assert got["lag_s"][q] == pytest.approx(want["lag_s"][q], rel=0.01)


def test_a_checkpoint_without_progressive_state_resumes_with_the_figures_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_synthetic(STEADY, tmp_path / "data", SynthOutput(format="criteo_tsv"))
    checkpoint = stopped_run(tmp_path)
    # An older checkpoint: written before the state was saved (no extra file).
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest.pop("extras")
    manifest["files"] = {k: v for k, v in manifest["files"].items() if "extra/" not in k}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="estuary.train.progressive"):
        got = resumed_report(tmp_path, checkpoint)
    assert got["rows"] == STEADY.hours * ROWS - STOP_AT * 50  # the rows after the resume
    afresh = [r for r in caplog.records if "start afresh" in r.getMessage()]
    assert len(afresh) == 1


def test_a_checkpoints_progressive_state_is_read_only_by_a_run_that_claims_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume holds none of the saved figures until an owner claims them: a run
    with progressive evaluation off (or a rank other than 0) never reads them."""
    write_synthetic(STEADY, tmp_path / "data", SynthOutput(format="criteo_tsv"))
    checkpoint = stopped_run(tmp_path)
    reads: list[str] = []

    def counted(folder: Path, name: str) -> dict[str, torch.Tensor]:
        reads.append(name)
        return read_extra(folder, name)

    monkeypatch.setattr(checkpointer, "read_extra", counted)
    off = Trainer(job_for(tmp_path, progressive_eval=False))
    off.load_checkpoint(checkpoint)
    off.fit(progress=False)
    assert reads == []
    on = Trainer(job_for(tmp_path))
    on.load_checkpoint(checkpoint)
    assert reads == []  # read when fit claims it, not on load
    assert on.fit(progress=False).extra["progressive"]["rows"] == STEADY.hours * ROWS
    assert reads == [CHECKPOINT_NAME]


def test_the_seen_ids_bitmap_is_saved_sparse_when_few_ids_and_restores_either_way() -> None:
    rng = np.random.default_rng(0)
    for ids in (100, 5000):  # 2**12 bits: 512 bytes, sparse below ~102 set bytes
        seen = SeenIds(bits=12)
        seen.first_seen(rng.integers(0, 2**62, ids, dtype=np.int64))
        state = seen.state()
        assert ("at" in state) == (ids == 100)
        again = SeenIds(bits=12)
        assert again.restore(state)
        np.testing.assert_array_equal(again.bitmap, seen.bitmap)
    assert not SeenIds(bits=16).restore(state)  # another size: refused, left empty


def test_an_unreadable_progressive_state_starts_the_figures_afresh_without_failing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats = ProgressiveStats("all rows")
    stats.record(
        (0, 3600), ["hist/a"], np.array([0, 1], np.int8), np.array([0.2, 0.7], np.float32), 1.0
    )
    progressive = ProgressiveEval(cast(Any, None), stats)
    saved = progressive.checkpoint_state()
    saved["stats.index"] = torch.from_numpy(np.frombuffer(b'{"format": 99}', np.uint8).copy())
    fresh = ProgressiveEval(cast(Any, None), ProgressiveStats("all rows"))
    with caplog.at_level(logging.WARNING, logger="estuary.train.progressive"):
        fresh.restore_state(saved)
    assert fresh.stats.rows == 0
    assert any("format 99" in r.getMessage() for r in caplog.records)
    fresh.restore_state(progressive.checkpoint_state())  # a readable one goes on from it
    assert fresh.stats.report() == stats.report()


def test_a_row_read_again_stays_held_new_in_a_checkpoint_taken_as_it_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row that waited in the buffer at a checkpoint and held a new id is read
    again after the resume; in hybrid/async mode it arrives on the read-ahead
    thread while a checkpoint may be taken. A checkpoint just before or just
    after its scores are held still lists it as held new."""
    rows = np.arange(10, dtype=np.int64)
    batch = Batch(
        labels=np.zeros(10, np.float32),
        dense=np.zeros((10, 1), np.float32),
        sparse={"C1": JaggedIds.single(rows + 1_000)},
        row_ids=rows,
    )
    probs = np.full(10, 0.5, np.float32)
    first = ProgressiveEval(cast(Any, None), ProgressiveStats("all rows"))
    first.hold_scores(batch, probs)  # every row holds a new id, and waits
    resumed = ProgressiveEval(cast(Any, None), ProgressiveStats("all rows"))
    resumed.restore_state(first.checkpoint_state())
    captured: list[set[int]] = []
    hold = PendingScores.hold

    def holding(self: PendingScores, *args: Any, **kwargs: Any) -> None:
        captured.append(set(resumed.checkpoint_state()[HELD_NEW].tolist()))
        hold(self, *args, **kwargs)
        captured.append(set(resumed.checkpoint_state()[HELD_NEW].tolist()))

    monkeypatch.setattr(PendingScores, "hold", holding)
    resumed.hold_scores(batch, probs)  # read again
    assert captured == [set(rows.tolist())] * 2
    assert set(resumed.checkpoint_state()[HELD_NEW].tolist()) == set(rows.tolist())
