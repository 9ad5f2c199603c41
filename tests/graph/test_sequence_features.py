"""Sequence (multi-id) features through ``data.dataset``: the task graph's batches
carry the same bags as ``TabularDataset`` (one declared pipeline, so offline and
online cannot drift), whole through the shuffle buffer, and a job trains on them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from estuary.config import job_from_dict
from estuary.data import TabularDataset
from estuary.data.graph import Driver
from estuary.data.graph.progress import ROW_BITS
from estuary.data.graph.shuffle import RowBuffer
from estuary.data.types import JaggedIds

from .conftest import hour_dir

HEADER = "label,I1,C1,hist"
FEATURES = [{"name": "h", "kind": "sequence", "columns": ["hist"], "max_length": 3}]
SCHEMA = {"dense": ["I1"], "sparse": ["C1"], "features": FEATURES}


def write_rows(root: Path, hours: int = 2, rows: int = 40) -> dict[str, list[str]]:
    """CSV partitions with a ``|``-separated ``hist``; every 9th row is bad."""
    rng = np.random.default_rng(0)
    written: dict[str, list[str]] = {}
    for hour in range(hours):
        folder = hour_dir(root, hour)
        folder.mkdir(parents=True)
        lines = []
        for i in range(rows):
            items = "|".join(f"i{v}" for v in rng.integers(0, 30, size=int(rng.integers(0, 6))))
            label = "7" if i % 9 == 8 else str(int(rng.random() < 0.4))
            lines.append(f"{label},{int(rng.integers(0, 9))},c{i % 5},{items}")
        (folder / "part-0.csv").write_text("\n".join([HEADER, *lines]) + "\n")
        (folder / "_SUCCESS").write_text("")
        written[(folder / "part-0.csv").relative_to(root).as_posix()] = lines
    return written


def data_section(**dataset: Any) -> dict[str, Any]:
    source = {
        "name": "a",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.csv",
        "format": "csv",
        "start": "2026-01-01T00",
        "end": "2026-01-01T02",
    }
    return {
        "schema": SCHEMA,
        "max_bad_row_ratio": 0.3,
        "dataset": {
            "streams": {"s": {"sources": [source]}},
            "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 2},
            **dataset,
        },
    }


def dataset_spec(root: Path, **dataset: Any) -> Any:
    return job_from_dict({"data": data_section(**dataset)}, base_dir=root)


def bags_by_row(driver: Driver, batches: list[Any]) -> dict[tuple[str, int], list[int]]:
    """(file, line) -> the row's ``h`` ids, from the batches' row ids."""
    out: dict[tuple[str, int], list[int]] = {}
    for batch in batches:
        bag = batch.sparse["h"]
        for r, row_id in enumerate(batch.row_ids):
            who = driver.progress.row_identity(int(row_id))
            out[(who.split, who.row)] = bag.values[bag.offsets[r] : bag.offsets[r + 1]].tolist()
    return out


def test_dataset_batches_carry_the_same_bags_as_tabular_dataset(tmp_path: Path) -> None:
    written = write_rows(tmp_path)
    # Offline: the same files through data.sources (TabularDataset).
    sources = [{"path": path, "format": "csv"} for path in written]
    offline_spec = job_from_dict(
        {"data": {"sources": sources, "schema": SCHEMA, "eval_fraction": 0.0,
                  "max_bad_row_ratio": 0.3}},
        base_dir=tmp_path,
    )  # fmt: skip
    offline = TabularDataset(offline_spec.data, tmp_path)
    expected = offline.take(np.arange(offline.num_rows)).sparse["h"]

    job = dataset_spec(tmp_path)
    driver = Driver(job.data, tmp_path, batch_size=7, shuffle=False)
    batches = list(driver.batches())
    assert list(batches[0].sparse) == ["C1", "h"]  # model order, as TabularDataset
    values = np.concatenate([b.sparse["h"].values for b in batches])
    lengths = np.concatenate([np.diff(b.sparse["h"].offsets) for b in batches])
    np.testing.assert_array_equal(values, expected.values)
    np.testing.assert_array_equal(lengths, np.diff(expected.offsets))
    assert int(lengths.max()) == 3  # max_length

    # Shuffled (buffer + interleave): every row keeps its own bag.
    in_order = bags_by_row(driver, batches)
    shuffle = {"buffer_rows": 15, "interleave_splits": 2}
    job = dataset_spec(tmp_path, shuffle=shuffle, executor={"workers": 2})
    driver = Driver(job.data, tmp_path, batch_size=4, seed=3)
    shuffled = list(driver.batches())
    assert bags_by_row(driver, shuffled) == in_order
    rows = np.concatenate([b.row_ids & ((1 << ROW_BITS) - 1) for b in shuffled])
    assert not np.all(np.diff(rows) > 0)  # really shuffled


def test_row_buffer_keeps_each_rows_bag_through_draws_and_compaction() -> None:
    rng = np.random.default_rng(1)
    buffer = RowBuffer(1, 1, 50, np.random.default_rng(2), num_sequences=2)
    truth: dict[int, tuple[list[int], list[int]]] = {}
    next_id = 0
    seen = 0
    for _ in range(60):  # far more ids than the first pool holds: compactions happen
        n = int(rng.integers(1, 30))
        bags = []
        for _s in range(2):
            lengths = rng.integers(0, 40, size=n)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            bags.append(JaggedIds(rng.integers(0, 1 << 40, size=int(offsets[-1])), offsets))
        row_ids = np.arange(next_id, next_id + n, dtype=np.int64)
        for r, row in enumerate(row_ids):
            truth[int(row)] = tuple(  # type: ignore[assignment]
                b.values[b.offsets[r] : b.offsets[r + 1]].tolist() for b in bags
            )
        next_id += n
        buffer.add(np.zeros(n, np.float32), np.zeros((n, 1), np.float32),
                   np.zeros((n, 1), np.int64), row_ids, bags)  # fmt: skip
        while buffer.ready(8) or (len(buffer) and rng.random() < 0.1):
            seen += check_batch(buffer, truth)
    while len(buffer):
        seen += check_batch(buffer, truth)
    assert not truth and seen == next_id


def check_batch(buffer: RowBuffer, truth: dict[int, tuple[list[int], list[int]]]) -> int:
    """Take a batch; every row's bags must be the ones it was added with."""
    *_, rows, bags = buffer.take(8)
    for r, row in enumerate(rows):
        pair = tuple(b.values[b.offsets[r] : b.offsets[r + 1]].tolist() for b in bags)
        assert pair == truth.pop(int(row))
    return len(rows)


def test_a_dataset_job_with_a_sequence_feature_trains(tmp_path: Path) -> None:
    import estuary

    write_rows(tmp_path)
    job = job_from_dict(
        {
            "data": data_section(shuffle={"buffer_rows": 10}),
            "model": {
                "type": "dlrm",
                "params": {"bottom_mlp": [4], "top_mlp": [4]},
                "embedding": {"default": {"dim": 4}, "tables": {"h": {"pooling": "mean"}}},
            },
            "train": {"batch_size": 8, "seed": 0},
            "output": {"dir": "out", "progress": False, "checkpoint_every_steps": 4},
        },
        base_dir=tmp_path,
    )
    trainer = estuary.Trainer(job)
    assert trainer.features == ["C1", "h"]
    result = trainer.fit(progress=False)
    good = 2 * 40 - 2 * 4  # rows 9, 18, 27, 36 of each file are bad
    assert result.train_rows == good
    assert result.extra["rows_committed"] == good and result.extra["duplicate_rows"] == 0
    assert len(trainer.tables["h"]) >= 20  # i0..i29 mostly seen
