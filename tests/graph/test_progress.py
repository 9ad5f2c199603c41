"""Progress: ranges, duplicates, commit + watermark, JSON round trip, and a resumed
Driver that reads exactly the rows not yet trained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from estuary.config import JobSpec
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
START_S = 1_767_225_600  # 2026-01-01T00, where ``write_hours`` starts
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


def three_hours_job(root: Path, buffer_rows: int) -> JobSpec:
    """3 hours x 2 files x 50 rows, read 2 files at a time, small blocks."""
    shuffle = {"buffer_rows": buffer_rows, "interleave_splits": 2, "seed": 5}
    return dataset_job(
        root,
        {"s": {"sources": [source(hours=3)]}},
        dataset={"shuffle": shuffle, "executor": {"block_size_bytes": 200}},
    )


def train_then_crash(driver: Driver, steps: int) -> dict[str, Any]:
    """Train ``steps`` batches of ``driver``, then stop reading: the data
    progress a checkpoint of that step holds (as JSON)."""
    batches = driver.batches()
    for _ in range(steps):
        driver.progress.record(next(batches).row_ids)
    batches.close()
    return json.loads(json.dumps(driver.progress.to_json()))


def test_a_resumed_driver_reads_only_untrained_rows(tmp_path: Path) -> None:
    written = write_hours(tmp_path, 3, 50, files=2, bad_every=7)
    job = three_hours_job(tmp_path, buffer_rows=40)
    saved = train_then_crash(Driver(job.data, tmp_path, batch_size=16), 9)
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


# -- bad rows, exactly once over restarts ------------------------------------------------


def test_a_split_read_again_after_a_resume_counts_only_past_its_saved_figures() -> None:
    progress = Progress()
    progress.task_listed(NEXT, ["f0", "f1"])
    c0, c1 = progress.open_split(NEXT, "f0"), progress.open_split(NEXT, "f1")
    progress.split_read(c0, bad=2, read=10)
    progress.split_ended(c0, rows=8)  # read to its end, not trained
    progress.split_read(c1, bad=1, read=4)  # half read: a crash
    assert progress.bad_totals() == (3, 14)
    saved = json.loads(json.dumps(progress.to_json()))
    assert (saved["bad_rows"], saved["rows_read"]) == (3, 14)
    assert saved["tasks"][0]["splits"]["f1"] == {"rows": None, "bad": 1, "read": 4, "trained": []}

    resumed = Progress.from_json(saved)
    assert resumed.bad_totals() == (3, 14)  # before anything is read again
    r0, r1 = resumed.open_split(NEXT, "f0"), resumed.open_split(NEXT, "f1")
    resumed.split_read(r0, bad=1, read=5)  # both re-read from their start
    resumed.split_read(r1, bad=1, read=3)
    assert resumed.bad_totals() == (3, 14)  # nothing new yet
    resumed.split_read(r0, bad=1, read=5)
    resumed.split_read(r1, bad=1, read=3)
    assert resumed.bad_totals() == (3 + 1, 14 + 2)  # f1 read 2 rows past its 4
    resumed.split_ended(r0, rows=8)
    resumed.split_ended(r1, rows=4)
    assert resumed.bad_totals() == (4, 16)


def test_a_split_that_ends_after_its_task_committed_changes_nothing() -> None:
    # A resumed run reads every split of an uncommitted task, the complete ones
    # too; the task can commit (its other split trained) before such a split's
    # end reaches the progress.
    progress = Progress()
    progress.task_listed(TASK, ["f0", "f1"])
    c0, c1 = progress.open_split(TASK, "f0"), progress.open_split(TASK, "f1")
    progress.split_read(c0, bad=1, read=3)
    progress.record((c0 << 32) | arr(1, 2))
    progress.split_ended(c0, rows=2)
    progress.split_read(c1, bad=0, read=1)
    progress.split_ended(c1, rows=1)
    resumed = Progress.from_json(json.loads(json.dumps(progress.to_json())))
    r0, r1 = resumed.open_split(TASK, "f0"), resumed.open_split(TASK, "f1")
    resumed.split_read(r0, bad=0, read=1)
    resumed.split_read(r1, bad=0, read=1)
    resumed.split_ended(r1, rows=1)
    resumed.record((r1 << 32) | arr(1))
    assert resumed.is_committed(TASK)
    resumed.split_read(r0, bad=1, read=2)  # no error, no change
    resumed.split_ended(r0, rows=2)
    assert resumed.bad_totals() == (1, 4) and resumed.rows_trained == 3


def test_a_split_listed_no_more_gives_its_figures_back() -> None:
    # An uncommitted task whose files were recompacted lists new split names:
    # their rows are read (and counted) again under those.
    progress = Progress()
    progress.task_listed(NEXT, ["old"])
    progress.split_read(progress.open_split(NEXT, "old"), bad=2, read=6)
    resumed = Progress.from_json(progress.to_json())
    resumed.task_listed(NEXT, ["new"])
    assert resumed.bad_totals() == (0, 0)


def test_a_snapshot_without_bad_row_figures_reads_its_good_rows_as_read() -> None:
    progress = Progress()
    progress.task_listed(TASK, ["f0"])
    code = progress.open_split(TASK, "f0")
    progress.split_read(code, bad=1, read=6)
    progress.split_ended(code, rows=5)
    old = progress.to_json()
    del old["bad_rows"], old["rows_read"]
    del old["tasks"][0]["splits"]["f0"]["bad"], old["tasks"][0]["splits"]["f0"]["read"]
    assert Progress.from_json(old).bad_totals() == (0, 5)
    # One with ended splits' bad rows and totals, but no "read" per split: a
    # re-read adds nothing (its read was rows + bad).
    partial = progress.to_json()
    del partial["tasks"][0]["splits"]["f0"]["read"]
    again = Progress.from_json(partial)
    code = again.open_split(TASK, "f0")
    again.split_read(code, bad=1, read=6)
    assert again.bad_totals() == (1, 6)


def test_a_resumed_driver_counts_every_bad_row_once(tmp_path: Path) -> None:
    """Killed after 13 batches (a checkpoint of its progress), resumed: the job's
    bad rows are each file's bad rows once. The resumed run re-reads splits the
    first run had read to their end, and leaves out the committed ones; its
    count never goes down and never passes the truth."""
    written = write_hours(tmp_path, 3, 50, files=2, bad_every=7)
    job = three_hours_job(tmp_path, buffer_rows=10)
    # 13 steps: hour 0 committed; splits of hours 1 and 2 read to their end
    saved = train_then_crash(Driver(job.data, tmp_path, batch_size=16), 13)
    before = Progress.from_json(saved)
    ended_uncommitted = [
        s
        for r in before.tasks.values()
        if not r.committed
        for s in (r.splits or {}).values()
        if s.rows is not None and s.bad
    ]
    assert saved["watermark"] is not None, "a committed task, not read again"
    assert ended_uncommitted, "a split with bad rows read to its end, read again"

    resumed = Driver(job.data, tmp_path, batch_size=16, progress=before)
    assert resumed.bad_rows.count == saved["bad_rows"] > 0  # the checkpoint's, at once
    seen = [resumed.bad_rows.count]
    for batch in resumed.batches():
        resumed.progress.record(batch.row_ids)
        seen.append(resumed.bad_rows.count)
    assert seen == sorted(seen) and seen[-1] <= written.bad_rows
    report = resumed.bad_rows
    assert report.count == written.bad_rows == 6 * 7  # lines 7, 14, ..., 49 of 6 files
    assert report.rows_read == written.rows + written.bad_rows == 300
    # This run's own reads left out the committed task's bad rows.
    assert resumed.bad_rows_this_run.count < written.bad_rows


def test_a_resumed_run_judges_the_bad_row_ratio_on_the_jobs_totals(tmp_path: Path) -> None:
    """Hour 0 is clean, hours 1-2 have a bad row in 5 (20%); the job's ratio is
    40 / 300 (13.3%), under the limit of 15%. A run resumed after hour 0 was
    committed reads 20% bad rows itself, but passes, as the whole run would."""
    written = write_hours(tmp_path, 1, 50, files=2)
    later = write_hours(tmp_path, 2, 50, files=2, bad_every=5, first_hour=1)
    job = dataset_job(
        tmp_path,
        {"s": {"sources": [source(hours=3)]}},
        dataset={"shuffle": {"interleave_splits": 1}},
        data={"max_bad_row_ratio": 0.15},
    )
    whole = Driver(job.data, tmp_path, batch_size=10, shuffle=False)
    for batch in whole.batches():
        whole.progress.record(batch.row_ids)
    assert whole.bad_rows.count == later.bad_rows == 40

    first = Driver(job.data, tmp_path, batch_size=10, shuffle=False)
    saved = train_then_crash(first, written.rows // 10 + 1)  # hour 0, its end seen
    assert saved["watermark"] is not None and saved["bad_rows"] < 40

    resumed = Driver(job.data, tmp_path, batch_size=10, progress=Progress.from_json(saved))
    for batch in resumed.batches():  # 20% of this run's reads: no BadDataError
        resumed.progress.record(batch.row_ids)
    assert resumed.bad_rows.count == 40 and resumed.bad_rows.rows_read == 300
    assert resumed.bad_rows_this_run.ratio == 0.2


def test_rows_read_ahead_of_a_checkpoint_count_for_the_resumed_runs_ratio(
    tmp_path: Path,
) -> None:
    """Hour 0 is 4000 clean rows, hour 1 1000 rows with a bad one in 5; the job's
    ratio is 200 / 5000, under 15%. Reading both hours at once, the first run
    reaches hour 1's end with hour 0 a quarter read (200 of 1750: passed) and is
    killed. The checkpoint keeps the half-read split's rows too, so the resumed
    run judges 200 of 1750 and on, not 200 of 1000 (20%)."""
    write_hours(tmp_path, 1, 4000)
    write_hours(tmp_path, 1, 1000, bad_every=5, first_hour=1)
    job = dataset_job(
        tmp_path,
        {"s": {"sources": [source(hours=2)]}},
        dataset={
            "shuffle": {"interleave_splits": 2, "buffer_rows": 0, "seed": 1},
            "executor": {"block_size_bytes": 2000},
        },
        data={"max_bad_row_ratio": 0.15},
    )
    first = Driver(job.data, tmp_path, batch_size=50)
    batches = first.batches()

    def ended(hour: int) -> bool:
        record = first.progress.tasks.get(Task(hour * 3600, 0, "s", "a", 0).id)
        splits = None if record is None else record.splits
        return splits is not None and all(s.rows is not None for s in splits.values())

    for _ in batches:  # nothing trained: a crash before the first checkpoint's step
        if ended(START_S // 3600 + 1):
            break
    batches.close()
    assert not ended(START_S // 3600)
    saved = json.loads(json.dumps(first.progress.to_json()))
    assert saved["bad_rows"] == 200 and 1000 < saved["rows_read"] < 5000

    resumed = Driver(job.data, tmp_path, batch_size=50, progress=Progress.from_json(saved))
    for batch in resumed.batches():  # no BadDataError
        resumed.progress.record(batch.row_ids)
    assert (resumed.bad_rows.count, resumed.bad_rows.rows_read) == (200, 5000)
    assert resumed.progress.rows_trained == 4800


def test_a_resumed_runs_ratio_error_gives_both_counts_and_says_where_its_bad_rows_went() -> None:
    from estuary.data.badrows import BadRowTracker
    from estuary.data.errors import BadDataError

    tracker = BadRowTracker(0.1, 5, totals=lambda: (300, 1500))  # the job's: 20%
    tracker.add(1200, 0, [])  # this run read only clean rows
    with pytest.raises(BadDataError) as info:
        tracker.check_file_end("f.tsv")
    message = str(info.value)
    assert "300 of 1500 rows read (20.00%; this run read 0 of 1200)" in message
    assert "No bad row was read in this run: the earlier runs of the job read them." in message


def test_a_ratio_error_says_no_bad_row_was_read_only_when_none_was() -> None:
    from estuary.data.badrows import BadRow, BadRowTracker
    from estuary.data.errors import BadDataError

    def message(tracker: BadRowTracker) -> str:
        with pytest.raises(BadDataError) as info:
            tracker.check_file_end("f.tsv")
        return str(info.value)

    quiet = BadRowTracker(0.1, 0, totals=lambda: (50, 100))  # data.report_bad_rows: 0
    quiet.add(100, 50, [BadRow("f.tsv", 1, "field label: '7' is not 0 or 1")])
    assert message(quiet).endswith("(checked at the end of f.tsv).")
    alone = BadRowTracker(0.1, 0)  # a data.sources read: no earlier runs
    alone.add(100, 50, [])
    assert "earlier runs" not in message(alone)
