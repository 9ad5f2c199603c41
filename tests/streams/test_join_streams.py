"""Joins with live streams: impressions from a stream labelled by clicks from a
stream (or files), within ``wait_s``, waiting for late events, with exactly-once
progress of both sides across a resume (the in-memory broker) and a SIGKILL
(a real Redis server).

Broker time is the window clock: an impression stored at ``t`` sits in the
window ``[s, e)`` containing ``t`` and is labelled from the clicks stored in
``[s, e + wait_s)`` whose event time lies in ``[t, t + wait_s]``.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from estuary.config import job_from_dict
from estuary.data.graph import Driver, Progress
from estuary.data.graph.streams import parse_split_name
from estuary.data.streams.memory import memory_stream

from .conftest import Server
from .test_dataset_stream import BATCH, EVERY, START_MS, kill_then_resume

IMP_COLUMNS = ["rid", "req", "t_ms", "I1", "I2", "C1", "C2"]
CLK_COLUMNS = ["req", "t_ms"]
SCHEMA = {"dense": ["I1", "I2"], "sparse": ["C1", "C2"]}
S = 1000  # ms
WAIT_S = 30


def impression(rid: int, t_ms: int | str) -> bytes:
    return f"{rid},q{rid},{t_ms},{rid % 7},{rid % 3},c{rid % 5},d{rid % 4}".encode()


def click(rid: int, t_ms: int) -> bytes:
    return f"q{rid},{t_ms}".encode()


def stream(kind: str, url: str, target: str, columns: list[str]) -> dict[str, Any]:
    key = {"subject": target} if kind == "nats" else {"key": target}
    return {
        "kind": kind,
        "url": url,
        **key,
        "format": "csv",
        "columns": columns,
        "batch_max_messages": 10,
        "poll_timeout_s": 0.1,
    }


def join_dataset(imp: dict[str, Any], clk: dict[str, Any], window_s: int = 60) -> dict[str, Any]:
    return {
        "streams": {
            "s": {
                "sources": [
                    {"name": "impressions", "type": "stream", "window_s": window_s, "stream": imp},
                    {"name": "clicks", "type": "stream", "stream": clk},
                ],
                "join": {
                    "left": "impressions",
                    "right": "clicks",
                    "key": "req",
                    "time_column": "t_ms",
                    "wait_s": WAIT_S,
                },
            }
        },
        "timer": {"poll_interval_s": 0.02, "idle_timeout_s": 0.4},
    }


def memory_job(root: Path, name: str, window_s: int = 60) -> Any:
    url = f"memory://{name}"
    dataset = join_dataset(
        stream("memory", url, "imp", IMP_COLUMNS),
        stream("memory", url, "clk", CLK_COLUMNS),
        window_s,
    )
    data = {"schema": SCHEMA, "max_bad_row_ratio": 0.3, "dataset": dataset}
    return job_from_dict({"data": data}, base_dir=root)


def labels_by_rid(driver: Driver, batches: list[Any], first_offset: int = 1) -> dict[int, float]:
    """rid -> label of every row of ``batches`` (memory offsets count from 1 = rid 0)."""
    out: dict[int, float] = {}
    for batch in batches:
        for row_id, label in zip(batch.row_ids, batch.labels, strict=True):
            who = driver.progress.row_identity(int(row_id))
            after = int(parse_split_name(who.split)[0])
            rid = after + who.row - first_offset
            assert rid not in out
            out[rid] = float(label)
    return out


def test_stream_impressions_are_labelled_by_stream_clicks_within_the_wait(
    tmp_path: Path,
) -> None:
    job = memory_job(tmp_path, "join-cases")
    imp = memory_stream("memory://join-cases", "imp")
    clk = memory_stream("memory://join-cases", "clk")
    cases = [  # (impression time, click time or None) -> label
        (5, 20),  # 15 s later: 1
        (50, 40),  # click before the impression: 0
        (59, 80),  # click in the next window, 21 s later (a late event): 1
        (10, 100),  # 90 s later, past wait_s: 0
        (70, 75),  # second window: 1
        (75, None),  # no click: 0
    ]
    for rid, (t_imp, _) in enumerate(cases):
        imp.append([impression(rid, START_MS + t_imp * S)], START_MS + t_imp * S)
    imp.append([impression(len(cases), "not-a-time")], START_MS + 80 * S)  # a bad row
    for rid, (_, t_clk) in sorted(enumerate(cases), key=lambda c: c[1][1] or 0):
        if t_clk is not None:
            clk.append([click(rid, START_MS + t_clk * S)], START_MS + t_clk * S)

    driver = Driver(job.data, tmp_path, batch_size=4, shuffle=False)
    batches = list(driver.batches())
    got = labels_by_rid(driver, batches)
    assert got == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0, 5: 0.0}
    assert driver.bad_rows.count == 1
    assert "field t_ms: 'not-a-time' is not a whole number of ms" in str(
        driver.bad_rows.examples[0]
    )
    for batch in batches:
        driver.progress.record(batch.row_ids)
    offsets = driver.progress.stream_offsets
    assert offsets["s/impressions"]["offset"] == 7
    # The clicks may resume after the last one stored before the last window's
    # end (120 s): a later window needs only clicks stored from then on.
    assert offsets["s/clicks"]["offset"] == 5  # all five, stored at 20 ... 100 s


def test_a_window_waits_for_late_clicks_until_its_end_plus_the_wait(tmp_path: Path) -> None:
    """Live broker times: the impression's window ends within 2 s; its click is
    stored 1.5 s after it; the window is read only after end + wait_s."""
    name = f"join-live-{uuid.uuid4().hex[:6]}"
    url = f"memory://{name}"
    dataset = join_dataset(
        stream("memory", url, "imp", IMP_COLUMNS), stream("memory", url, "clk", CLK_COLUMNS), 2
    )
    dataset["streams"]["s"]["join"]["wait_s"] = 2
    job = job_from_dict({"data": {"schema": SCHEMA, "dataset": dataset}}, base_dir=tmp_path)
    now_ms = int(time.time() * 1000)
    memory_stream(url, "imp").append([impression(0, now_ms)], now_ms)

    def late_click() -> None:
        time.sleep(1.5)
        stamp = int(time.time() * 1000)
        memory_stream(url, "clk").append([click(0, now_ms + 1500)], stamp)

    writer = threading.Thread(target=late_click)
    writer.start()
    driver = Driver(job.data, tmp_path, batch_size=4, shuffle=False)
    t0 = time.perf_counter()
    (batch,) = list(driver.batches())
    writer.join()
    assert time.perf_counter() - t0 >= 1.5
    assert batch.labels.tolist() == [1.0]


def test_a_resumed_join_trains_each_impression_once_with_the_same_labels(
    tmp_path: Path,
) -> None:
    """Stop mid-way (a window committed, one partly trained), save the progress,
    resume with new operators: both streams are read again from their committed
    offsets, every impression is trained once, labels as if never stopped."""
    name = f"join-resume-{uuid.uuid4().hex[:6]}"
    job = memory_job(tmp_path, name)
    n, expected = publish_memory(name, 120)

    def run(progress: Progress, limit: int | None) -> dict[int, float]:
        driver = Driver(job.data, tmp_path, batch_size=8, progress=progress)
        labels: dict[int, float] = {}
        for batch in driver.batches():
            labels.update(labels_by_rid(driver, [batch]))
            progress.record(batch.row_ids)
            if limit is not None and progress.rows_trained >= limit:
                break
        driver.close()
        return labels

    first = Progress()
    labels = run(first, 45)  # 30 impressions a window: the second one partly trained
    saved = first.to_json()
    assert "s/clicks" in saved["streams"] and "s/impressions" in saved["streams"]
    assert any(not t["committed"] and t["splits"] for t in saved["tasks"])
    resumed = Progress.from_json(saved)
    rest = run(resumed, None)
    assert resumed.duplicate_rows == 0
    assert resumed.rows_trained == n
    assert not set(labels) & set(rest)  # no impression trained in both runs
    labels.update(rest)
    assert labels == expected


def publish_memory(name: str, n: int) -> tuple[int, dict[int, float]]:
    """``n`` impressions over 4 windows of a minute, and their clicks (stored in time
    order); returns ``n`` and the expected label of every rid."""
    url = f"memory://{name}"
    imps, clicks, expected = impressions_and_clicks(n)
    for rid, stamp in imps:
        memory_stream(url, "imp").append([impression(rid, stamp)], stamp)
    for rid, stamp in clicks:
        memory_stream(url, "clk").append([click(rid, stamp)], stamp)
    return n, expected


def impressions_and_clicks(
    n: int,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], dict[int, float]]:
    """(rid, time) of ``n`` impressions 2 s apart, of their clicks (sorted by time),
    and the expected labels: rid % 3 == 0 clicked 10 s later (1), rid % 3 == 1
    clicked 45 s later (past the wait: 0), the rest never clicked (0)."""
    imps = [(rid, START_MS + rid * 2 * S) for rid in range(n)]
    clicks = []
    for rid, t in imps:
        if rid % 3 == 0:
            clicks.append((rid, t + 10 * S))
        elif rid % 3 == 1:
            clicks.append((rid, t + 45 * S))
    clicks.sort(key=lambda c: c[1])
    expected = {rid: float(rid % 3 == 0) for rid, _ in imps}
    return imps, clicks, expected


CHILD_JOB = {
    "model": {
        "type": "dlrm",
        "params": {"bottom_mlp": [4], "top_mlp": [4]},
        "embedding": {"default": {"dim": 4}},
    },
}


def test_redis_join_sigkill_then_resume_trains_each_impression_once(
    redis_server: Server, tmp_path: Path
) -> None:
    import redis

    imp_key, clk_key = "join-kill-imp", "join-kill-clk"
    imps, clicks, _ = impressions_and_clicks(240)
    client = redis.Redis.from_url(redis_server.url)
    offsets, good = [], []
    for rid, stamp in imps:
        bad = rid % 13 == 12
        payload = impression(rid, "x" if bad else stamp)
        offsets.append(client.xadd(imp_key, {"data": payload}, id=f"{stamp}-{rid}").decode())
        if not bad:
            good.append(rid)
    for rid, stamp in clicks:
        client.xadd(clk_key, {"data": click(rid, stamp)}, id=f"{stamp}-{rid}")
    client.close()

    dataset = join_dataset(
        stream("redis", redis_server.url, imp_key, IMP_COLUMNS),
        stream("redis", redis_server.url, clk_key, CLK_COLUMNS),
    )
    dataset["shuffle"] = {"buffer_rows": 40, "interleave_splits": 2}
    job = {
        "data": {"schema": SCHEMA, "max_bad_row_ratio": 0.2, "dataset": dataset},
        **CHILD_JOB,
        "train": {"batch_size": BATCH, "seed": 3, "threads": 1},
        "output": {"dir": "out-join", "progress": False, "checkpoint_every_steps": EVERY},
    }
    job_path = tmp_path / "join.yaml"
    job_path.write_text(yaml.safe_dump(job))
    progress = kill_then_resume(
        tmp_path, job_path, offsets, good, kill_seed=11, source="s/impressions"
    )
    # The clicks' committed offset: the last one stored before the last window's end.
    last_end_ms = (imps[-1][1] // 60_000 + 1) * 60_000
    before = [f"{stamp}-{rid}" for rid, stamp in clicks if stamp < last_end_ms]
    assert progress.stream_offsets["s/clicks"]["offset"] == before[-1]


def test_stream_impressions_join_clicks_from_files(tmp_path: Path) -> None:
    name = f"join-files-{uuid.uuid4().hex[:6]}"
    url = f"memory://{name}"
    folder = tmp_path / "clk" / "20260101" / "00"
    folder.mkdir(parents=True)
    clicked = [0, 2]  # 10 s after their impression
    rows = "".join(f"q{rid},{START_MS + (rid * 2 + 10) * S}\n" for rid in clicked)
    (folder / "part-0.csv").write_text("req,t_ms\n" + rows)
    (folder / "_SUCCESS").write_text("")
    for rid in range(4):
        stamp = START_MS + rid * 2 * S
        memory_stream(url, "imp").append([impression(rid, stamp)], stamp)
    dataset = join_dataset(
        stream("memory", url, "imp", IMP_COLUMNS), stream("memory", url, "clk", CLK_COLUMNS)
    )
    dataset["streams"]["s"]["sources"][1] = {
        "name": "clicks",
        "path": "clk/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.csv",
        "format": "csv",
        "start": "2026-01-01T00",
        "end": "2026-01-01T01",
    }
    job = job_from_dict({"data": {"schema": SCHEMA, "dataset": dataset}}, base_dir=tmp_path)
    driver = Driver(job.data, tmp_path, batch_size=8, shuffle=False)
    batches = list(driver.batches())
    assert labels_by_rid(driver, batches) == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}
