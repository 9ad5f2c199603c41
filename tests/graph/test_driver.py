"""Driver + executors: the same rows and ids as ``TabularDataset``, seeded shuffle,
retries without repeats, task states, backpressure, process executors, row ranges."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from estuary.config import JobSpec, job_from_dict
from estuary.data import TabularDataset
from estuary.data.formats import RawChunk
from estuary.data.graph import Driver, FileSource, Split, TaskFailedError, TaskState
from estuary.data.types import Batch

from .conftest import COLUMNS, PATTERN, SCHEMA, dataset_job, hour_dir, source, write_hours


def concat(batches: list[Batch]) -> dict[str, np.ndarray]:
    return {
        "labels": np.concatenate([b.labels for b in batches]),
        "dense": np.concatenate([b.dense for b in batches]),
        "C1": np.concatenate([b.sparse["C1"].values for b in batches]),
        "C2": np.concatenate([b.sparse["C2"].values for b in batches]),
        "rows": np.concatenate([b.row_ids for b in batches]) & 0xFFFFFFFF,
    }


def test_rows_and_ids_equal_the_tabular_dataset(tmp_path: Path) -> None:
    written = write_hours(tmp_path, 3, 40, files=2, bad_every=9)
    job = dataset_job(tmp_path, {"s": {"sources": [source(hours=3)]}})
    driver = Driver(job.data, tmp_path, batch_size=16)
    got = concat(list(driver.batches()))
    table = job_from_dict(
        {
            "data": {
                "schema": SCHEMA,
                "sources": [{"path": "data/*/*/part-*.tsv", "columns": COLUMNS}],
                "eval_fraction": 0,
                "max_bad_row_ratio": 0.2,
            }
        },
        tmp_path,
    )
    expected = TabularDataset(table.data, tmp_path).part("all").to_batch()
    np.testing.assert_array_equal(got["labels"], expected.labels)
    np.testing.assert_array_equal(got["dense"], expected.dense)
    for feature in ("C1", "C2"):
        np.testing.assert_array_equal(got[feature], expected.sparse[feature].values)
    good_lines = [line for lines in written.good.values() for line in lines]
    np.testing.assert_array_equal(got["rows"], good_lines)  # row number = line in the file
    assert driver.bad_rows.count == 6 * 4  # lines 9, 18, 27, 36 of each of 6 files
    assert str(driver.bad_rows.examples[0]) == (
        "data/20260101/00/part-00000.tsv:9: field label: '7' is not 0 or 1"
    )
    assert set(driver.task_states.values()) == {TaskState.SUCCEEDED}
    assert all(state.is_terminal for state in driver.task_states.values())
    assert not TaskState.RUNNING.is_terminal


def shuffled(tmp_path: Path, seed: int, buffer_rows: int = 50) -> dict[str, np.ndarray]:
    shuffle = {"buffer_rows": buffer_rows, "interleave_splits": 2, "seed": seed}
    job = dataset_job(
        tmp_path,
        {"s": {"sources": [source(hours=3)]}},
        dataset={"shuffle": shuffle, "executor": {"block_size_bytes": 256}},
    )
    return concat(list(Driver(job.data, tmp_path, batch_size=8).batches()))


def test_shuffle_is_seeded_and_keeps_every_row_once(tmp_path: Path) -> None:
    write_hours(tmp_path, 3, 60, files=2)
    plain = shuffled(tmp_path, 0, buffer_rows=0)
    first, again, other = shuffled(tmp_path, 1), shuffled(tmp_path, 1), shuffled(tmp_path, 2)
    np.testing.assert_array_equal(first["C1"], again["C1"])  # same seed: same order
    assert not np.array_equal(first["C1"], other["C1"])
    assert not np.array_equal(first["C1"], plain["C1"])
    for run in (first, other):
        assert sorted(run["C1"].tolist()) == sorted(plain["C1"].tolist())
        assert run["rows"].shape == plain["rows"].shape


class FlakySource(FileSource):
    """Fails mid-file on the first ``failures`` attempts of each split."""

    failures = 1
    chunks_read = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.attempts: dict[str, int] = {}

    def read(
        self, split: Split, columns: Sequence[str], context: object, block_size_bytes: int
    ) -> Iterator[RawChunk]:
        attempt = self.attempts[split.name] = self.attempts.get(split.name, 0) + 1
        for i, chunk in enumerate(super().read(split, columns, context, block_size_bytes)):
            if i == 2 and attempt <= self.failures:
                raise OSError(f"flaky disk (attempt {attempt})")
            type(self).chunks_read += 1
            yield chunk


def flaky_driver(tmp_path: Path, failures: int, **executor: object) -> tuple[Driver, FlakySource]:
    job = dataset_job(
        tmp_path,
        {"s": {"sources": [source(hours=2)]}},
        dataset={
            "executor": {"block_size_bytes": 64, "retry_backoff_s": 0, **executor},
        },
    )
    assert job.data.dataset is not None
    src = job.data.dataset.streams["s"].sources[0]
    op = FlakySource(src, "s", 0, tmp_path, "data.dataset.streams.s.sources[0]")
    op.failures = failures
    return Driver(job.data, tmp_path, batch_size=8, operators=[op]), op


def test_a_failed_read_is_retried_without_repeating_rows(tmp_path: Path) -> None:
    write_hours(tmp_path, 2, 30)
    expected = concat(list(flaky_driver(tmp_path, failures=0)[0].batches()))
    driver, op = flaky_driver(tmp_path, failures=2, max_retries=2)
    got = concat(list(driver.batches()))
    np.testing.assert_array_equal(got["rows"], expected["rows"])
    np.testing.assert_array_equal(got["C1"], expected["C1"])
    assert set(op.attempts.values()) == {3}


def test_retries_run_out_with_an_error_naming_task_and_split(tmp_path: Path) -> None:
    write_hours(tmp_path, 2, 30)
    driver, _ = flaky_driver(tmp_path, failures=5, max_retries=1)
    with pytest.raises(TaskFailedError, match=r"s/a@2026010100: split .*part-00000.tsv failed"):
        list(driver.batches())
    assert driver.task_states["s/a@2026010100"] is TaskState.FAILED


def test_readers_stay_a_bounded_distance_ahead(tmp_path: Path) -> None:
    write_hours(tmp_path, 2, 200)
    driver, _ = flaky_driver(tmp_path, failures=0, workers=1, queue_blocks=2, lookahead_splits=1)
    FlakySource.chunks_read = 0
    batches = driver.batches()
    next(batches)
    time.sleep(0.3)  # a stalled trainer: readers must stop, not read everything
    ahead = FlakySource.chunks_read  # ~2 consumed + 2 queued + 1 in hand, of ~100
    assert ahead <= 12, ahead
    rest = sum(b.num_rows for b in batches)
    assert FlakySource.chunks_read > 50 and rest == 400 - 8


def test_process_executors_give_the_same_batches(tmp_path: Path) -> None:
    write_hours(tmp_path, 2, 30, files=2)
    streams = {"s": {"sources": [source(hours=2)]}}
    threads = dataset_job(tmp_path, streams)
    processes = dataset_job(tmp_path, streams, dataset={"executor": {"kind": "processes"}})
    a = concat(list(Driver(threads.data, tmp_path, batch_size=8).batches()))
    b = concat(list(Driver(processes.data, tmp_path, batch_size=8).batches()))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def parquet_job(tmp_path: Path, **extra: object) -> JobSpec:
    rng = np.random.default_rng(0)
    for hour in range(2):
        folder = hour_dir(tmp_path, hour)
        folder.mkdir(parents=True)
        n = 23
        table = pa.table(
            {
                "label": rng.integers(0, 2, n).astype(str).tolist(),
                "I1": rng.integers(0, 5, n),
                "I2": rng.integers(0, 5, n),
                "C1": [f"{v:04x}" for v in rng.integers(0, 30, n)],
                "C2": [f"{v:04x}" for v in rng.integers(0, 9, n)],
            }
        )
        pq.write_table(table, folder / "part-00000.parquet", row_group_size=5)
        (folder / "_SUCCESS").write_text("")
    path = "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.parquet"
    src = source(hours=2, path=path, format="parquet", columns=None, **extra)
    return dataset_job(tmp_path, {"s": {"sources": [src]}})


def test_parquet_row_range_splits_cover_each_file_once(tmp_path: Path) -> None:
    whole = parquet_job(tmp_path)
    ranges = job_from_dict(
        {"data": {**dict(whole_data(whole)), "dataset": with_split_rows(whole, 7)}}, tmp_path
    )
    a = concat(list(Driver(whole.data, tmp_path, batch_size=8).batches()))
    driver = Driver(ranges.data, tmp_path, batch_size=8)
    b = concat(list(driver.batches()))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    splits = driver.progress.to_json()["tasks"][0]["splits"]
    assert list(splits) == [
        "data/20260101/00/part-00000.parquet#rows=1-7",
        "data/20260101/00/part-00000.parquet#rows=8-14",
        "data/20260101/00/part-00000.parquet#rows=15-21",
        "data/20260101/00/part-00000.parquet#rows=22-28",
    ]


def whole_data(job: JobSpec) -> dict[str, object]:
    from estuary.config import to_dict

    data = to_dict(job)["data"]
    data.pop("dataset")
    data.pop("sources")
    return data


def with_split_rows(job: JobSpec, rows: int) -> dict[str, object]:
    from estuary.config import to_dict

    dataset = to_dict(job)["data"]["dataset"]
    dataset["streams"]["s"]["sources"][0]["split_rows"] = rows
    return dataset


def two_stream_job(tmp_path: Path, **dataset: object) -> JobSpec:
    # Stream "hist" reads h/data/..., stream "live" reads l/data/..., 2 hours each:
    # plan order hist/a@00, live/b@00, hist/a@01, live/b@01.
    for folder, seed in (("h", 0), ("l", 1)):
        write_hours(tmp_path / folder, 2, 40, seed=seed)
    streams = {
        name: {"sources": [source(src, hours=2, path=f"{folder}/{PATTERN}")]}
        for name, src, folder in (("hist", "a", "h"), ("live", "b", "l"))
    }
    return dataset_job(tmp_path, streams, dataset=dataset)


def sources_of(driver: Driver, batch: Batch) -> set[str]:
    assert batch.row_ids is not None
    tasks = [driver.progress.row_identity(int(r)).task for r in batch.row_ids]
    return {f"{task.stream}/{task.source}" for task in tasks}


def test_a_batch_of_one_sources_rows_names_it_as_its_origin(tmp_path: Path) -> None:
    job = two_stream_job(tmp_path)
    driver = Driver(job.data, tmp_path, batch_size=8, shuffle=False)  # 40 rows: 5 batches a task
    batches = list(driver.batches())
    assert [b.origin for b in batches] == (["hist/a"] * 5 + ["live/b"] * 5) * 2
    assert all(sources_of(driver, b) == {b.origin} for b in batches)
    # Batches of 12 rows: the fourth holds the last 4 rows of hist/a@00 and the
    # first 8 of live/b@00: no single origin.
    driver = Driver(job.data, tmp_path, batch_size=12, shuffle=False)
    batches = list(driver.batches())
    assert [b.origin for b in batches[:5]] == ["hist/a"] * 3 + [None, "live/b"]
    for batch in batches:
        sources = sources_of(driver, batch)
        assert batch.origin == (sources.pop() if len(sources) == 1 else None)


def test_batches_a_shuffle_buffer_mixes_from_two_sources_have_no_origin(tmp_path: Path) -> None:
    shuffle = {"buffer_rows": 50, "interleave_splits": 2, "seed": 3}
    job = two_stream_job(tmp_path, shuffle=shuffle)
    driver = Driver(job.data, tmp_path, batch_size=8)
    batches = list(driver.batches())
    mixed = 0
    for batch in batches:
        sources = sources_of(driver, batch)
        mixed += len(sources) > 1
        assert batch.origin == (sources.pop() if len(sources) == 1 else None)
    assert mixed > len(batches) // 2  # the buffer mixes: most batches have no origin
