"""Timer: windows in time order with per-stream priority, fast planning, and
readiness (markers, file presence, timeouts, open-ended ranges)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from estuary.config.dataset import TimerSpec
from estuary.data import DataWarning
from estuary.data.graph import (
    Driver,
    PartitionNotReadyError,
    Timer,
    WaitOutcome,
    build_operators,
    plan_tasks,
)

from .conftest import dataset_job, hour_dir, source, write_hours

DAILY = "daily/{{YYYY}}{{MM}}{{DD}}/part-*.tsv"


def plan(tmp_path: Path, streams: dict, **timer: object) -> list[str]:
    job = dataset_job(tmp_path, streams, dataset={"timer": {"poll_interval_s": 1, **timer}})
    assert job.data.dataset is not None
    ops = build_operators(job.data.dataset, tmp_path, "label")
    return [t.id for t in plan_tasks(ops)]


def test_tasks_come_in_time_order_then_priority(tmp_path: Path) -> None:
    streams = {
        "low": {"sources": [source("clicks", hours=2)], "priority": 0},
        "high": {"sources": [source("views", hours=2)], "priority": 5},
        "days": {"sources": [source("daily", hours=48, path=DAILY)], "priority": 1},
    }
    assert plan(tmp_path, streams) == [
        "high/views@2026010100",  # 00:00: priority 5, then 1, then 0
        "days/daily@2026010100",
        "low/clicks@2026010100",
        "high/views@2026010101",
        "low/clicks@2026010101",
        "days/daily@2026010200",
    ]


def test_equal_priority_ties_break_by_stream_then_source_name(tmp_path: Path) -> None:
    streams = {"b": {"sources": [source("y", hours=1)]}, "a": {"sources": [source("z", hours=1)]}}
    assert plan(tmp_path, streams) == ["a/z@2026010100", "b/y@2026010100"]


def test_open_ended_sources_plan_up_to_until(tmp_path: Path) -> None:
    streams = {"s": {"sources": [{**source(), "end": None}]}}
    tasks = plan(tmp_path, streams, until="2026-01-01T03")
    assert tasks == ["s/a@2026010100", "s/a@2026010101", "s/a@2026010102"]


def test_a_year_of_hourly_partitions_over_ten_sources_plans_every_task_in_order(
    tmp_path: Path,
) -> None:
    # Timing never decides a test (it read 2.0 s on a loaded machine); what it
    # took is printed for a reader of -s output.
    streams = {
        f"s{i}": {"sources": [source(f"src{i}", hours=365 * 24)], "priority": i % 3}
        for i in range(10)
    }
    job = dataset_job(tmp_path, streams)
    assert job.data.dataset is not None
    ops = build_operators(job.data.dataset, tmp_path, "label")
    t0 = time.perf_counter()
    tasks = list(plan_tasks(ops))
    elapsed = time.perf_counter() - t0
    assert len(tasks) == 10 * 365 * 24
    assert tasks == sorted(tasks)
    print(f"planned {len(tasks)} tasks in {elapsed:.2f} s")


def timer_for(tmp_path: Path, **spec: object) -> tuple[Timer, list]:
    job = dataset_job(tmp_path, {"s": {"sources": [source(hours=2)]}})
    assert job.data.dataset is not None
    ops = build_operators(job.data.dataset, tmp_path, "label")
    timer = Timer(TimerSpec(poll_interval_s=0.01, **spec), ops)  # type: ignore[arg-type]
    return timer, list(timer.windows())


def test_missing_partition_fails_after_the_timeout_naming_it(tmp_path: Path) -> None:
    write_hours(tmp_path, 1, 5)  # hour 00 only
    timer, tasks = timer_for(tmp_path, ready_timeout_s=0.05)
    assert timer.wait_ready(tasks[0]) is WaitOutcome.READY
    with pytest.raises(PartitionNotReadyError, match=r"s/a@2026010101: data/20260101/01/_SUCCESS"):
        timer.wait_ready(tasks[1])


def test_files_without_their_marker_are_not_ready(tmp_path: Path) -> None:
    write_hours(tmp_path, 1, 5, marker=False)
    timer, tasks = timer_for(tmp_path, ready_timeout_s=0.02, on_timeout="skip")
    with pytest.warns(DataWarning, match="skipped partition not ready"):
        assert timer.wait_ready(tasks[0]) is WaitOutcome.SKIP


def test_without_a_marker_present_files_make_a_partition_ready(tmp_path: Path) -> None:
    write_hours(tmp_path, 1, 5, marker=False)
    job = dataset_job(tmp_path, {"s": {"sources": [source(hours=1, success_marker=None)]}})
    assert job.data.dataset is not None
    ops = build_operators(job.data.dataset, tmp_path, "label")
    timer = Timer(TimerSpec(poll_interval_s=0.01, ready_timeout_s=0.02), ops)
    assert timer.wait_ready(next(timer.windows())) is WaitOutcome.READY


def test_the_driver_waits_for_a_late_partition_and_then_reads_it(tmp_path: Path) -> None:
    write_hours(tmp_path, 1, 10)
    hour1 = hour_dir(tmp_path, 1)
    hour1.mkdir(parents=True)

    arrived: list[float] = []

    def arrive() -> None:
        time.sleep(0.3)
        arrived.append(time.perf_counter())  # before the files: the driver cannot be done
        (hour1 / "part-00000.tsv").write_text("1\t1\t1\t0001\t0001\n")
        (hour1 / "_SUCCESS").write_text("")

    writer = threading.Thread(target=arrive)
    writer.start()
    job = dataset_job(tmp_path, {"s": {"sources": [source(hours=2)]}})
    rows = sum(b.num_rows for b in Driver(job.data, tmp_path, batch_size=4).batches())
    done = time.perf_counter()
    writer.join()
    assert rows == 11 and done > arrived[0]  # it waited for the late partition


def test_an_open_ended_source_ends_cleanly_when_idle(tmp_path: Path) -> None:
    write_hours(tmp_path, 3, 4)
    streams = {"s": {"sources": [{**source(), "end": None}]}}
    job = dataset_job(tmp_path, streams, dataset={"timer": {"idle_timeout_s": 0.05}})
    driver = Driver(job.data, tmp_path, batch_size=5)
    assert sum(b.num_rows for b in driver.batches()) == 12
    assert len(driver.task_states) == 4  # the fourth hour was waited for, then the run ended
