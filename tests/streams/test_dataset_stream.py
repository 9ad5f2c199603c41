"""Stream sources in a dataset (``type: stream``): exactly once under SIGKILL
with a real Redis server and a real NATS JetStream server, and a file source
and a stream source read in plan order from one dataset.

The killed run is a child process (the same pattern as
``tests/graph/test_kill_resume.py``); the resume runs in this process.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from estuary.config import job_from_dict, load_job
from estuary.data.graph import Driver, Progress
from estuary.data.graph.streams import parse_split_name, split_name
from estuary.data.streams.memory import memory_stream
from estuary.train import Trainer, load_checkpoint
from estuary.train.checkpoint_chain import LATEST

from .conftest import Server

COLUMNS = ["rid", "label", "I1", "I2", "C1", "C2"]
SCHEMA = {"dense": ["I1", "I2"], "sparse": ["C1", "C2"]}
START_MS = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1000)
ROWS, WINDOWS, BATCH, EVERY, BAD_EVERY = 240, 4, 16, 3, 11

CHILD = """
import os, signal
from estuary.config import load_job
from estuary.train import Trainer

os.chdir(root)
from estuary.train.callbacks import FaultInjection

def die(state):  # killed just before training step `at`
    os.kill(os.getpid(), signal.SIGKILL)

