"""A continuous mixture run whose live stream is a join: impressions wait for
their clicks (``join.wait_s``) before they are trained, so the label delay of a
continuous run is the joiner's. History files train the memory tower first; the
joined stream's rows then train as stream rows until the run is stopped."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from estuary.config import job_from_dict
from estuary.data.streams.memory import memory_stream
from estuary.metrics.progressive import format_report
from estuary.train import Trainer

from .test_continuous import HISTORY_HOURS, PER_HOUR, Live, run_until, write_history
from .test_join_streams import CLK_COLUMNS, IMP_COLUMNS, click, join_dataset, stream

WAIT_S = 1.5
IMPRESSIONS = 60
BATCH = 20


def live_impression(rid: int, t_ms: int) -> bytes:
    # The history's columns (I1, I2, C1, C2) over the history's id range.
    return f"{rid},q{rid},{t_ms},{rid % 7},{rid % 3},{rid % 5:x},{rid % 4:x}".encode()


def mixture_job(root: Path, url: str) -> Any:
    live = join_dataset(
        stream("memory", url, "imp", IMP_COLUMNS), stream("memory", url, "clk", CLK_COLUMNS), 1
    )
    live["streams"]["s"]["join"]["wait_s"] = WAIT_S
    history = {
        "name": "synth",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
        "columns": ["label", "I1", "I2", "C1", "C2"],
        "start": "2026-01-01T00",
        "end": f"2026-01-01T{HISTORY_HOURS:02d}",
    }
    tower = {"type": "dlrm", "params": {"bottom_mlp": [2], "top_mlp": [4]}}
    return job_from_dict(
        {
            "data": {
                "schema": {"label": "label", "dense": ["I1", "I2"], "sparse": ["C1", "C2"]},
                "dataset": {
                    "streams": {"history": {"sources": [history]}, **live["streams"]},
                    # no idle_timeout_s: wait for the stream until stopped
                    "timer": {"poll_interval_s": 0.02, "ready_timeout_s": 5},
                },
            },
            "model": {
                "type": "mixture",
                "params": {
                    "memory": tower,
                    "adapt": tower,
                    "embeddings": "split",
                    "memory_dim": 2,
                    "combine": "gate",
                    "update": {
                        "history_streams": ["history"],
                        "history": {"memory": 1, "adapt": 0, "gate": 0, "embeddings": 1},
                        "stream": {"memory": 0, "adapt": 1, "gate": 1, "embeddings": 1},
                    },
                },
                "embedding": {"default": {"dim": 4}},
            },
            "train": {
                "batch_size": BATCH,
                "threads": 1,
                "continuous": True,
                "progressive_eval": True,
            },
            "output": {"dir": "out", "progress": False, "checkpoint_every_steps": 4},
        },
        base_dir=root,
    )


def test_a_continuous_mixture_trains_joined_impressions_after_the_label_wait(
    tmp_path: Path,
) -> None:
    write_history(tmp_path)
    url = f"memory://mixjoin-{uuid.uuid4().hex[:6]}"
    job = mixture_job(tmp_path, url)
    imp, clk = memory_stream(url, "imp"), memory_stream(url, "clk")
    clicked: list[int] = []

    def arrive() -> None:
        """Impressions 10 ms apart, stored as they happen, once the history is
        trained; every third is clicked 0.5 s later (within the wait)."""
        now_ms = int(time.time() * 1000)
        for rid in range(IMPRESSIONS):
            t = now_ms + 10 * rid
            imp.append([live_impression(rid, t)], t)
            if rid % 3 == 0:
                clk.append([click(rid, t + 500)], t)
                clicked.append(rid)

    history_rows = HISTORY_HOURS * PER_HOUR
    total = history_rows + IMPRESSIONS
    live = Live(at_step=history_rows // BATCH, arrive=arrive)  # the last history step
    result = run_until(Trainer(job, callbacks=[live]), live, total)
    extra = result.extra
    assert extra["stopped"] == "SIGTERM"
    assert result.train_rows == extra["rows_committed"] == total
    assert extra["duplicate_rows"] == 0
    report = extra["progressive"]
    assert report["origins"]["history/synth"]["rows"] == history_rows
    assert report["origins"]["s/impressions"]["rows"] == IMPRESSIONS
    # Both labels reached the stream rows (an AUC needs clicked and unclicked ones).
    assert 0 < len(clicked) < IMPRESSIONS
    assert report["origins"]["s/impressions"]["auc"] is not None
    # The label wait is the joiner's: no impression trains before its window's
    # end + wait_s, so the stream's event -> trained lag is at least the wait
    # (they are stored once the history is trained; without the wait the lag
    # would be a poll and a step). The history's lag is months: its files are
    # from 2026-01-01.
    stream_lag = report["lag_s"]["by_origin"]["s/impressions"]
    assert WAIT_S <= stream_lag["p50"] <= stream_lag["p99"] < 60
    assert report["lag_s"]["by_origin"]["history/synth"]["p50"] > 86_400
    lines = format_report(report).splitlines()  # what `estuary train` prints
    (stream_line,) = [x for x in lines if x.strip().startswith("s/impressions") and "p50" in x]
    assert f"p50 {stream_lag['p50']:,.1f} s" in stream_line
