"""``train.mixed_buffer.live: arrival``: a reader thread drains live sources as
their rows come, so a live burst faster than training is shed by the buffer's
policy; file rows stay paced by training (never shed for being fast), and every
row is trained once or dropped once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from estuary.config import ConfigError, job_from_dict
from estuary.config.mixed_buffer import MixedBufferSpec, live_origins
from estuary.data.types import Batch, JaggedIds
from estuary.train.mixed_buffer import row_bytes
from estuary.train.mixed_feed import BufferedSource

STEP = 20
LIVE = "live/clicks"
FILES = "history/synth"


class Recorder:
    """The progress's ``record``: the rows dropped, as the feed reports them."""

    def __init__(self) -> None:
        self.dropped: list[int] = []

    def record(self, ids: np.ndarray, dropped: bool = False) -> None:
        assert dropped
        self.dropped.extend(int(i) for i in ids)


def batch(origin: str, first: int, rows: int = STEP) -> Batch:
    ids = np.arange(first, first + rows, dtype=np.int64)
    rng = np.random.default_rng(first)
    return Batch(
        labels=(rng.random(rows) < 0.3).astype(np.float32),
        dense=rng.random((rows, 2)).astype(np.float32),
        sparse={"C1": JaggedIds.single(ids % 7)},
        row_ids=ids,
        origin=origin,
    )


def source(files: int, live: int, live_gap_s: float = 0.0) -> Iterator[Batch]:
    """``files`` file batches, then ``live`` live batches, ``live_gap_s`` apart."""
    for i in range(files):
        yield batch(FILES, i * STEP)
    for i in range(live):
        if live_gap_s:
            time.sleep(live_gap_s)
        yield batch(LIVE, 1_000_000 + i * STEP)


def feed(
    policy: str = "priority", live: str = "arrival", capacity_steps: int = 4
) -> tuple[BufferedSource, Recorder]:
    per_row = int(row_bytes(batch(LIVE, 0)).max())
    spec = MixedBufferSpec(
        capacity_bytes=capacity_steps * STEP * per_row,
        policy=policy,
        live=live,  # type: ignore[arg-type]
    )
    progress = Recorder()
    return BufferedSource(spec, STEP, progress, seed=0, live=frozenset({LIVE})), progress  # type: ignore[arg-type]


def train(source_: BufferedSource, batches: Iterator[Batch], step_s: float) -> list[Batch]:
    """Consume the steps, each taking ``step_s`` (the training step)."""
    steps = []
    for step in source_.batches(batches):
        steps.append(step)
        time.sleep(step_s)
    return steps


def trained_ids(steps: list[Batch]) -> list[int]:
    return [int(i) for step in steps for i in step.row_ids]  # type: ignore[union-attr]


def test_a_live_burst_is_shed_and_the_files_are_not() -> None:
    buffered, progress = feed()
    steps = train(buffered, source(files=10, live=60), step_s=0.01)
    trained = trained_ids(steps)
    files = [i for i in trained if i < 1_000_000]
    # File rows are offered when the trainer needs rows; only those still in the
    # buffer when the burst came (at most a step's) compete with it, and lose.
    file_drops = [i for i in progress.dropped if i < 1_000_000]
    assert len(file_drops) <= STEP
    assert sorted(files + file_drops) == list(range(10 * STEP))
    live_rows = set(range(1_000_000, 1_000_000 + 60 * STEP))
    live_trained = [i for i in trained if i >= 1_000_000]
    assert len(live_trained) == len(set(live_trained))  # once
    live_drops = [i for i in progress.dropped if i >= 1_000_000]
    assert len(live_drops) == len(set(live_drops)) and set(live_trained).isdisjoint(live_drops)
    assert set(live_trained) | set(live_drops) == live_rows  # trained or dropped
    assert len(live_drops) > 20 * STEP  # the burst came faster than the steps
    counts = buffered.summary()["sources"]
    assert counts[LIVE]["sampled_out"] + counts[LIVE]["evicted"] == len(live_drops)
    assert counts[FILES]["evicted"] == len(file_drops)
    assert counts[FILES]["offered"] == 10 * STEP and counts[FILES]["sampled_out"] == 0
    assert buffered.summary()["live"] == "arrival"
    assert buffered.buffer.peak_bytes <= buffered.buffer.policy.capacity_bytes


def test_files_alone_are_paced_by_training_however_fast_they_read() -> None:
    buffered, progress = feed()
    steps = train(buffered, source(files=40, live=0), step_s=0.005)
    assert progress.dropped == []
    assert sorted(trained_ids(steps)) == list(range(40 * STEP))
    assert buffered.buffer.peak_bytes <= buffered.buffer.policy.capacity_bytes // 2


def test_a_live_trickle_slower_than_training_is_not_shed() -> None:
    buffered, progress = feed(capacity_steps=20)  # a 200 ms stall still fits the high water
    steps = train(buffered, source(files=2, live=15, live_gap_s=0.02), step_s=0.0)
    assert progress.dropped == []
    assert sorted(trained_ids(steps)) == sorted(
        [*range(2 * STEP), *range(1_000_000, 1_000_000 + 15 * STEP)]
    )


