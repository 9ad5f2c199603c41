"""Continuous training conformance, for every broker (memory, NATS, Redis): a
stream run ends, time passes (longer than the window and the idle timeout), new
messages arrive, ``estuary train --resume`` trains exactly the messages not
trained before, each once.

The first run ends three ways: cleanly on the idle timeout, by SIGTERM (it
finishes the step and checkpoints it) and by SIGKILL after a checkpoint. It is
an ``estuary train`` child process; the resume is ``estuary train --resume`` in
this process, checked against the row ledger of its final checkpoint (every
good message's rid once) and its ``summary.json`` (``train_rows``).

One window holds 13 splits (130 messages, 10 per split): offsets cross a digit
boundary, so split names sorted as text (``after 90 ...`` after ``after 120
...``) put them out of stream order (issue 17: the resume re-trained messages).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from estuary.cli import main
from estuary.data.graph import Progress
from estuary.data.streams import open_publisher
from estuary.data.streams.memory import memory_stream
from estuary.train import load_checkpoint

from .conftest import Server
from .test_dataset_stream import COLUMNS, SCHEMA, rows, trained_rids

FIRST, LATER = 130, 40  # messages before and after the gap
SPLIT, BATCH, EVERY = 10, 8, 4  # messages per split, rows per step, steps per checkpoint
WINDOW_S, IDLE_S = 1, 0.5
GAP_S = WINDOW_S + IDLE_S + 0.5  # longer than the window and the idle timeout
STOP_AT = 9  # SIGTERM / SIGKILL inside this step (a checkpoint was taken at step 8)

# The first run: `estuary train JOB --no-progress`, with a signal sent just before
# step `at` (none for "idle"); a memory broker lives in this process, so its
# messages are appended here first (same offsets and broker times as the test's).
CHILD = """
import os, signal, sys
from estuary.data.streams.memory import memory_stream
from estuary.train import Trainer
from estuary.train.callbacks import FaultInjection

url, key, stamp, payloads, ending, at = {args!r}
if url.startswith("memory://"):
    memory_stream(url, key).append([p.encode() for p in payloads], timestamp_ms=stamp)


def stop(state):  # just before step `at`: the signal lands mid-run
    os.kill(os.getpid(), getattr(signal, ending))


if ending != "idle":
    Trainer.default_callbacks.append(lambda: FaultInjection(stop, at_step=at))
from estuary.cli import main

sys.exit(main(["train", {job!r}, "--no-progress"]))
"""


def _job(root: Path, stream: dict[str, Any]) -> Path:
    source = {
        "name": "live",
        "type": "stream",
        "window_s": WINDOW_S,
        "stream": {
            **stream,
            "format": "csv",
            "columns": COLUMNS,
            "batch_max_messages": SPLIT,
            "poll_timeout_s": 0.2,
        },
    }
    job = {
        "data": {
            "schema": SCHEMA,
            "max_bad_row_ratio": 0.2,
            "dataset": {
                "streams": {"s": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.02, "idle_timeout_s": IDLE_S},
                "shuffle": {"buffer_rows": 40, "interleave_splits": 2},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": BATCH, "seed": 0, "threads": 1},
        "output": {"dir": str(root / "out"), "progress": False, "checkpoint_every_steps": EVERY},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


class Broker:
    """One broker's side of the test: where the job reads and how to publish."""

    def __init__(self, kind: str, url: str, stream: dict[str, Any], target: str) -> None:
        self.kind, self.url, self.stream, self.target = kind, url, stream, target
        self.stamp = int(time.time() * 1000)  # memory: broker time of the first messages

    def publish(self, payloads: list[bytes], *, first: bool) -> list[str]:
        if self.kind == "memory":
            stamp = self.stamp if first else None  # later: the time now
            appended = memory_stream(self.url, self.target).append(payloads, timestamp_ms=stamp)
            return [str(o) for o in appended]
        if first:  # one window: start just after a whole second
            time.sleep(1.0 - time.time() % 1.0 + 0.02)
        publisher = open_publisher(f"{self.url}/{self.target}")
        try:
            return [str(o) for o in publisher.publish(payloads)]
        finally:
            publisher.close()


def _memory(_request: pytest.FixtureRequest) -> Broker:
    url, key = f"memory://resume-{uuid.uuid4().hex[:8]}", "clicks"
    return Broker("memory", url, {"kind": "memory", "url": url, "key": key}, key)


def _nats(request: pytest.FixtureRequest) -> Broker:
    server: Server = request.getfixturevalue("nats_server")
    subject = f"resume-{uuid.uuid4().hex[:8]}"
    return Broker(
        "nats", server.url, {"kind": "nats", "url": server.url, "subject": subject}, subject
    )


def _redis(request: pytest.FixtureRequest) -> Broker:
    server: Server = request.getfixturevalue("redis_server")
    key = f"resume-{uuid.uuid4().hex[:8]}"
    return Broker("redis", server.url, {"kind": "redis", "url": server.url, "key": key}, key)


BROKERS: dict[str, Callable[[pytest.FixtureRequest], Broker]] = {
    "memory": _memory,
    "nats": _nats,
    "redis": _redis,
}


def _first_run(root: Path, job: Path, broker: Broker, payloads: list[bytes], ending: str) -> int:
    args = (broker.url, broker.target, broker.stamp, [p.decode() for p in payloads], ending)
    script = root / "first_run.py"
    script.write_text(CHILD.format(args=(*args, STOP_AT), job=str(job)))
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=root
    )
    assert "Traceback" not in run.stderr, run.stderr
    return run.returncode


@pytest.mark.parametrize("ending", ["idle", "SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("kind", list(BROKERS))
def test_a_resume_after_a_gap_trains_exactly_the_untrained_messages(
    kind: str, ending: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    broker = BROKERS[kind](request)
    payloads, good = rows(FIRST + LATER, seed=3)
    offsets = broker.publish(payloads[:FIRST], first=True)
    job = _job(tmp_path, broker.stream)

    code = _first_run(tmp_path, job, broker, payloads[:FIRST], ending)
    expected_code = {"idle": 0, "SIGTERM": 128 + signal.SIGTERM, "SIGKILL": -signal.SIGKILL}
    assert code == expected_code[ending]
    out = tmp_path / "out"
    before = Progress.from_json(load_checkpoint(out).manifest["metadata"]["data_progress"])
    assert before.duplicate_rows == 0
    if ending == "idle":  # the whole first window was trained and committed
        assert before.rows_trained == sum(rid < FIRST for rid in good)
        assert str(before.stream_offsets["s/live"]["offset"]) == offsets[-1]

    time.sleep(GAP_S)
    offsets += broker.publish(payloads[FIRST:], first=False)
    assert main(["train", str(job), "--no-progress", "--resume"]) == 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_rows"] == len(good) - before.rows_trained
    assert summary["rows_committed"] == len(good)
    assert summary["duplicate_rows"] == 0
    if ending == "idle":
        assert summary["train_rows"] == sum(rid >= FIRST for rid in good)
    after = Progress.from_json(load_checkpoint(out).manifest["metadata"]["data_progress"])
    rids = {offset: i for i, offset in enumerate(offsets)}
    assert sorted(trained_rids(after, offsets, rids)) == good  # each good message once
    assert str(after.stream_offsets["s/live"]["offset"]) == offsets[-1]
