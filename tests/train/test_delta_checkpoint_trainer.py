"""The trainer writes checkpoint chains (``output.checkpoint_full_every``): a
``data.dataset`` run's delta checkpoints restore tables (optimizer state
included), dense model, optimizer, step and data progress exactly as a full
checkpoint at the same step does, into any shard count; ``estuary train
--resume`` continues a chain and ``estuary eval`` reads one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from estuary.cli import main
from estuary.config import load_job
from estuary.train import Trainer
from estuary.train.checkpoint import load_checkpoint
from estuary.train.checkpoint_chain import CheckpointKind, list_checkpoints

from .test_delta_checkpoint import by_id

State = dict[str, np.ndarray]
COLUMNS = ["label", "I1", "I2", "C1", "C2"]
PATTERN = "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv"
HOURS, ROWS, BATCH, EVERY, FULL_EVERY = 3, 100, 16, 2, 4


def write_hours(root: Path) -> None:
    """``HOURS`` hourly partitions of ``ROWS`` rows each (``COLUMNS``, no header);
    C1 comes from a hot set, C2 from a wide one, so most rows stay untouched
    between checkpoints."""
    rng = np.random.default_rng(0)
    for hour in range(HOURS):
        folder = root / "data" / "20260101" / f"{hour:02d}"
        folder.mkdir(parents=True)
        lines = []
        for _ in range(ROWS):
            c1, c2 = int(rng.integers(0, 30)), int(rng.integers(0, 5000))
            label = int(rng.random() < (0.8 if c1 % 3 == 0 else 0.1))
            lines.append(f"{label}\t{rng.integers(0, 9)}\t{rng.integers(0, 4)}\t{c1:x}\t{c2:x}")
        (folder / "part-00000.tsv").write_text("\n".join(lines) + "\n")
        (folder / "_SUCCESS").write_text("")


def write_job(root: Path, shards: int = 2, **output: Any) -> Path:
    source = {
        "name": "a",
        "path": PATTERN,
        "columns": COLUMNS,
        "start": "2026-01-01T00",
        "end": f"2026-01-01T{HOURS:02d}",
    }
    job = {
        "data": {
            "schema": {"dense": ["I1", "I2"], "sparse": ["C1", "C2"]},
            "dataset": {
                "streams": {"s": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 5},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4, "shards": shards, "optimizer": {"name": "adam"}}},
        },
        "train": {"batch_size": BATCH, "seed": 0, "threads": 1},
        "output": {
            "dir": "out",
            "progress": False,
            "checkpoint_every_steps": EVERY,
            "checkpoint_full_every": FULL_EVERY,
            **output,
        },
    }
    path = root / f"job-{shards}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def assert_same_trainer(got: Trainer, want: Trainer) -> None:
    """Tables (rows, optimizer slots, eviction fields, pending ids), dense model,
    dense optimizer, step and data progress."""
    assert got.step == want.step and got.epoch == want.epoch
    assert got.data_progress == want.data_progress
    for name, table in want.tables.items():
        a = by_id(got.tables[name].state_dict(mark_clean=False))  # type: ignore[call-arg]
        b = by_id(table.state_dict(mark_clean=False))  # type: ignore[call-arg]
        assert set(a) == set(b) and any(k.startswith("opt.") for k in b)
        for key, value in b.items():
            np.testing.assert_array_equal(a[key], value, err_msg=f"{name}.{key}")
    for key, value in want.model.state_dict().items():
        torch.testing.assert_close(got.model.state_dict()[key], value, rtol=0, atol=0)
    got_opt, want_opt = got.optimizer.state_dict(), want.optimizer.state_dict()
    for param_id, slots in want_opt["state"].items():
        for key, value in slots.items():
            torch.testing.assert_close(got_opt["state"][param_id][key], value, rtol=0, atol=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trainer]:
    """One ``data.dataset`` run: a checkpoint every 2 steps, every 4th one full."""
    root = tmp_path_factory.mktemp("delta-run")
    write_hours(root)
    trainer = Trainer(load_job(write_job(root)))
    trainer.fit(progress=False)
    return root, trainer


def test_run_writes_full_and_delta_checkpoints_and_keeps_their_bases(
    run: tuple[Path, Trainer],
) -> None:
    root, trainer = run
    folder = root / "out" / "checkpoints"
    final = load_checkpoint(folder)
    assert final.manifest["step"] == trainer.step
    assert final.kind is CheckpointKind.DELTA  # 19 steps: F2 d4 d6 d8 F10 d12 d14 d16 F18 d19
    kept = list_checkpoints(folder)
    needed = {name for p in kept[-2:] for name in load_checkpoint(p).manifest["chain"]}
    assert needed <= {p.name for p in kept}
    for path in kept:
        ckpt = load_checkpoint(path)
        assert ckpt.chain[0].name == ckpt.manifest["chain"][0]
        assert len(ckpt.chain) <= FULL_EVERY
    full = [p for p in kept if load_checkpoint(p).kind is CheckpointKind.FULL][-1]
    sizes = {p.name: (p / "tables" / "C2.safetensors").stat().st_size for p in (full, final.path)}
    assert sizes[final.path.name] < sizes[full.name] / 3, sizes


@pytest.mark.parametrize("shards", [2, 3])
def test_delta_checkpoint_restores_what_a_full_one_at_the_same_step_holds(
    run: tuple[Path, Trainer], shards: int, tmp_path: Path
) -> None:
    root, trainer = run
    from_delta = Trainer(load_job(write_job(root, shards)))
    from_delta.load_checkpoint(root / "out")  # latest: a delta
    full_path = trainer.save_checkpoint(tmp_path / "full")  # elsewhere: always full
    assert load_checkpoint(full_path).kind is CheckpointKind.FULL
    from_full = Trainer(load_job(write_job(root, shards)))
    from_full.load_checkpoint(full_path)
    assert_same_trainer(from_delta, from_full)
    if shards == 2:  # the shard count it was written with: the live state itself
        assert_same_trainer(from_delta, trainer)
    assert from_delta.checkpoint_link is not None
    assert list(from_delta.checkpoint_link.chain) == load_checkpoint(root / "out").manifest["chain"]


def write_criteo(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    lines = ["label,d1,s1,s2"]
    for _ in range(rows):
        s1 = int(rng.integers(0, 20))
        label = int(rng.random() < (0.8 if s1 % 3 == 0 else 0.2))
        lines.append(f"{label},{rng.integers(0, 9)},a{s1},b{rng.integers(0, 3000)}")
    path.write_text("\n".join(lines) + "\n")


def test_resume_writes_a_delta_that_eval_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_criteo(tmp_path / "train.csv", 600)
    job = {
        "data": {
            "sources": [{"path": "train.csv", "format": "csv"}],
            "schema": {"label": "label", "dense": ["d1"], "sparse": ["s1", "s2"]},
            "eval_fraction": 0.25,
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": 32, "epochs": 1, "seed": 2, "threads": 1},
        "output": {"dir": "out", "progress": False, "checkpoint_full_every": 2},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["train", str(path), "--no-progress"]) == 0
    first = load_checkpoint(tmp_path / "out")
    assert first.kind is CheckpointKind.FULL
    # A second epoch on top: written as a delta of the first run's checkpoint.
    args = ["train", str(path), "--no-progress", "--resume", "--set", "train.epochs=2"]
    assert main(args) == 0
    second = load_checkpoint(tmp_path / "out")
    assert second.kind is CheckpointKind.DELTA and second.chain == [first.path, second.path]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    capsys.readouterr()
    assert main(["eval", str(path), "--checkpoint", str(tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["auc"] == pytest.approx(summary["auc"], abs=1e-9)
    assert printed["logloss"] == pytest.approx(summary["logloss"], abs=1e-9)


def test_a_delta_checkpoints_tables_are_its_own_state_not_its_bases(
    run: tuple[Path, Trainer], tmp_path: Path
) -> None:
    """``Checkpoint.tables`` (what serving and users read) replays the chain."""
    root, trainer = run
    delta = load_checkpoint(root / "out")
    assert delta.kind is CheckpointKind.DELTA
    full = load_checkpoint(trainer.save_checkpoint(tmp_path / "full"))
    assert set(delta.tables) == set(full.tables) == {"C1", "C2"}
    for name, want in full.tables.items():
        a, b = by_id(delta.tables[name]), by_id(want)
        assert set(a) == set(b)
        for key, value in b.items():
            np.testing.assert_array_equal(a[key], value, err_msg=f"{name}.{key}")
        # and not the chain's full checkpoint's stale rows
        assert not np.array_equal(by_id(delta.base_tables[name])["weights"], b["weights"])
