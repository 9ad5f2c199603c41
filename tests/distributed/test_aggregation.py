"""StepAggregator: each step's pushes from all ranks -> one optimizer step, once,
in step order."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from estuary.ps import PSError, PSTimeoutError, StepAggregator, sum_by_id

D = 2


class Recorder:
    """An ``apply`` that records every optimizer step it is given."""

    def __init__(self) -> None:
        self.steps: list[tuple[np.ndarray, np.ndarray]] = []
        self.scales: list[float] = []

    def __call__(self, ids: np.ndarray, grads: np.ndarray, *, lr_scale: float) -> None:
        self.steps.append((ids.copy(), grads.copy()))
        self.scales.append(lr_scale)


def ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def grads(*rows: float) -> np.ndarray:
    return np.array([[r, -r] for r in rows], np.float32)


def test_sum_by_id_adds_rows_of_the_same_id_across_parts() -> None:
    #   rank 0: ids [5, 1]    rank 1: ids [1, 9, 5]
    #   sum:    1 -> 2+10, 5 -> 1+30, 9 -> 20
    out_ids, out = sum_by_id([(ids(5, 1), grads(1, 2)), (ids(1, 9, 5), grads(10, 20, 30))], D)
    np.testing.assert_array_equal(out_ids, ids(1, 5, 9))
    np.testing.assert_array_equal(out, grads(12, 31, 20))
    empty_ids, empty = sum_by_id([(ids(), grads().reshape(0, D))], D)
    assert empty_ids.shape == (0,) and empty.shape == (0, D)


def test_a_step_is_applied_once_when_every_rank_has_pushed() -> None:
    apply = Recorder()
    agg = StepAggregator("t", D, world_size=2, apply=apply)
    assert agg.push(1, 0, ids(1, 2), grads(1, 2))
    assert apply.steps == [] and agg.missing_ranks(1) == [1]
    assert agg.push(1, 1, ids(2, 3), grads(10, 20))
    assert agg.applied == 1 and len(apply.steps) == 1
    np.testing.assert_array_equal(apply.steps[0][0], ids(1, 2, 3))
    np.testing.assert_array_equal(apply.steps[0][1], grads(1, 12, 20))


def test_duplicate_pushes_are_ignored_and_counted() -> None:
    apply = Recorder()
    agg = StepAggregator("t", D, world_size=2, apply=apply)
    agg.push(1, 0, ids(1), grads(1))
    assert not agg.push(1, 0, ids(1), grads(100))  # retry while buffered
    agg.push(1, 1, ids(1), grads(2))
    assert not agg.push(1, 1, ids(1), grads(100))  # retry after it was applied
    assert agg.duplicates == 2 and len(apply.steps) == 1
    np.testing.assert_array_equal(apply.steps[0][1], grads(3))


def test_steps_apply_in_order_even_when_a_later_one_completes_first() -> None:
    apply = Recorder()
    agg = StepAggregator("t", D, world_size=2, apply=apply)
    agg.push(1, 0, ids(1), grads(1))
    agg.push(2, 0, ids(2), grads(2))
    agg.push(2, 1, ids(2), grads(2))  # step 2 complete, step 1 not yet
    assert agg.applied == 0 and apply.steps == []
    agg.push(1, 1, ids(1), grads(1))
    assert agg.applied == 2
    assert [s[0].tolist() for s in apply.steps] == [[1], [2]]


def test_bad_pushes_are_refused() -> None:
    agg = StepAggregator("t", D, world_size=2, apply=Recorder(), max_pending_steps=4)
    with pytest.raises(PSError, match="rank 2 not in"):
        agg.push(1, 2, ids(1), grads(1))
    with pytest.raises(PSError, match="steps start at 1"):
        agg.push(0, 0, ids(1), grads(1))
    with pytest.raises(PSError, match="must have shape"):
        agg.push(1, 0, ids(1, 2), grads(1))
    with pytest.raises(PSError, match="more than 4 steps ahead"):
        agg.push(5, 0, ids(1), grads(1))


def test_wait_applied_times_out_naming_the_missing_ranks() -> None:
    agg = StepAggregator("t", D, world_size=3, apply=Recorder())
    agg.push(1, 1, ids(1), grads(1))
    with pytest.raises(PSTimeoutError, match=r"step 1 still needs pushes from ranks \[0, 2\]"):
        agg.wait_applied(1, timeout_s=0.05)


def test_wait_applied_returns_when_the_last_rank_pushes() -> None:
    agg = StepAggregator("t", D, world_size=2, apply=Recorder())
    agg.push(1, 0, ids(1), grads(1))
    waiter = threading.Thread(target=agg.wait_applied, args=(1, 10.0))
    waiter.start()
    deadline = time.monotonic() + 10
    while agg.waits == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiter.join(timeout=0.1)
    assert waiter.is_alive() and agg.waits == 1  # blocked on rank 1
    agg.push(1, 1, ids(1), grads(1))
    waiter.join(timeout=5)
    assert not waiter.is_alive()


def test_a_failed_apply_fails_the_table_for_everyone() -> None:
    def broken(ids: np.ndarray, grads: np.ndarray, *, lr_scale: float) -> None:
        raise ValueError("disk on fire")

    agg = StepAggregator("t", D, world_size=1, apply=broken)
    with pytest.raises(PSError, match="applying step 1 failed: disk on fire"):
        agg.push(1, 0, ids(1), grads(1))
    with pytest.raises(PSError, match="failed at step 1"):
        agg.push(2, 0, ids(1), grads(1))
    with pytest.raises(PSError, match="failed at step 1"):
        agg.wait_applied(1, timeout_s=5)


def test_a_step_is_applied_at_the_lr_scale_its_ranks_agree_on() -> None:
    apply = Recorder()
    agg = StepAggregator("t", D, world_size=2, apply=apply)
    agg.push(1, 0, ids(1), grads(1))
    agg.push(1, 1, ids(2), grads(2))  # default scale 1 from both
    agg.push(2, 1, ids(1), grads(1), lr_scale=0.5)
    agg.push(2, 0, ids(3), grads(3), lr_scale=0.5)
    assert agg.applied == 2 and apply.scales == [1.0, 0.5]


def test_ranks_disagreeing_on_a_steps_lr_scale_fail_the_table_naming_them() -> None:
    apply = Recorder()
    agg = StepAggregator("t", D, world_size=2, apply=apply)
    agg.push(1, 0, ids(1), grads(1), lr_scale=0.5)
    msg = r"table 't': the ranks pushed step 1 with different lr scales \{0: 0.5, 1: 1.0\}"
    with pytest.raises(PSError, match=msg):
        agg.push(1, 1, ids(2), grads(2))
    assert agg.applied == 0 and apply.steps == []  # nothing applied at either scale
    with pytest.raises(PSError, match=r"failed at step 1.*different lr scales"):
        agg.wait_applied(1, timeout_s=5)  # a rank waiting on the step hears why
    with pytest.raises(PSError, match="failed at step 1"):
        agg.push(2, 0, ids(1), grads(1))


@pytest.mark.parametrize("scale", [-0.5, float("nan"), float("inf")])
def test_a_push_with_a_negative_or_non_finite_lr_scale_is_refused(scale: float) -> None:
    agg = StepAggregator("t", D, world_size=1, apply=Recorder())
    with pytest.raises(PSError, match="lr scale of step 1 must be finite and >= 0"):
        agg.push(1, 0, ids(1), grads(1), lr_scale=scale)
    assert agg.push(1, 0, ids(1), grads(1))  # the table is still fine


def test_a_hook_after_a_step_sees_exactly_that_step() -> None:
    """``after_step(s, hook)`` runs once step s is applied and before s + 1 is:
    registered before s (on its own thread once s is applied), or at s (by
    ``run_after``), or just before s + 1 when that comes first; never for a step
    already passed."""
    from estuary.ps.aggregation import StepAggregator

    applied: list[int] = []
    seen: list[tuple[str, int]] = []
    agg = StepAggregator("t", 1, 2, lambda ids, grads, lr_scale: applied.append(len(applied) + 1))
    one = (np.array([1], np.int64), np.ones((1, 1), np.float32))

    def push(step: int, rank: int) -> None:
        agg.push(step, rank, *one)

    assert agg.after_step(1, lambda: seen.append(("before", agg.applied)))
    push(1, 0)
    push(1, 1)  # step 1 applied: the hook runs on its thread, or before step 2
    push(2, 0)
    assert agg.after_step(1, lambda: seen.append(("at", agg.applied)))
    push(2, 1)  # step 2 is applied only after both hooks of step 1 ran
    assert sorted(seen) == [("at", 1), ("before", 1)]
    assert agg.after_step(2, lambda: seen.append(("run_after", agg.applied)))
    agg.run_after(2)
    assert seen[-1] == ("run_after", 2)
    assert not agg.after_step(1, lambda: seen.append(("late", agg.applied)))
    assert applied == [1, 2]
