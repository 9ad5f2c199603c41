"""``train.continuous``: history files, then a live Redis or NATS JetStream stream
until stopped; the stop ends the run with a checkpoint and the progressive table,
and a resume trains only what arrived since, each row once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from estuary.config import ConfigError, JobSpec, job_from_dict
from estuary.data.graph import Progress
from estuary.data.synthetic import SyntheticSpec, SynthOutput, write_synthetic
from estuary.train import Trainer, load_checkpoint
from estuary.train.callbacks import Callback, LoopState
from estuary.train.checkpoint_chain import CheckpointError, read_manifest, resolve_checkpoint
from estuary.train.result import FitResult

from .conftest import Server

START = datetime(2026, 1, 1, tzinfo=UTC)
START_MS = int(START.timestamp() * 1000)
HISTORY_HOURS, PER_HOUR, BATCH, EVERY = 2, 120, 20, 4
STREAM_MINUTES, PER_MINUTE = 3, 40  # live rows: 3 one-minute windows after the history
COLUMNS = ["label", "I1", "I2", "C1", "C2"]


def write_history(root: Path) -> None:
    spec = SyntheticSpec(
        rows_per_hour=PER_HOUR,
        hours=HISTORY_HOURS,
        start=START,
        num_dense=2,
        vocab_sizes=(30, 30),
        num_interactions=0,
        diurnal_amplitude=0.0,
        missing_rate=0.0,
        seed=1,
    )
    write_synthetic(spec, root / "data", SynthOutput(format="criteo_tsv"))


def push(url: str, key: str, minutes: range, seed: int, per_minute: int = PER_MINUTE) -> int:
    """``per_minute`` csv rows per minute ``m`` of ``minutes``, at broker time
    START + HISTORY_HOURS h + m min (+ i ms); returns how many."""
    import redis

    rng = np.random.default_rng(seed)
    client = redis.Redis.from_url(url)
    pipe = client.pipeline(transaction=False)
    n = 0
    for minute in minutes:
        at = START_MS + HISTORY_HOURS * 3_600_000 + minute * 60_000
        for i in range(per_minute):
            label = int(rng.random() < 0.3)
            i1, i2, c1, c2 = (int(v) for v in rng.integers(0, 20, 4))
            pipe.xadd(key, {"data": f"{label},{i1},{i2},{c1:x},{c2:x}"}, id=f"{at + i}-0")
            n += 1
    pipe.execute()
    client.close()
    return n


def publish(url: str, subject: str, count: int, seed: int) -> int:
    """``count`` csv rows published now (the broker stamps them; NATS has no
    client-set time); returns how many."""
    from estuary.data.streams import open_publisher

    rng = np.random.default_rng(seed)
    publisher = open_publisher(f"{url}/{subject}")
    try:
        payloads = []
        for _ in range(count):
            label = int(rng.random() < 0.3)
            i1, i2, c1, c2 = (int(v) for v in rng.integers(0, 20, 4))
            payloads.append(f"{label},{i1},{i2},{c1:x},{c2:x}".encode())
        publisher.publish(payloads)
    finally:
        publisher.close()
    return count


def continuous_job(root: Path, url: str, key: str, kind: str = "redis") -> JobSpec:
    return job_from_dict(continuous_dict(url, key, kind), base_dir=root)


def continuous_dict(url: str, key: str, kind: str = "redis") -> dict[str, Any]:
    """The continuous job as a job file's dict (paths relative to its folder)."""
    history = {
        "name": "synth",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
        "columns": COLUMNS,
        "start": "2026-01-01T00",
        "end": f"2026-01-01T{HISTORY_HOURS:02d}",
    }
    live = {
        "name": "live",
        "type": "stream",
        "window_s": 60,
        "stream": {
            "kind": kind,
            "url": url,
            ("key" if kind == "redis" else "subject"): key,
            "format": "csv",
            "columns": COLUMNS,
            "batch_max_messages": 25,
            "poll_timeout_s": 0.1,
        },
    }
    return {
        "data": {
            "schema": {"dense": ["I1", "I2"], "sparse": ["C1", "C2"]},
            "dataset": {
                "streams": {
                    "history": {"sources": [history]},
                    "live": {"sources": [live]},
                },
                # no idle_timeout_s: wait for the stream until stopped
                "timer": {"poll_interval_s": 0.02, "ready_timeout_s": 5},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {
            "batch_size": BATCH,
            "threads": 1,
            "continuous": True,
            "progressive_eval": True,
        },
        "output": {"dir": "out", "progress": False, "checkpoint_every_steps": EVERY},
    }


class Live(Callback):
    """Counts trained rows; pushes more stream rows at a step (rows arriving
    while the run trains)."""

    def __init__(self, at_step: int, arrive: Any) -> None:
        self.rows, self.at_step, self.arrive = 0, at_step, arrive

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        self.rows += rows
        if state.step == self.at_step:
            self.arrive()


def fit_stopped_when(
    trainer: Trainer, ready: Callable[[], bool], timeout_s: float, then_s: float = 0.0
) -> FitResult:
    """Fit; once ``ready()`` (or after ``timeout_s``) and ``then_s`` more, stop
    it (SIGTERM's ``request_stop``) from another thread."""

    def stopper() -> None:
        deadline = time.monotonic() + timeout_s
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(then_s)
        trainer.request_stop("SIGTERM")

    thread = threading.Thread(target=stopper, daemon=True)
    thread.start()
    try:
        return trainer.fit(progress=False)
    finally:
        thread.join(timeout=timeout_s + then_s + 5)


def run_until(trainer: Trainer, live: Live, rows: int, timeout_s: float = 90) -> FitResult:
    """Fit; once ``rows`` rows were trained and the reader waits (0.5 s later),
    stop it. The stop ends the run normally."""
    return fit_stopped_when(trainer, lambda: live.rows >= rows, timeout_s, then_s=0.5)


def test_history_then_a_live_stream_until_stopped_then_resume(
    redis_server: Server, tmp_path: Path
) -> None:
    write_history(tmp_path)
    key = "continuous"
    first_half = push(redis_server.url, key, range(0, 2), seed=1)
    later: list[int] = []
    job = continuous_job(tmp_path, redis_server.url, key)
    history_rows = HISTORY_HOURS * PER_HOUR

    def arrive() -> None:
        later.append(push(redis_server.url, key, range(2, STREAM_MINUTES), seed=2))

    live = Live(at_step=3, arrive=arrive)  # during the history
    total = history_rows + first_half + PER_MINUTE * (STREAM_MINUTES - 2)
    trainer = Trainer(job, callbacks=[live])
    result = run_until(trainer, live, total)
    extra = result.extra
    assert later == [PER_MINUTE * (STREAM_MINUTES - 2)]
    assert extra["stopped"] == "SIGTERM"
    assert result.train_rows == extra["rows_committed"] == total
    assert extra["duplicate_rows"] == 0
    # The progressive table: every window, history hours then stream minutes.
    report = extra["progressive"]
    assert report["origins"]["history/synth"]["rows"] == history_rows
    assert report["origins"]["live/live"]["rows"] == total - history_rows
    windows = report["windows"]
    assert [(w["start"], w["rows"]) for w in windows[:HISTORY_HOURS]] == [
        ("2026-01-01T00:00:00Z", PER_HOUR),
        ("2026-01-01T01:00:00Z", PER_HOUR),
    ]
    # Stream windows: consecutive minutes from the first message's (rows that
    # arrive after the reader caught up land in the window then planned).
    live_starts = [w["start"] for w in windows[HISTORY_HOURS:]]
    assert live_starts[:2] == ["2026-01-01T02:00:00Z", "2026-01-01T02:01:00Z"]
    assert live_starts == sorted(set(live_starts))
    assert sum(w["rows"] for w in windows) == total
    # Periodic checkpoints, and the stop's one holds every trained row.
    out = job.resolve(job.output.dir)
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps and result.checkpoint is not None
    saved = load_checkpoint(result.checkpoint)
    progress = Progress.from_json(saved.manifest["metadata"]["data_progress"])
    assert progress.rows_trained == total and progress.duplicate_rows == 0

    # More rows arrive while nothing runs; the resumed run trains only them.
    more = push(redis_server.url, key, range(STREAM_MINUTES, STREAM_MINUTES + 2), seed=3)
    resumed = Trainer(job, callbacks=[live := Live(at_step=-1, arrive=None)])
    resumed.load_checkpoint(out)
    again = run_until(resumed, live, more).extra
    assert again["rows_committed_before"] == total
    assert again["rows_committed"] == total + more
    assert again["duplicate_rows"] == 0
    # The progressive figures went on from the checkpoint's (saved with it).
    figures = again["progressive"]
    assert figures["rows"] == total + more
    assert figures["origins"]["live/live"]["rows"] == total + more - history_rows
    assert figures["windows"][:HISTORY_HOURS] == windows[:HISTORY_HOURS]


def test_history_then_a_live_nats_stream_until_stopped_then_resume(
    nats_server: Server, tmp_path: Path
) -> None:
    """The same on NATS JetStream: acknowledged progress is the stream sequence
    the checkpoint holds, so the resumed run trains the new messages only."""
    write_history(tmp_path)
    subject = f"continuous{time.monotonic_ns()}"
    before = publish(nats_server.url, subject, 2 * PER_MINUTE, seed=1)
    later: list[int] = []
    job = continuous_job(tmp_path, nats_server.url, subject, kind="nats")
    history_rows = HISTORY_HOURS * PER_HOUR

    def arrive() -> None:
        later.append(publish(nats_server.url, subject, PER_MINUTE, seed=2))

    live = Live(at_step=3, arrive=arrive)  # during the history
    total = history_rows + before + PER_MINUTE
    trainer = Trainer(job, callbacks=[live])
    result = run_until(trainer, live, total)
    extra = result.extra
    assert later == [PER_MINUTE]
    assert extra["stopped"] == "SIGTERM"
    assert result.train_rows == extra["rows_committed"] == total
    assert extra["duplicate_rows"] == 0
    report = extra["progressive"]
    assert report["origins"]["history/synth"]["rows"] == history_rows
    assert report["origins"]["live/live"]["rows"] == total - history_rows
    assert sum(w["rows"] for w in report["windows"]) == total
    out = job.resolve(job.output.dir)
    assert result.checkpoint is not None
    progress = Progress.from_json(
        load_checkpoint(result.checkpoint).manifest["metadata"]["data_progress"]
    )
    assert progress.rows_trained == total and progress.duplicate_rows == 0

    more = publish(nats_server.url, subject, PER_MINUTE, seed=3)
    resumed = Trainer(job, callbacks=[live := Live(at_step=-1, arrive=None)])
    resumed.load_checkpoint(out)
    again = run_until(resumed, live, more).extra
    assert again["rows_committed_before"] == total
    assert again["rows_committed"] == total + more
    assert again["duplicate_rows"] == 0


def test_two_trainers_run_continuously_until_sigterm(redis_server: Server, tmp_path: Path) -> None:
    """``estuary train --nproc 2`` (two gloo trainers, one PS process): once the
    history and the stream so far are trained and checkpointed, SIGTERM to the
    launcher ends the run as the end of the data would: exit 0, every row once."""
    write_history(tmp_path)
    key = f"continuous2-{time.monotonic_ns()}"
    stream_rows = push(redis_server.url, key, range(0, 2), seed=4)
    total = HISTORY_HOURS * PER_HOUR + stream_rows
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(continuous_dict(redis_server.url, key)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "estuary.cli", "train", "job.yaml", "--nproc", "2", "-q"],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while checkpointed_rows(tmp_path / "out") < total:  # then the reader waits
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never trained every row"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stopped"] == "SIGTERM"
    assert summary["rows_committed"] == total and summary["duplicate_rows"] == 0
    assert summary["progressive"]["scope"].endswith("(1 of 2 trainers)")


def checkpointed_rows(out: Path) -> int:
    """Rows trained per the newest checkpoint's data progress (0 before the first)."""
    try:
        manifest = read_manifest(resolve_checkpoint(out))
    except (CheckpointError, FileNotFoundError):
        return 0
    return Progress.from_json(manifest["metadata"]["data_progress"]).rows_trained


def test_continuous_needs_a_dataset_job() -> None:
    with pytest.raises(ConfigError) as err:
        job_from_dict(
            {
                "data": {
                    "sources": [{"path": "x.tsv"}],
                    "schema": {"dense": ["I1"], "sparse": ["C1"]},
                },
                "train": {"continuous": True},
            }
        )
    assert err.value.path == "train.continuous"
