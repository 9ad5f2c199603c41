"""Sparse update modes: sync applies inline, hybrid honours the staleness bound,
async has none; every update lands exactly once, in order."""

import threading
import time

import numpy as np
import pytest

from estuary.config.spec import TableSpec
from estuary.embedding import EmbeddingTable
from estuary.embedding.types import TableStats
from estuary.nn.embedding_collection import SparseGradients
from estuary.train.placement import Placement, choose_placement
from estuary.train.sparse_updates import (
    LockedStore,
    SparseUpdater,
    computes_in_process,
    placement_for,
)


class SlowStore:
    dim = 1

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.applied: list[int] = []
        self.scales: list[float] = []
        self.lock = threading.Lock()

    def lookup(self, ids: np.ndarray, *, train: bool) -> np.ndarray:
        return np.zeros((len(ids), 1), np.float32)

    def apply_gradients(self, ids: np.ndarray, grads: np.ndarray, *, lr_scale: float = 1.0) -> None:
        time.sleep(self.delay_s)
        with self.lock:
            self.applied.append(int(ids[0]))
            self.scales.append(lr_scale)

    def stats(self) -> TableStats:
        return TableStats()


def run_steps(
    mode: str,
    staleness: int,
    steps: int,
    delay_s: float,
    placement: Placement = Placement.BACKGROUND,
) -> tuple[SparseUpdater, SlowStore, list[int]]:
    store = SlowStore(delay_s)
    if mode == "sync":
        placement = Placement.INLINE
    updater = SparseUpdater({"t": store}, mode, staleness, placement=placement)
    behind = []
    for step in range(1, steps + 1):
        updater.before_lookup(step)
        with store.lock:
            behind.append((step - 1) - len(store.applied))  # updates not visible to this lookup
        updater.submit([SparseGradients("t", np.array([step]), np.ones((1, 1), np.float32))])
    updater.close()
    return updater, store, behind


def test_sync_mode_lands_every_update_before_the_next_lookup() -> None:
    _, store, behind = run_steps("sync", staleness=3, steps=10, delay_s=0.0)
    assert behind == [0] * 10
    assert store.applied == list(range(1, 11))


@pytest.mark.parametrize("staleness", [1, 2, 4])
def test_hybrid_lookup_never_misses_more_than_staleness_updates(staleness: int) -> None:
    # Updates are much slower than "compute" (none here), so the bound is what holds them back.
    updater, store, behind = run_steps("hybrid", staleness, steps=12, delay_s=0.01)
    assert max(behind) == staleness  # the bound is reached (updates really are async) ...
    assert all(b <= staleness for b in behind)  # ... and never exceeded
    assert updater.log.max_behind == staleness
    assert store.applied == list(range(1, 13))  # every update once, in step order


def test_async_mode_has_no_bound() -> None:
    _, store, behind = run_steps("async", staleness=1, steps=12, delay_s=0.01)
    assert max(behind) > 2
    assert store.applied == list(range(1, 13))


class Broken(SlowStore):
    def apply_gradients(self, ids: np.ndarray, grads: np.ndarray, *, lr_scale: float = 1.0) -> None:
        raise ValueError("disk on fire")


def test_update_thread_failure_surfaces_on_the_trainer_thread() -> None:
    updater = SparseUpdater({"t": Broken(0)}, "hybrid", 1, placement=Placement.BACKGROUND)
    updater.submit([SparseGradients("t", np.array([1]), np.ones((1, 1), np.float32))])
    with pytest.raises(RuntimeError, match="sparse update thread failed"):
        updater.flush()


@pytest.mark.parametrize("mode", ["hybrid", "async"])
def test_inline_placement_lands_every_update_in_submit(mode: str) -> None:
    updater, store, behind = run_steps(mode, 2, steps=6, delay_s=0.0, placement=Placement.INLINE)
    assert behind == [0] * 6  # within any staleness bound
    assert store.applied == list(range(1, 7))
    assert updater.log.max_behind == 0


@pytest.mark.parametrize(
    ("mode", "torch_threads", "cores", "expected"),
    [
        ("hybrid", 2, 2, Placement.INLINE),  # torch's threads fill every core
        ("hybrid", 1, 2, Placement.BACKGROUND),  # a core is free for the helper threads
        ("async", 4, 16, Placement.BACKGROUND),
        ("sync", 1, 16, Placement.INLINE),  # sync is inline by definition
    ],
)
def test_background_threads_only_where_a_core_is_free(
    mode: str, torch_threads: int, cores: int, expected: Placement
) -> None:
    assert choose_placement(mode, torch_threads=torch_threads, cores=cores) is expected


def test_sync_mode_refuses_background_placement() -> None:
    with pytest.raises(ValueError, match="sync mode applies updates inline"):
        SparseUpdater({"t": SlowStore(0)}, "sync", 1, placement=Placement.BACKGROUND)


def test_in_process_tables_are_cpu_bound_and_other_stores_stay_in_background() -> None:
    table = EmbeddingTable(TableSpec(dim=1), seed=0, name="t")
    assert computes_in_process(table)
    assert computes_in_process(LockedStore(table))
    assert not computes_in_process(SlowStore(0))  # e.g. a parameter server: calls wait
    # Overlapping waits pays off even without a spare core.
    assert placement_for({"t": SlowStore(0)}, "hybrid") is Placement.BACKGROUND
    assert placement_for({"t": LockedStore(table)}, "sync") is Placement.INLINE


@pytest.mark.parametrize(
    ("mode", "placement"),
    [("sync", Placement.INLINE), ("hybrid", Placement.BACKGROUND), ("async", Placement.INLINE)],
)
def test_each_step_reaches_its_table_at_its_lr_scale(mode: str, placement: Placement) -> None:
    store = SlowStore(0)
    updater = SparseUpdater({"t": store}, mode, 1, placement=placement)
    for step, scale in enumerate([1.0, 0.5, 0.0, 2.0], start=1):
        grads = SparseGradients("t", np.array([step]), np.ones((1, 1), np.float32), scale)
        updater.before_lookup(step)
        updater.submit([grads])
    updater.close()
    assert store.applied == [1, 2, 3, 4] and store.scales == [1.0, 0.5, 0.0, 2.0]


@pytest.mark.parametrize("placement", [Placement.BACKGROUND, Placement.INLINE])
def test_a_call_after_the_submitted_updates_sees_them_all_and_does_not_block(
    placement: Placement,
) -> None:
    """``after_submitted`` (an asynchronous checkpoint asks its servers from
    there): the call runs once every update submitted before it has landed, and
    before any submitted after it."""
    store = SlowStore(0.05)
    updater = SparseUpdater({"t": store}, "hybrid", 4, placement=placement)
    one = np.ones((1, 1), np.float32)
    for step in (1, 2, 3):
        updater.submit([SparseGradients("t", np.array([step]), one)])
    future = updater.after_submitted(lambda: list(store.applied))
    updater.submit([SparseGradients("t", np.array([4]), one)])
    assert future.result(timeout=10) == [1, 2, 3]  # all before it, none after
    updater.close()
    assert store.applied == [1, 2, 3, 4]


def test_calls_queued_behind_a_failed_update_fail_too() -> None:
    updater = SparseUpdater({"t": Broken(0)}, "hybrid", 1, placement=Placement.BACKGROUND)
    updater.submit([SparseGradients("t", np.array([1]), np.ones((1, 1), np.float32))])
    future = updater.after_submitted(lambda: "never")
    with pytest.raises(RuntimeError, match=r"failed.*disk on fire"):
        future.result(timeout=10)