trainer = Trainer(load_job(job_path), callbacks=[FaultInjection(die, at_step=at)])
trainer.fit(progress=False)
"""


def rows(n: int, seed: int = 0) -> tuple[list[bytes], list[int]]:
    """``n`` csv payloads (``COLUMNS``, ``rid`` = 0..n-1) and the good rids
    (every ``BAD_EVERY``-th row has the invalid label 7)."""
    rng = np.random.default_rng(seed)
    payloads, good = [], []
    for rid in range(n):
        label = 7 if (rid + 1) % BAD_EVERY == 0 else int(rng.random() < 0.3)
        if label != 7:
            good.append(rid)
        i1, i2, c1, c2 = (int(v) for v in rng.integers(0, 9, 4))
        payloads.append(f"{rid},{label},{i1},{i2},{c1:04x},{c2:04x}".encode())
    return payloads, good


def stream_job(
    root: Path, name: str, stream: dict[str, Any], seed: int, window_s: int = 60
) -> Path:
    source = {
        "name": "live",
        "type": "stream",
        "window_s": window_s,
        "stream": {
            **stream,
            "format": "csv",
            "columns": COLUMNS,
            "batch_max_messages": 25,
            "poll_timeout_s": 0.2,
        },
    }
    job: dict[str, Any] = {
        "data": {
            "schema": SCHEMA,
            "max_bad_row_ratio": 0.2,
            "dataset": {
                "streams": {"s": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.02, "idle_timeout_s": 0.5},
                "shuffle": {"buffer_rows": 40, "interleave_splits": 2},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": BATCH, "seed": seed, "threads": 1},
        "output": {"dir": f"out-{name}", "progress": False, "checkpoint_every_steps": EVERY},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def trained_rids(progress: Progress, offsets: list[str], rids: dict[str, int]) -> list[int]:
    """The rid of every trained row of the progress ledger (a rid twice if trained twice).

    ``offsets``: every message's offset as text, in stream order; a split named
    ``after X`` with X not among them starts at the first message."""
    position = {offset: i for i, offset in enumerate(offsets)}
    out = []
    for splits in progress.accounting().values():
        for name, ranges in splits.items():
            after, last, count = parse_split_name(name)
            first = position[after] + 1 if after in position else 0
            assert position[last] == first + count - 1, name
            out += [rids[offsets[first + r - 1]] for a, b in ranges for r in range(a, b)]
    return out


def kill_then_resume(
    root: Path,
    job_path: Path,
    offsets: list[str],
    good: list[int],
    kill_seed: int,
    source: str = "s/live",
) -> Progress:
    """SIGKILL a training run of ``job_path`` at a seeded random step, resume it in
    this process, and check the final checkpoint trained every good message of
    ``source`` (``stream/source``, offsets in stream order) once; its progress."""
    rids = {offset: i for i, offset in enumerate(offsets)}
    steps = -(-len(good) // BATCH)
    kill_at = int(np.random.default_rng(kill_seed).integers(EVERY + 2, steps - 2))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["estuary.train", "torch._dynamo"])
    scope = {"root": str(root), "job_path": str(job_path), "at": kill_at}
    child = context.Process(target=exec, args=(CHILD, scope), daemon=True)
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, child.exitcode

    job = load_job(job_path)
    out = job.resolve(job.output.dir)
    assert (out / "checkpoints" / LATEST).is_file()
    trainer = Trainer(job)
    trainer.load_checkpoint(out)
    saved = load_checkpoint(out)
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, saved.dense[name])
    committed_before = trainer.step
    assert committed_before == (kill_at - 1) // EVERY * EVERY
    before = Progress.from_json(saved.manifest["metadata"]["data_progress"])
    assert before.rows_trained == committed_before * BATCH
    partly = [r for r in before.tasks.values() if r.splits and not r.committed]
    assert partly, "the kill should leave a partly trained window (its splits are re-read)"

    result = trainer.fit(progress=False)
    assert result.extra["rows_committed_before"] == committed_before * BATCH
    final = load_checkpoint(out)
    progress = Progress.from_json(final.manifest["metadata"]["data_progress"])
    assert progress.duplicate_rows == 0
    assert sorted(trained_rids(progress, offsets, rids)) == good
    assert progress.rows_trained == len(good)
    # Every window was committed: the last offset is the source's committed position.
    assert str(progress.stream_offsets[source]["offset"]) == offsets[-1]
    assert result.bad_rows == len(offsets) - len(good)  # the job's, once each
    assert progress.bad_rows == len(offsets) - len(good)
    assert progress.rows_read == len(offsets)
    return progress


def test_split_names_round_trip() -> None:
    assert parse_split_name(split_name("0-0", "17-3", 5)) == ("0-0", "17-3", 5)
    assert parse_split_name(split_name(3, 4, 1)) == ("3", "4", 1)
    with pytest.raises(ValueError):
        parse_split_name("data/part-0.tsv")


def test_redis_stream_sigkill_then_resume_trains_each_message_once(
    redis_server: Server, tmp_path: Path
) -> None:
    import redis

    key = "dataset-kill"
    payloads, good = rows(ROWS)
    client = redis.Redis.from_url(redis_server.url)
    offsets = []
    for i, payload in enumerate(payloads):  # WINDOWS minutes of broker time
        offset = f"{START_MS + i * (WINDOWS * 60_000 // ROWS)}-{i}"
        offsets.append(client.xadd(key, {"data": payload}, id=offset).decode())
    client.close()
    stream = {"kind": "redis", "url": redis_server.url, "key": key}
    job_path = stream_job(tmp_path, "kill", stream, seed=0)
    kill_then_resume(tmp_path, job_path, offsets, good, kill_seed=7)


def test_nats_stream_sigkill_then_resume_trains_each_message_once(
    nats_server: Server, tmp_path: Path
) -> None:
    """The same on JetStream: its broker time is the publish time, so the rows are
    published in WINDOWS bursts one second apart, for WINDOWS 1-second windows.
    Each burst starts just after a whole second, the first too. (A first burst
    that straddled a second made a small window of its first messages, trained
    whole and committed before the kill; when the resumed run counted only the
    bad rows it read, that window's bad row was missing: bad_rows 20, not 21.
    The count is the job's now, kept in the checkpoint: docs/data.md, "Bad
    rows".)"""
    from estuary.data.streams import open_publisher

    subject = "dataset-kill-nats"
    payloads, good = rows(ROWS, seed=1)
    publisher = open_publisher(f"{nats_server.url}/{subject}")
    offsets: list[str] = []
    burst = ROWS // WINDOWS
    for w in range(WINDOWS):
        time.sleep(1.0 - time.time() % 1.0 + 0.01)  # into the next whole second
        offsets += [str(o) for o in publisher.publish(payloads[w * burst : (w + 1) * burst])]
    publisher.close()
    stream = {"kind": "nats", "url": nats_server.url, "subject": subject}
    job_path = stream_job(tmp_path, "kill-nats", stream, seed=1, window_s=1)
    kill_then_resume(tmp_path, job_path, offsets, good, kill_seed=8)


def test_file_and_stream_sources_are_read_in_plan_order(tmp_path: Path) -> None:
    hour_ms = 3_600_000
    url, key = "memory://plan-order", "clicks"
    broker = memory_stream(url, key)
    payloads, _ = rows(12)
    for hour in range(2):  # 6 messages at 00:30, 6 at 01:30
        broker.append(payloads[hour * 6 : hour * 6 + 6], START_MS + hour * hour_ms + hour_ms // 2)
    for hour in range(2):
        folder = tmp_path / "data" / "20260101" / f"{hour:02d}"
        folder.mkdir(parents=True)
        (folder / "part-0.csv").write_text(
            "rid,label,I1,I2,C1,C2\n"
            + "".join(f"{100 + hour * 10 + i},1,1,2,a,b\n" for i in range(4))
        )
        (folder / "_SUCCESS").write_text("")
    files = {
        "name": "logs",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.csv",
        "format": "csv",
        "start": "2026-01-01T00",
    }
    live = {
        "name": "live",
        "type": "stream",
        "window_s": 3600,
        "stream": {
            "kind": "memory",
            "url": url,
            "key": key,
            "format": "csv",
            "columns": COLUMNS,
            "batch_max_messages": 4,
            "poll_timeout_s": 0.1,
        },
    }
    job = job_from_dict(
        {
            "data": {
                "schema": SCHEMA,
                "max_bad_row_ratio": 0.5,
                "dataset": {
                    "streams": {
                        "history": {"sources": [files]},
                        "realtime": {"priority": 1, "sources": [live]},
                    },
                    "timer": {"poll_interval_s": 0.01, "idle_timeout_s": 0.3},
                },
            }
        },
        base_dir=tmp_path,
    )
    driver = Driver(job.data, tmp_path, batch_size=3, shuffle=False)
    order: list[str] = []
    for batch in driver.batches():
        assert batch.row_ids is not None
        for row_id in batch.row_ids:
            task = driver.progress.row_identity(int(row_id)).task.id
            if not order or order[-1] != task:
                order.append(task)
        driver.progress.record(batch.row_ids)
    # Time first; at equal window starts the higher-priority stream goes first.
    assert order == [
        "realtime/live@2026010100",
        "history/logs@2026010100",
        "realtime/live@2026010101",
        "history/logs@2026010101",
    ]
    assert driver.progress.duplicate_rows == 0
    assert driver.progress.rows_trained == 12 - 1 + 8  # one bad message (rid 10)
    assert driver.progress.stream_offsets["realtime/live"]["offset"] == 12
    names = [n for splits in driver.progress.accounting().values() for n in splits]
    assert split_name(0, 4, 4) in names and split_name(10, 12, 2) in names


def reading_job(root: Path, stream: dict[str, Any]) -> Any:
    live = {"name": "live", "type": "stream", "window_s": 60, "stream": stream}
    return job_from_dict(
        {
            "data": {
                "schema": SCHEMA,
                "max_bad_row_ratio": 0.2,
                "dataset": {
                    "streams": {"s": {"sources": [live]}},
                    "timer": {"poll_interval_s": 0.01, "idle_timeout_s": 0.3},
                },
            }
        },
        base_dir=root,
    )


@pytest.mark.parametrize("kind", ["nats", "redis"])
def test_a_resumed_read_continues_after_the_trained_messages(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Train part of the messages, save the progress, publish more, resume: every
    message once, partly trained splits read again from the broker by offset."""
    from estuary.data.streams import open_publisher

    server: Server = request.getfixturevalue(f"{kind}_server")
    target = f"dataset-resume-{kind}"
    publisher = open_publisher(f"{server.url}/{target}")
    payloads, good = rows(60)
    publisher.publish(payloads[:40])
    key = {"subject": target} if kind == "nats" else {"key": target}
    stream = {
        "kind": kind,
        "url": server.url,
        **key,
        "format": "csv",
        "columns": COLUMNS,
        "batch_max_messages": 7,
        "poll_timeout_s": 0.2,
    }
    job = reading_job(tmp_path, stream)

    def read(progress: Progress, limit: int | None) -> None:
        driver = Driver(job.data, tmp_path, batch_size=5, shuffle=False, progress=progress)
        for batch in driver.batches():
            progress.record(batch.row_ids)
            if limit is not None and progress.rows_trained >= limit:
                break
        driver.close()

    first = Progress()
    read(first, 17)  # stops inside a split (splits of 7 messages)
    saved = first.to_json()
    assert any(not t["committed"] and t["splits"] for t in saved["tasks"])
    publisher.publish(payloads[40:])
    publisher.close()
    resumed = Progress.from_json(saved)
    read(resumed, None)
    assert resumed.duplicate_rows == 0
    assert resumed.rows_trained == len(good)
    names = [n for splits in resumed.accounting().values() for n in splits]
    counts = [parse_split_name(n)[2] for n in names]
    assert sum(counts) == 60  # every message in exactly one split


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"sources\[0\]\.stream: type 'stream' needs the stream section"),
        ({"path": "x/{{YYYY}}{{MM}}{{DD}}", "stream": "S"}, r"sources\[0\]\.path: not used"),
        ({"start": "2026-01-01", "stream": "S"}, r"sources\[0\]\.start: not used.*stream\.start"),
        ({"window_s": 0, "stream": "S"}, r"sources\[0\]\.window_s: must be >= 1"),
        ({"stream": {"kind": "redis", "url": "nats://x"}}, r"sources\[0\]\.stream\.url"),
    ],
)
def test_stream_source_config_errors(fields: dict[str, Any], message: str) -> None:
    from estuary.config import ConfigError

    spec = {"kind": "memory", "url": "memory://", "key": "k", "format": "jsonl"}
    source = {"name": "live", "type": "stream", **fields}
    if source.get("stream") == "S":
        source["stream"] = spec
    with pytest.raises(ConfigError, match=message):
        job_from_dict(
            {"data": {"schema": SCHEMA, "dataset": {"streams": {"s": {"sources": [source]}}}}}
        )


def test_a_file_source_refuses_a_stream_section_and_needs_a_path() -> None:
    from estuary.config import ConfigError

    spec = {"kind": "memory", "url": "memory://", "key": "k", "format": "jsonl"}
    for source, message in [
        ({"name": "a", "start": "2026-01-01", "path": "x/{{YYYY}}{{MM}}{{DD}}", "stream": spec},
         r"sources\[0\]\.stream: only for type 'stream'"),
        ({"name": "a", "start": "2026-01-01"}, r"sources\[0\]\.path: required for type 'files'"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            job_from_dict(
                {"data": {"schema": SCHEMA, "dataset": {"streams": {"s": {"sources": [source]}}}}}
            )
