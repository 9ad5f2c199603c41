"""The Prometheus endpoint on the standard client: every page parses with
Prometheus's own text parser, OpenMetrics when a scraper asks for it, 404 off
``/metrics``, a port released on stop; ``TrainingMetrics`` renders a run's
sample (tables, data lag, queues, restarts) and the evaluation only once known."""

from __future__ import annotations

import math
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from estuary.config import ConfigError, load_job
from estuary.embedding.types import TableStats
from estuary.metrics.evaluation import EvalResult
from estuary.metrics.prometheus import CONTENT_TYPE, MetricsServer
from estuary.metrics.training import RunSample, TrainingMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """(family name -> type, (sample name, labels) -> value) via Prometheus's parser."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, samples


def fetch(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode("utf-8")


def test_server_serves_metrics_404s_elsewhere_and_releases_its_port() -> None:
    registry = CollectorRegistry()
    Counter("app_total", "x", registry=registry).inc(7)
    server = MetricsServer(registry, host="127.0.0.1", port=0).start()
    port = server.port
    assert port and server.url == f"http://127.0.0.1:{port}/metrics"
    content_type, text = fetch(f"{server.url}?x=1")
    assert content_type == CONTENT_TYPE
    assert parse(text)[1][("app_total", ())] == 7
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    assert info.value.code == 404
    server.stop()
    server.stop()  # idempotent
    assert server.port is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    with socket.socket() as again:  # the port is free to bind again
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_server_speaks_openmetrics_to_a_scraper_that_asks() -> None:
    registry = CollectorRegistry()
    Counter("app_total", "x", registry=registry).inc(3)
    server = MetricsServer(registry, port=0).start()
    try:
        assert server.url is not None
        content_type, text = fetch(server.url, "application/openmetrics-text; version=1.0.0")
    finally:
        server.stop()
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    family = next(f for f in openmetrics_families(text) if f.name == "app")
    assert family.type == "counter" and family.samples[0].value == 3


def stats(rows: int, admissions: int) -> TableStats:
    return TableStats(
        rows=rows,
        bytes=rows * 64,
        lookups=10 * rows,
        hits=5 * rows,
        admissions=admissions,
        evictions=1,
        pending_ids=2,
        unknown_grads=3,
    )


def test_training_metrics_render_the_newest_sample_and_the_eval_once_known() -> None:
    metrics = TrainingMetrics(port=0, job='say "hi"\n', mode="sync")
    with metrics.serving():
        assert metrics.url is not None
        types, before = parse(fetch(metrics.url)[1])
        assert ("estuary_train_info", (("job", 'say "hi"\n'), ("mode", "sync"))) in before
        assert not any(name.startswith("estuary_table_") for name, _ in before)
        assert not any(name.startswith("estuary_eval_") for name, _ in before)
        assert ("estuary_train_auc_window", ()) not in before
        assert types["estuary_table_admissions"] == "counter"  # the client drops _total
        assert metrics.step(1, 64, 0.7)  # the first step asks for a sample
        event_s = time.time() - 90.0
        metrics.refresh(
            RunSample(
                tables={"C1": stats(100, 100), "C2": stats(7, 9)},
                staleness_max=2,
                bad_rows=5,
                bad_rows_run=3,  # a resumed run: 2 read before its checkpoint
                newest_event_s={"clicks": event_s},
                queues={"sparse_updates": 1, "data_splits": 4},
                restarts=2,
                auc_window=0.71,
            )
        )
        assert metrics.step(2, 64, 0.5) is False  # the next one refresh_s later
        metrics.checkpointed(2, 0.3)
        metrics.evaluated(EvalResult(0.75, 0.45, 1000, 0.2, 0.21))
        _, page = parse(fetch(metrics.url)[1])
    assert page[("estuary_train_steps_total", ())] == 2
    assert page[("estuary_train_rows_total", ())] == 128
    assert page[("estuary_train_loss", ())] == 0.5
    assert page[("estuary_table_rows", (("table", "C1"),))] == 100
    assert page[("estuary_table_admissions_total", (("table", "C2"),))] == 9
    assert page[("estuary_table_hit_rate", (("table", "C2"),))] == 0.5
    assert page[("estuary_bad_rows_total", ())] == 3  # this process's: from 0 at its start
    assert page[("estuary_job_bad_rows", ())] == 5
    assert page[("estuary_train_restarts_total", ())] == 2
    assert page[("estuary_sparse_staleness_max", ())] == 2
    assert page[("estuary_queue_depth", (("queue", "data_splits"),))] == 4
    assert page[("estuary_data_newest_event_timestamp_seconds", (("stream", "clicks"),))] == (
        pytest.approx(event_s)
    )
    assert 90 <= page[("estuary_data_lag_seconds", (("stream", "clicks"),))] < 120
    assert page[("estuary_train_auc_window", ())] == 0.71
    assert page[("estuary_checkpoint_duration_seconds_count", ())] == 1
    assert page[("estuary_checkpoint_duration_seconds_bucket", (("le", "0.5"),))] == 1
    assert page[("estuary_checkpoint_duration_seconds_bucket", (("le", "0.25"),))] == 0
    assert page[("estuary_eval_auc", ())] == 0.75 and page[("estuary_eval_rows", ())] == 1000
    # A later window with one class keeps the last AUC rather than showing NaN.
    metrics.refresh(RunSample(tables={}, staleness_max=0, bad_rows=5, auc_window=math.nan))
    assert metrics.value("estuary_train_auc_window") == 0.71


def test_disk_tier_figures_are_exported_per_table() -> None:
    metrics = TrainingMetrics(port=0, job="j", mode="sync")
    tiered = TableStats(
        rows=400, hits=100, memory_hits=75, disk_rows=300, disk_bytes=4096,
        disk_reads=25, disk_writes=310,
    )  # fmt: skip
    with metrics.serving():
        assert metrics.url is not None
        assert metrics.step(1, 64, 0.7)
        metrics.refresh(RunSample(tables={"C1": tiered}, staleness_max=0, bad_rows=0))
        _, page = parse(fetch(metrics.url)[1])
    table = (("table", "C1"),)
    assert page[("estuary_table_memory_hit_rate", table)] == 0.75
    assert page[("estuary_table_disk_rows", table)] == 300
    assert page[("estuary_table_disk_bytes", table)] == 4096
    assert page[("estuary_table_disk_reads_total", table)] == 25
    assert page[("estuary_table_disk_writes_total", table)] == 310


def test_training_metrics_are_off_without_a_port() -> None:
    metrics = TrainingMetrics(port=None)
    with metrics.serving():
        assert metrics.server is None and metrics.url is None
        assert metrics.step(1, 64, 0.5) is False
    assert metrics.value("estuary_train_rows_total") == 0


def test_training_metrics_on_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics = TrainingMetrics(port=taken.getsockname()[1])
        with pytest.raises(ConfigError) as info, metrics.serving():
            pass
    assert info.value.path == "output.metrics_port"


def test_nested_serving_shares_one_server() -> None:
    metrics = TrainingMetrics(port=0)
    with metrics.serving():
        url = metrics.url
        with metrics.serving():
            assert metrics.url == url
        assert metrics.url == url  # the inner block leaves it serving
    assert metrics.url is None


JOB = """\
data:
  sources: [{path: day0.tsv}]
  schema: {dense: [I1], sparse: [C1]}
"""


def test_metrics_fields_default_off_and_validate(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    output = load_job(path).output
    assert output.metrics_port is None and output.metrics_host == "127.0.0.1"
    assert load_job(path, ["output.metrics_port=0"]).output.metrics_port == 0
    for override, fragment in [
        ("output.metrics_port=70000", "[0, 65535]"),
        ("output.metrics_port=-1", "[0, 65535]"),
        ("output.metrics_port=abc", "int"),
        ("output.metrics_host=' '", "empty"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_job(path, [override])
        assert info.value.path.startswith(override.split("=")[0]), info.value
        assert fragment in str(info.value)
