"""Training runs serve Prometheus metrics (``output.metrics_port: 0``): a scraper
thread reads ``/metrics`` over HTTP while training is paused between steps and
sees steps, rows and table rows grow; eval and checkpoint figures land after
training; the port is released when ``fit`` returns; no server by default."""

from __future__ import annotations

import logging
import queue
import re
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from estuary.cli import main
from estuary.config import load_job
from estuary.metrics.prometheus import CONTENT_TYPE
from estuary.train import Trainer
from estuary.train.callbacks import FaultInjection, LoopState

Page = dict[str, float]  # 'name' or 'name{labels}' -> value (labels in exposition order)


def scrape(url: str) -> Page:
    """GET ``url`` and parse it with Prometheus's own text parser."""
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE
        text = response.read().decode("utf-8")
    page: Page = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            page[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return page


class ScrapeAt:
    """Pauses training before the given (1-based) steps while a scraper thread
    reads ``trainer.metrics.url``; ``pages[k]`` is the page seen before step k."""

    def __init__(self, trainer: Trainer, steps: list[int]) -> None:
        self.trainer = trainer
        self.steps = steps
        self.pages: dict[int, Page] = {}
        self.port: int | None = None  # the port served on, once scraped
        self.error: BaseException | None = None
        self._calls = 0
        self._asked: queue.Queue[int] = queue.Queue()
        self._done: queue.Queue[None] = queue.Queue()
        trainer.callbacks.append(FaultInjection(self._before_step))
        self._thread = threading.Thread(target=self._scrape, daemon=True)
        self._thread.start()

    def _before_step(self, state: LoopState) -> None:
        self._calls += 1
        if self._calls in self.steps:
            self._asked.put(self._calls)
            self._done.get(timeout=30)  # Blocking wait: the scraper has read the page

    def _scrape(self) -> None:
        for _ in self.steps:
            step = self._asked.get(timeout=120)
            try:
                url = self.trainer.metrics.url
                assert url is not None, "not serving during fit"
                self.port = int(url.rsplit(":", 1)[1].split("/")[0])
                self.pages[step] = scrape(url)
            except BaseException as exc:
                self.error = exc
            finally:
                self._done.put(None)

    def join(self) -> None:
        self._thread.join(timeout=30)
        if self.error is not None:
            raise self.error
        assert sorted(self.pages) == self.steps


def assert_port_released(port: int) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def write_tsv(path: Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lines = ["label\tI1\tC1\tC2"]
    for _ in range(rows):
        c1, c2 = int(rng.integers(0, 400)), int(rng.integers(0, 50))
        label = int(rng.random() < (0.7 if c1 % 3 == 0 else 0.2))
        lines.append(f"{label}\t{rng.integers(0, 9)}\t{c1:x}\t{c2:x}")
    path.write_text("\n".join(lines) + "\n")


def sources_job(tmp_path: Path, **output: Any) -> Path:
    write_tsv(tmp_path / "train.tsv", 1000)
    job = {
        "name": 'job "one"',
        "data": {
            "sources": [{"path": "train.tsv", "format": "tsv"}],
            "schema": {"dense": ["I1"], "sparse": ["C1", "C2"]},
            "eval_fraction": 0.2,
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": 32, "epochs": 2, "threads": 1},
        "output": {"dir": "out", "progress": False, **output},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_sources_run_serves_growing_metrics_and_releases_the_port(tmp_path: Path) -> None:
    trainer = Trainer(load_job(sources_job(tmp_path, metrics_port=0)))
    trainer.metrics.refresh_s = 0.0  # table stats every step (default: every 2 s)
    scraper = ScrapeAt(trainer, [3, 20, 40])
    result = trainer.fit()
    scraper.join()
    first, middle, last = (scraper.pages[k] for k in scraper.steps)
    # Before step k the page shows k - 1 steps; 32 rows each.
    for k, page in scraper.pages.items():
        assert page["estuary_train_steps_total"] == k - 1
        assert page["estuary_train_step"] == k - 1
        assert page["estuary_train_rows_total"] == 32 * (k - 1)
        assert page['estuary_train_info{job="job "one"",mode="sync"}'] == 1
        assert page["estuary_train_loss"] > 0 and page["estuary_train_loss_smoothed"] > 0
        assert page['estuary_table_hit_rate{table="C1"}'] <= 1
    rows = [p['estuary_table_rows{table="C1"}'] for p in (first, middle, last)]
    assert 0 < rows[0] < rows[1] < rows[2]
    assert first['estuary_table_bytes{table="C1"}'] > 0
    assert middle['estuary_table_admissions_total{table="C2"}'] > 0
    assert last["estuary_train_samples_per_second"] > 0
    assert last["estuary_sparse_staleness_max"] == 0  # sync mode
    assert last["estuary_checkpoints_total"] == 0 and "estuary_eval_auc" not in last
    # After training (read in-process: the server is gone).
    final = trainer.metrics.value
    assert final("estuary_train_steps_total") == result.extra["steps"] == 50
    assert final("estuary_eval_auc") == pytest.approx(result.auc)
    assert final("estuary_eval_rows") == 200
    assert final("estuary_checkpoints_total") == 1
    assert final("estuary_checkpoint_last_step") == 50
    assert final("estuary_checkpoint_duration_seconds_count") == 1
    assert final("estuary_train_samples_per_second") == pytest.approx(result.samples_per_s)
    table_rows = [final("estuary_table_rows", table=t) or 0 for t in ("C1", "C2")]
    assert sum(table_rows) == result.extra["embedding_rows"]
    assert trainer.metrics.url is None and scraper.port is not None
    assert_port_released(scraper.port)


def test_sources_run_serves_no_metrics_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_server(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a metrics server was started")

    monkeypatch.setattr("estuary.metrics.training.MetricsServer", no_server)
    trainer = Trainer(load_job(sources_job(tmp_path)))
    assert trainer.job.output.metrics_port is None
    trainer.fit()
    assert trainer.metrics.value("estuary_train_steps_total") == 0


HOURS, ROWS, BATCH = 2, 100, 16
COLUMNS = ["label", "I1", "C1", "C2"]


def dataset_job(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for hour in range(HOURS):
        folder = root / "data" / "20260101" / f"{hour:02d}"
        folder.mkdir(parents=True)
        lines = []
        for _ in range(ROWS):
            c1, c2 = int(rng.integers(0, 300)), int(rng.integers(0, 20))
            lines.append(f"{int(c1 % 3 == 0)}\t{rng.integers(0, 9)}\t{c1:x}\t{c2:x}")
        (folder / "part-00000.tsv").write_text("\n".join(lines) + "\n")
        (folder / "_SUCCESS").write_text("")
    source = {
        "name": "a",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
        "columns": COLUMNS,
        "start": "2026-01-01T00",
        "end": f"2026-01-01T{HOURS:02d}",
    }
    job = {
        "data": {
            "schema": {"dense": ["I1"], "sparse": ["C1", "C2"]},
            "dataset": {
                "streams": {"s": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 5},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [4]},
            "embedding": {"default": {"dim": 4}},
        },
        "train": {"batch_size": BATCH, "threads": 1, "mode": "hybrid"},
        "output": {
            "dir": "out",
            "progress": False,
            "checkpoint_every_steps": 4,
            "metrics_port": 0,
        },
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_dataset_run_serves_growing_metrics_and_counts_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="estuary.metrics")
    trainer = Trainer(load_job(dataset_job(tmp_path)))
    trainer.metrics.refresh_s = 0.0
    scraper = ScrapeAt(trainer, [2, 6, 11])
    result = trainer.fit()
    scraper.join()
    pages = [scraper.pages[k] for k in scraper.steps]
    assert [p["estuary_train_steps_total"] for p in pages] == [1, 5, 10]
    assert [p["estuary_train_rows_total"] for p in pages] == [16, 80, 160]
    rows = [p['estuary_table_rows{table="C1"}'] for p in pages]
    assert 0 < rows[0] < rows[1] < rows[2]
    assert [p["estuary_checkpoints_total"] for p in pages] == [0, 1, 2]
    assert pages[-1]["estuary_checkpoint_last_step"] == 8
    assert pages[-1]['estuary_train_info{job="estuary-job",mode="hybrid"}'] == 1
    steps = result.extra["steps"]
    assert trainer.metrics.value("estuary_train_steps_total") == steps
    assert steps == HOURS * ROWS // BATCH + 1
    assert trainer.metrics.value("estuary_checkpoint_last_step") == steps  # the final one
    port = int(re.findall(r"127\.0\.0\.1:(\d+)/metrics", caplog.text)[0])
    assert trainer.metrics.url is None
    assert_port_released(port)


def test_cli_logs_the_picked_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = sources_job(tmp_path)
    assert main(["train", str(job), "--no-progress", "--set", "output.metrics_port=0"]) == 0
    logged = capsys.readouterr().err
    port = re.findall(r"serving Prometheus metrics at http://127\.0\.0\.1:(\d+)/metrics", logged)
    assert len(port) == 1
    assert_port_released(int(port[0]))
