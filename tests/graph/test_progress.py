"""Progress: ranges, duplicates, commit + watermark, JSON round trip, and a resumed
Driver that reads exactly the rows not yet trained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from estuary.data.graph import Driver, Progress, Task
from estuary.data.graph.progress import merge_ranges, ranges_contain, runs_of

from .conftest import dataset_job, source, write_hours


def arr(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_ranges_merge_and_answer_membership() -> None:
    #   rows 1 2 3 _ 5 6 _ 8    ->   [1, 4) [5, 7) [8, 9)
    runs = runs_of(arr(1, 2, 3, 5, 6, 8))
    assert [a.tolist() for a in runs] == [[1, 5, 8], [4, 7, 9]]
    merged = merge_ranges(runs, (arr(4, 7), arr(5, 8)))  # fills both gaps
    assert [a.tolist() for a in merged] == [[1], [9]]
    assert ranges_contain(runs, arr(0, 1, 4, 6, 8, 9)).tolist() == [
        False,
        True,
        False,
        True,
        True,
        False,
    ]


TASK = Task(0, 0, "s", "a", 3600)
NEXT = Task(3600, 0, "s", "a", 7200)


def test_a_task_commits_once_every_split_is_read_and_trained() -> None:
    progress = Progress()
    progress.task_listed(TASK, ["f0", "f1"])
    c0, c1 = progress.open_split(TASK, "f0"), progress.open_split(TASK, "f1")
    progress.record((c0 << 32) | arr(1, 2, 3))
    progress.split_ended(c0, 3)
    assert not progress.is_committed(TASK)  # f1 not read yet
    progress.record((c1 << 32) | arr(2, 1))
    assert not progress.is_committed(TASK)  # f1's length unknown until its end
    progress.split_ended(c1, 2)
    assert progress.is_committed(TASK) and progress.watermark == TASK.key
    assert progress.rows_trained == 5 and progress.duplicate_rows == 0
    assert progress.accounting() == {TASK.id: {"f0": [(1, 4)], "f1": [(1, 3)]}}


def test_a_row_trained_twice_is_counted_as_a_duplicate() -> None:
    progress = Progress()
    progress.task_listed(TASK, ["f0"])
    code = progress.open_split(TASK, "f0")
    progress.record((code << 32) | arr(1, 2))
    progress.record((code << 32) | arr(2, 3, 3))
    assert progress.rows_trained == 3 and progress.duplicate_rows == 2


def test_json_round_trip_keeps_watermark_ranges_and_open_tasks() -> None:
    progress = Progress()
    progress.task_listed(TASK, [])  # an empty partition: committed at once
    progress.task_listed(NEXT, ["f"])
    code = progress.open_split(NEXT, "f")
    progress.record((code << 32) | arr(1, 2, 5))
    snapshot = json.loads(json.dumps(progress.to_json()))
    again = Progress.from_json(snapshot)
    assert again.to_json() == snapshot
    assert again.is_committed(TASK) and not again.is_committed(NEXT)
    assert [a.tolist() for a in again.trained_ranges(NEXT, "f")] == [[1, 5], [3, 6]]
    assert snapshot["watermark"] == list(TASK.key)


def test_old_committed_tasks_are_summarised_by_the_watermark() -> None:
    progress = Progress(history_tasks=2)
    for hour in range(5):
        progress.task_listed(Task(hour * 3600, 0, "s", "a", hour * 3600 + 3600), [])
    assert len(progress.tasks) == 2
    assert progress.is_committed(Task(0, 0, "s", "a", 3600))  # below the watermark


def test_a_resumed_driver_reads_only_untrained_rows(tmp_path: Path) -> None:
    written = write_hours(tmp_path, 3, 50, files=2, bad_every=7)
    shuffle = {"buffer_rows": 40, "interleave_splits": 2, "seed": 5}
    job = dataset_job(
        tmp_path,
        {"s": {"sources": [source(hours=3)]}},
        dataset={"shuffle": shuffle, "executor": {"block_size_bytes": 200}},
    )
    first = Driver(job.data, tmp_path, batch_size=16)
    batches = first.batches()
    for _ in range(9):  # train 9 batches, then "crash"
        first.progress.record(next(batches).row_ids)
    batches.close()
    saved = json.loads(json.dumps(first.progress.to_json()))
    assert 0 < saved["rows_trained"] == 9 * 16

    resumed = Driver(job.data, tmp_path, batch_size=16, progress=Progress.from_json(saved))
    for batch in resumed.batches():
        resumed.progress.record(batch.row_ids)
    progress = resumed.progress
    assert progress.duplicate_rows == 0 and progress.rows_trained == written.rows
    trained = {
        split: sorted(r for a, b in ranges for r in range(a, b))
        for splits in progress.accounting().values()
        for split, ranges in splits.items()
    }
    assert trained == written.good
    assert progress.tasks_committed == 3


def test_windows_shorter_than_a_minute_have_distinct_task_ids() -> None:
    start = 1_767_225_600  # 2026-01-01T00:00:00Z
    ids = [Task(start + s, 0, "s", "live", start + s + 1).id for s in (0, 1, 59, 60, 61)]
    assert ids == [
        "s/live@2026010100",
        "s/live@20260101000001",
        "s/live@20260101000059",
        "s/live@202601010001",
        "s/live@20260101000101",
    ]