def test_paced_waits_instead_of_shedding_the_same_burst() -> None:
    buffered, progress = feed(live="paced")
    steps = train(buffered, source(files=10, live=60), step_s=0.002)
    assert progress.dropped == []
    assert len(trained_ids(steps)) == 70 * STEP


def test_fifo_on_arrival_drops_nothing_and_keeps_the_order() -> None:
    buffered, progress = feed(policy="fifo")
    steps = train(buffered, source(files=3, live=40), step_s=0.005)
    assert progress.dropped == []
    trained = trained_ids(steps)
    assert trained == sorted(trained) and len(trained) == 43 * STEP


def test_every_arriving_batch_is_scored_once_before_it_is_offered() -> None:
    buffered, progress = feed()
    scored: list[int] = []
    buffered.scorer = lambda b: np.full(b.num_rows, 0.5)
    buffered.on_scored = lambda b, s: scored.extend(int(i) for i in b.row_ids)  # type: ignore[union-attr]
    steps = train(buffered, source(files=4, live=30), step_s=0.005)
    assert sorted(scored) == sorted(trained_ids(steps) + progress.dropped)  # dropped ones too
    assert len(scored) == len(set(scored)) == 34 * STEP


def test_an_error_of_the_source_is_raised_in_the_trainers_thread() -> None:
    def failing() -> Iterator[Batch]:
        yield batch(LIVE, 0)
        raise ValueError("bad split part-00003.tsv")

    buffered, _ = feed()
    with pytest.raises(ValueError, match="part-00003"):
        train(buffered, failing(), step_s=0.0)


def test_the_feeds_close_ends_the_reader_and_closes_the_source() -> None:
    """``GraphFeed.close``'s path: the steps' generator is left suspended (the
    loop stopped mid-run), the reader is told to stop and ends, closing the
    source in its own thread."""
    closed = threading.Event()

    def endless() -> Iterator[Batch]:
        try:
            i = 0
            while True:
                yield batch(LIVE, i * STEP)
                i += 1
        finally:
            closed.set()

    buffered, _ = feed()
    steps = buffered.batches(endless())
    for _ in range(3):
        next(steps)
    reader = buffered._reader
    assert reader is not None and reader.is_alive()
    time.sleep(0.1)  # the queue fills: the reader waits to queue more
    buffered.stop_reader()
    buffered.join_reader(5)
    assert not reader.is_alive()
    assert closed.is_set()


def test_closing_the_steps_ends_the_reader() -> None:
    buffered, _ = feed()
    steps = buffered.batches(source(files=0, live=10_000))
    next(steps)
    reader = buffered._reader
    assert reader is not None
    steps.close()
    reader.join(5)
    assert not reader.is_alive()


def dataset_job(live_source: bool, **buffer: Any) -> dict[str, Any]:
    sources: dict[str, Any] = {
        "history": {
            "sources": [
                {
                    "name": "synth",
                    "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
                    "columns": ["label", "I1", "C1"],
                    "start": "2026-01-01T00",
                    "end": "2026-01-01T01",
                }
            ]
        }
    }
    if live_source:
        sources["live"] = {
            "sources": [
                {
                    "name": "clicks",
                    "type": "stream",
                    "stream": {
                        "kind": "redis",
                        "url": "redis://127.0.0.1:6379",
                        "key": "clicks",
                        "format": "csv",
                        "columns": ["label", "I1", "C1"],
                    },
                }
            ]
        }
    return {
        "data": {
            "schema": {"dense": ["I1"], "sparse": ["C1"]},
            "dataset": {"streams": sources},
        },
        "model": {"type": "dlrm", "params": {"bottom_mlp": [4], "top_mlp": [4]}},
        "train": {
            "batch_size": 10,
            "mixed_buffer": {"capacity_bytes": 100_000, **buffer},
        },
    }


def test_live_arrival_reads_the_live_origins_of_the_job() -> None:
    job = job_from_dict(dataset_job(True, live="arrival"))
    assert job.train.mixed_buffer is not None and job.train.mixed_buffer.live == "arrival"
    assert live_origins(job) == frozenset({"live/clicks"})


@pytest.mark.parametrize(
    ("live_source", "buffer", "field", "says"),
    [
        (False, {"live": "arrival"}, "train.mixed_buffer.live", "no live source"),
        (True, {"live": "arrival", "offer_per_take": 2}, "offer_per_take", "set it to 1"),
        (True, {"live": "sometimes"}, "train.mixed_buffer.live", "'paced', 'arrival'"),
        (True, {"max_age_rows": 0.5}, "train.mixed_buffer.max_age_rows", "must be >= 1"),
        (True, {"max_age_rows": 5}, "train.mixed_buffer.max_age_rows", "at least 10"),
    ],
)
def test_bad_live_settings_name_their_field(
    live_source: bool, buffer: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        job_from_dict(dataset_job(live_source, **buffer))
    assert field in str(info.value)
