"""Sparse update modes: sync applies inline, hybrid honours the staleness bound,
async has none; every update lands exactly once, in order."""

import threading
import time

import numpy as np
import pytest

from estuary.embedding.types import TableStats
from estuary.nn.embedding_collection import SparseGradients
from estuary.train.sparse_updates import SparseUpdater


class SlowStore:
    dim = 1

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.applied: list[int] = []
        self.lock = threading.Lock()

    def lookup(self, ids: np.ndarray, *, train: bool) -> np.ndarray:
        return np.zeros((len(ids), 1), np.float32)

    def apply_gradients(self, ids: np.ndarray, grads: np.ndarray) -> None:
        time.sleep(self.delay_s)
        with self.lock:
            self.applied.append(int(ids[0]))

    def stats(self) -> TableStats:
        return TableStats()


def run_steps(
    mode: str, staleness: int, steps: int, delay_s: float
) -> tuple[SparseUpdater, SlowStore, list[int]]:
    store = SlowStore(delay_s)
    updater = SparseUpdater({"t": store}, mode, staleness)
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


def test_update_thread_failure_surfaces_on_the_trainer_thread() -> None:
    class Broken(SlowStore):
        def apply_gradients(self, ids: np.ndarray, grads: np.ndarray) -> None:
            raise ValueError("disk on fire")

    updater = SparseUpdater({"t": Broken(0)}, "hybrid", 1)
    updater.submit([SparseGradients("t", np.array([1]), np.ones((1, 1), np.float32))])
    with pytest.raises(RuntimeError, match="sparse update thread failed"):
        updater.flush()
