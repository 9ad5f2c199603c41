"""Joiner: impressions labelled by clicks that arrive within ``wait_s`` (late
events in a later partition included), and the materialised Parquet sink."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from estuary.data.graph import Driver, materialize
from estuary.data.graph.joiner import EventIndex, label_within

from .conftest import START, dataset_job, hour_dir

MIN_MS = 60_000
T0 = int(START.timestamp() * 1000)


def test_label_within_the_wait_after_the_left_row() -> None:
    #              same key, +15 min | before | exactly +wait | too late | other key
    left_keys = np.array([1, 2, 3, 4, 5], np.int64)
    left_times = np.array([0, 50, 10, 0, 0], np.int64)
    events = EventIndex(
        keys=np.array([1, 2, 3, 4, 9, 1], np.int64),
        times=np.array([15, 40, 40, 31, 1, 99], np.int64),
    )
    got = label_within(left_keys, left_times, events, wait=30)
    np.testing.assert_array_equal(got, [True, False, True, False, False])
    none = EventIndex(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert not label_within(left_keys, left_times, none, 30).any()


def write(path: Path, header: str, rows: list[str], marker: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header, *rows]) + "\n")
    if marker:
        (path.parent / "_SUCCESS").write_text("")


IMPRESSIONS = "req\tt_ms\tI1\tI2\tC1\tC2"


def impressions(root: Path) -> None:
    rows = [
        f"r1\t{T0 + 5 * MIN_MS}\t1\t0\taa\tx",  # click 15 min later: 1
        f"r2\t{T0 + 50 * MIN_MS}\t2\t0\tbb\tx",  # click before it, and one too late: 0
        f"r3\t{T0 + 59 * MIN_MS}\t3\t1\tcc\ty",  # click in the next hour, 21 min later: 1
        f"r4\t{T0 + 10 * MIN_MS}\t4\t1\tdd\ty",  # click at the same time: 1
        "r5\tnot-a-time\t5\t1\tee\ty",  # bad row: no usable time
    ]
    write(hour_dir(root, 0, "imp") / "part-0.tsv", IMPRESSIONS, rows)


def clicks(root: Path, hour: int, rows: list[str], marker: bool = True) -> None:
    write(hour_dir(root, hour, "clk") / "part-0.tsv", "req\tt_ms", rows, marker)


def join_job(root: Path, ready_timeout_s: float = 2, left_end: str = "2026-01-01T01") -> object:
    imp = "imp/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv"
    clk = "clk/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv"
    window = {"start": "2026-01-01T00", "format": "tsv"}
    stream = {
        "sources": [
            {"name": "impressions", "path": imp, "end": left_end, **window},
            {"name": "clicks", "path": clk, "end": "2026-01-01T05", **window},
        ],
        "join": {
            "left": "impressions",
            "right": "clicks",
            "key": "req",
            "time_column": "t_ms",
            "wait_s": 1800,
        },
    }
    timer = {"ready_timeout_s": ready_timeout_s}
    return dataset_job(root, {"labelled": stream}, dataset={"timer": timer})


def test_join_labels_rows_and_waits_for_late_event_partitions(tmp_path: Path) -> None:
    impressions(tmp_path)
    clicks(
        tmp_path,
        0,
        [f"r1\t{T0 + 20 * MIN_MS}", f"r2\t{T0 + 40 * MIN_MS}", f"r4\t{T0 + 10 * MIN_MS}"],
    )
    clicks(tmp_path, 2, [f"r2\t{T0 + 120 * MIN_MS}"])  # not needed: after 01:00 + wait

    def late() -> None:
        time.sleep(0.3)
        clicks(tmp_path, 1, [f"r3\t{T0 + 80 * MIN_MS}"])

    writer = threading.Thread(target=late)
    writer.start()
    job = join_job(tmp_path)
    driver = Driver(job.data, tmp_path, batch_size=10)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    (batch,) = list(driver.batches())
    writer.join()
    assert time.perf_counter() - t0 >= 0.3  # the window waited for clicks@01
    np.testing.assert_array_equal(batch.labels, [1, 0, 1, 1])
    np.testing.assert_array_equal(batch.dense[:, 0], np.log1p([1, 2, 3, 4]).astype(np.float32))
    assert driver.bad_rows.count == 1
    assert str(driver.bad_rows.examples[0]) == (
        "imp/20260101/00/part-0.tsv:6: field t_ms: 'not-a-time' is not a whole number of ms "
        "(needed to join)"
    )


def test_join_without_the_late_partition_times_out_naming_it(tmp_path: Path) -> None:
    from estuary.data.graph import PartitionNotReadyError

    impressions(tmp_path)
    clicks(tmp_path, 0, [])
    clicks(tmp_path, 1, [], marker=False)
    job = join_job(tmp_path, ready_timeout_s=0.1)
    with pytest.raises(PartitionNotReadyError, match=r"clk/20260101/01/_SUCCESS \(events for"):
        list(Driver(job.data, tmp_path, batch_size=10).batches())  # type: ignore[attr-defined]


def test_materialised_parquet_reads_back_as_the_same_rows(tmp_path: Path) -> None:
    impressions(tmp_path)
    clicks(tmp_path, 0, [f"r1\t{T0 + 20 * MIN_MS}"])
    clicks(tmp_path, 1, [f"r3\t{T0 + 80 * MIN_MS}"])
    job = join_job(tmp_path)
    report = materialize(job.data, tmp_path, tmp_path / "out")  # type: ignore[attr-defined]
    assert report.total_rows == 4  # the bad-time row is left out
    (direct,) = list(Driver(job.data, tmp_path, batch_size=10).batches())  # type: ignore[attr-defined]
    path = "out/labelled/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.parquet"
    src = {
        "name": "m",
        "path": path,
        "format": "parquet",
        "start": "2026-01-01T00",
        "end": "2026-01-01T01",
    }
    back = dataset_job(tmp_path, {"s": {"sources": [src]}})
    (again,) = list(Driver(back.data, tmp_path, batch_size=10).batches())
    np.testing.assert_array_equal(direct.labels, again.labels)
    np.testing.assert_array_equal(direct.dense, again.dense)
    for feature in ("C1", "C2"):
        np.testing.assert_array_equal(direct.sparse[feature].values, again.sparse[feature].values)
