"""A live surge in ``estuary train``: a Redis (or NATS) stream holding more rows
than a slow trainer takes. With ``train.mixed_buffer.live: arrival`` the buffer sheds
it by its policy (the history files stay paced); with ``paced`` it waits in
the broker and nothing is dropped. Every row is trained once or dropped once,
and every row is scored on arrival."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from estuary.config import JobSpec, job_from_dict
from estuary.train import Trainer
from estuary.train.callbacks import Callback, LoopState
from estuary.train.result import FitResult

from .conftest import Server
from .test_continuous import (
    BATCH,
    HISTORY_HOURS,
    PER_HOUR,
    continuous_dict,
    fit_stopped_when,
    publish,
    push,
    write_history,
)

SURGE_MINUTES, SURGE_PER_MINUTE = 4, 600


def push_surge(url: str, key: str, first_minute: int = 0) -> int:
    """SURGE_PER_MINUTE csv rows in each of SURGE_MINUTES minutes after the
    history, from ``first_minute`` on."""
    minutes = range(first_minute, first_minute + SURGE_MINUTES)
    return push(url, key, minutes, seed=5 + first_minute, per_minute=SURGE_PER_MINUTE)


class SlowSteps(Callback):
    """A trainer slower than the stream: each step takes ``step_s`` more."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.last, self.steps = step_s, time.monotonic(), 0

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        time.sleep(self.step_s)
        self.last, self.steps = time.monotonic(), self.steps + 1


def fit_until_idle(trainer: Trainer, slow: SlowSteps, idle_s: float = 3.0) -> FitResult:
    """Fit; once steps came and then none for ``idle_s`` (the reader waits for
    the stream), stop."""
    return fit_stopped_when(
        trainer, lambda: slow.steps > 0 and time.monotonic() - slow.last >= idle_s, 120
    )


def settle(spec: JobSpec, root: Path, total: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Resume (no new rows) until every row was trained or dropped, but for
    less than a batch: the open last window's trailing partial batch, which
    waits for the next rows (docs/mixture.md, Limits). A stop leaves the rows
    still buffered past the stop's step uncounted, and the next run reads them
    again: never lost, never counted twice."""
    for _ in range(3):
        done = extra["rows_committed"] + extra["rows_dropped"]
        assert extra["duplicate_rows"] == 0 and done <= total
        assert extra["progressive"]["rows"] == done  # each counted row scored once
        if total - done < BATCH:
            return extra
        resumed = Trainer(spec, callbacks=[slow := SlowSteps(0.01)])
        resumed.load_checkpoint(root / "out")
        extra = fit_until_idle(resumed, slow).extra
    raise AssertionError(f"{total - done} rows neither trained nor dropped after 3 resumes")


def arrive(server: Server, kind: str, key: str, first_minute: int = 0) -> int:
    """The surge's rows into ``key``: Redis at set broker times, NATS now."""
    if kind == "redis":
        return push_surge(server.url, key, first_minute)
    return publish(server.url, key, SURGE_MINUTES * SURGE_PER_MINUTE, seed=5 + first_minute)


@pytest.mark.parametrize(
    ("kind", "live"), [("redis", "arrival"), ("redis", "paced"), ("nats", "arrival")]
)
def test_a_live_surge_is_shed_on_arrival_and_waits_when_paced(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, live: str
) -> None:
    server: Server = request.getfixturevalue(f"{kind}_server")
    write_history(tmp_path)
    key = f"surge{live}{time.monotonic_ns()}"
    surge = arrive(server, kind, key)
    job: dict[str, Any] = continuous_dict(server.url, key, kind)
    job["data"]["dataset"]["streams"]["live"]["sources"][0]["stream"]["batch_max_messages"] = 500
    job["train"]["mixed_buffer"] = {"capacity_bytes": 20_000, "policy": "priority", "live": live}
    job["output"]["checkpoint_every_steps"] = None
    spec = job_from_dict(job, base_dir=tmp_path)
    trainer = Trainer(spec, callbacks=[slow := SlowSteps(0.01)])
    extra = fit_until_idle(trainer, slow).extra

    history = HISTORY_HOURS * PER_HOUR
    total = history + surge
    assert extra["stopped"] == "SIGTERM"
    settled = settle(spec, tmp_path, total, extra)  # trained + dropped = every row, once
    sources = extra["mixed_buffer"]["sources"]
    assert sources["history/synth"]["offered"] == history
    assert sources["history/synth"]["sampled_out"] == 0  # files are paced by training
    assert extra["mixed_buffer"]["peak_bytes"] <= 20_000
    if live == "arrival":
        dropped = sources["live/live"]["sampled_out"] + sources["live/live"]["evicted"]
        assert dropped > surge // 4  # the surge came faster than the steps: shed
        assert extra["rows_dropped"] == dropped + sources["history/synth"]["evicted"]
        # A resume reads only what came since: nothing trained or dropped again.
        more = arrive(server, kind, key, first_minute=SURGE_MINUTES)
        resumed = Trainer(spec, callbacks=[slow := SlowSteps(0.01)])
        resumed.load_checkpoint(tmp_path / "out")
        again = settle(spec, tmp_path, total + more, fit_until_idle(resumed, slow).extra)
        assert again["rows_committed"] + again["rows_dropped"] >= total  # the old tail too
        assert again["rows_committed"] > settled["rows_committed"]
    else:
        assert extra["rows_dropped"] == settled["rows_dropped"] == 0  # it waited in the broker


class StopAt(SlowSteps):
    """Slow steps, and a stop asked at step ``at`` (mid-surge)."""

    def __init__(self, trainer: Trainer, at: int) -> None:
        super().__init__(0.01)
        self.trainer, self.at = trainer, at

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        super().after_step(state, rows, loss)
        if self.steps == self.at:
            self.trainer.request_stop("SIGTERM")


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "estuary-mixed-reader"]


def test_a_stop_mid_surge_ends_the_reader_and_a_resume_reads_the_rest(
    redis_server: Server, tmp_path: Path
) -> None:
    write_history(tmp_path)
    key = f"midsurge{time.monotonic_ns()}"
    surge = push_surge(redis_server.url, key)
    job: dict[str, Any] = continuous_dict(redis_server.url, key)
    job["train"]["mixed_buffer"] = {"capacity_bytes": 20_000, "live": "arrival"}
    job["output"]["checkpoint_every_steps"] = None
    spec = job_from_dict(job, base_dir=tmp_path)
    before = set(readers())
    trainer = Trainer(spec)
    trainer.callbacks.append(StopAt(trainer, at=20))  # the history is 12 steps
    first = trainer.fit(progress=False).extra
    assert set(readers()) <= before  # the run's reader ended with it
    total = HISTORY_HOURS * PER_HOUR + surge
    done = first["rows_committed"] + first["rows_dropped"]
    assert first["stopped"] == "SIGTERM" and first["duplicate_rows"] == 0
    assert 20 * 20 <= done < total  # stopped mid-surge: the rest is still in Redis

    settle(spec, tmp_path, total, first)
    assert set(readers()) <= before
    # Rows arriving later end the last window: its held rows are counted too.
    more = push_surge(redis_server.url, key, first_minute=SURGE_MINUTES)
    resumed = Trainer(spec, callbacks=[slow := SlowSteps(0.01)])
    resumed.load_checkpoint(tmp_path / "out")
    final = settle(spec, tmp_path, total + more, fit_until_idle(resumed, slow).extra)
    assert final["rows_committed"] + final["rows_dropped"] >= total
    assert set(readers()) <= before
