"""The prefetcher: both placements hand out every batch once, in order, each
looked up after its staleness wait; errors reach the consumer."""

import threading
from typing import Any

import numpy as np
import pytest

from estuary.data.types import Batch
from estuary.train.pipeline import Prefetcher, StageTimes
from estuary.train.placement import Placement
from estuary.train.sparse_updates import SparseUpdater


def batches(n: int) -> list[Batch]:
    return [
        Batch(labels=np.full(2, i, np.float32), dense=np.zeros((2, 1), np.float32))
        for i in range(n)
    ]


@pytest.mark.parametrize("placement", list(Placement))
def test_every_batch_once_in_order_after_its_wait(placement: Placement) -> None:
    events: list[tuple[str, int, str]] = []

    def before_lookup(step: int) -> None:
        events.append(("wait", step, threading.current_thread().name))

    def lookup(batch: Batch) -> Any:
        events.append(("lookup", int(batch.labels[0]), threading.current_thread().name))
        return f"looked-{int(batch.labels[0])}"

    times = StageTimes()
    prefetch = Prefetcher(
        batches(4), lookup, before_lookup, first_step=7, times=times, placement=placement
    )
    got = [(step, int(b.labels[0]), looked) for step, b, looked in prefetch]
    assert got == [(7 + i, i, f"looked-{i}") for i in range(4)]
    assert [e[:2] for e in events] == [
        e for i in range(4) for e in (("wait", 7 + i), ("lookup", i))
    ]
    inline = placement is Placement.INLINE
    assert all((e[2] == threading.current_thread().name) == inline for e in events)
    assert times.lookup_s >= 0.0 and times.data_s >= 0.0


@pytest.mark.parametrize("placement", list(Placement))
def test_lookup_errors_surface_on_the_consumer(placement: Placement) -> None:
    def lookup(batch: Batch) -> Any:
        raise ValueError("table on fire")

    prefetch = Prefetcher(batches(2), lookup, lambda step: None, first_step=1, placement=placement)
    with pytest.raises(ValueError, match="table on fire"):
        list(prefetch)


class NoStore:
    dim = 1


@pytest.mark.parametrize("placement", list(Placement))
def test_lookups_run_where_the_updater_runs_its_updates(placement: Placement) -> None:
    updater = SparseUpdater({"t": NoStore()}, "hybrid", 1, placement=placement)
    prefetch = Prefetcher(batches(1), lambda b: None, updater.before_lookup, first_step=1)
    assert prefetch.placement is placement
    assert len(list(prefetch)) == 1
    updater.close()
