"""The Grafana dashboard (deploy/grafana/estuary.json) asks only for what a
running trainer exports: two short real runs serve ``/metrics`` (a
``data.sources`` run scraped at its final checkpoint, after its evaluation; a
``data.dataset`` run, whose data has event time, scraped mid-run), each page
parsed by Prometheus's own text parser; every metric a panel's query names,
and every label it groups or names a legend by, must be on those pages."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from estuary.config import load_job
from estuary.metrics.prometheus import CONTENT_TYPE
from estuary.train import Trainer
from estuary.train.callbacks import FaultInjection, LoopState

from .conftest import DatasetJob, TinyJob

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "estuary.json"

Exported = dict[str, set[str]]  # sample name -> label names seen on it

# Labels Prometheus adds to every scraped series, and the histogram's bucket label.
TARGET_LABELS = {"instance", "job", "le"}


def scrape(url: str, exported: Exported) -> None:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE
        text = response.read().decode("utf-8")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)


def sources_run_page(root: Path, tiny_job: TinyJob) -> Exported:
    """Scraped from the training thread when the final checkpoint is written
    (after the evaluation; the server still serves)."""
    trainer = Trainer(load_job(tiny_job(root, metrics_port=0)))
    exported: Exported = {}

    def at_checkpoint(step: int, duration_s: float) -> None:
        assert trainer.metrics.url is not None
        scrape(trainer.metrics.url, exported)

    trainer.checkpointer.listeners.append(at_checkpoint)
    result = trainer.fit()
    assert result.eval_rows == 300 and exported, "no scrape at the final checkpoint"
    return exported


def dataset_run_page(root: Path, dataset_job: DatasetJob) -> Exported:
    """Scraped from the training thread before step 20 (hour 01's rows trained)."""
    trainer = Trainer(load_job(dataset_job(root, metrics_port=0)))
    trainer.metrics.refresh_s = 0.0  # a sample every step
    exported: Exported = {}

    def before_step(state: LoopState) -> None:
        assert trainer.metrics.url is not None
        scrape(trainer.metrics.url, exported)

    trainer.callbacks.append(FaultInjection(before_step, at_step=20))
    trainer.fit()
    assert exported, "no scrape before step 20"
    return exported


def queries() -> list[tuple[str, str, str]]:
    """(panel title, expr, legend format) of every target of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            found.append((panel["title"], target["expr"], target.get("legendFormat", "")))
    return found


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bestuary_[a-zA-Z0-9_:]*", expr))


def labels_used(expr: str, legend: str) -> set[str]:
    """Labels a query groups by and its legend names ({{label}})."""
    used = set(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", legend))
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        used.update(name.strip() for name in group.split(",") if name.strip())
    return used - TARGET_LABELS


def test_every_panel_queries_metrics_a_running_trainer_exports(
    tmp_path: Path, tiny_job: TinyJob, dataset_job: DatasetJob
) -> None:
    exported = sources_run_page(tmp_path / "sources", tiny_job)
    for name, labels in dataset_run_page(tmp_path / "dataset", dataset_job).items():
        exported.setdefault(name, set()).update(labels)
    assert exported["estuary_data_lag_seconds"] == {"stream"}
    problems = []
    named: set[str] = set()
    for title, expr, legend in queries():
        names = metric_names(expr)
        if not names:
            problems.append(f"{title}: {expr!r} names no estuary metric")
        named |= names
        missing = sorted(n for n in names if n not in exported)
        if missing:
            problems.append(f"{title}: {expr!r} asks for {missing}, not exported")
        labels = set().union(*(exported.get(n, set()) for n in names)) if names else set()
        unknown = sorted(labels_used(expr, legend) - labels)
        if unknown:
            problems.append(f"{title}: {expr!r} uses labels {unknown} its metrics lack")
    assert not problems, "\n".join(problems)
    # The panels the issue asks for: throughput, loss, windowed AUC, staleness,
    # table rows/bytes/admissions/evictions, data lag, bad rows, restarts.
    assert named >= {
        "estuary_train_rows_total",
        "estuary_train_loss_smoothed",
        "estuary_train_auc_window",
        "estuary_sparse_staleness_max",
        "estuary_table_rows",
        "estuary_table_bytes",
        "estuary_table_admissions_total",
        "estuary_table_evictions_total",
        "estuary_data_lag_seconds",
        "estuary_bad_rows_total",
        "estuary_job_bad_rows",
        "estuary_train_restarts_total",
    }


def test_the_query_parser_catches_a_metric_no_one_exports() -> None:
    assert metric_names('rate(estuary_train_rows_total{instance=~"$i"}[1m])') == {
        "estuary_train_rows_total"
    }
    assert metric_names("sum by (table) (estuary_table_rowz)") == {"estuary_table_rowz"}
    assert labels_used("sum by (table, le) (x)", "{{ queue }} {{instance}}") == {"table", "queue"}
