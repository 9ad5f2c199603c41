"""The HTTP application: replies, errors naming the field, metrics, micro-batching."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from estuary.serve.app import create_app
from estuary.serve.export import load_export
from estuary.serve.model import ServingModel

from .conftest import TinyRun, instances, predict_call, request_all


@pytest.fixture(scope="module")
def model(tiny_run: TinyRun) -> ServingModel:
    return load_export(tiny_run.export_dir)


ROW = {"I1": 3, "I2": None, "C1": "1a", "C2": "3"}


def post(model: ServingModel, body: Any, **options: Any) -> tuple[int, dict[str, Any]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    (reply,) = request_all(create_app(model, **options), [("POST", "/predict", raw)])
    return reply.status_code, reply.json()


def test_predict_returns_one_probability_per_row_and_the_version(model: ServingModel) -> None:
    status, body = post(model, {"instances": [ROW, {**ROW, "C1": "ff"}]})
    assert status == 200
    assert len(body["predictions"]) == 2
    assert all(0 < p < 1 for p in body["predictions"])
    assert body["model_version"] == "tiny@step-000000100-2"


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        (b'{"instances": [', 400, "not valid JSON"),
        (b'{"instances": "\xc3\x28"}', 400, "not valid UTF-8"),
        ([ROW], 422, "expected a JSON object"),
        ({"rows": [ROW]}, 422, "unknown field 'rows'"),
        ({}, 422, "missing field 'instances'"),
        ({"instances": {"I1": 1}}, 422, "instances: expected a list"),
        ({"instances": []}, 422, "at least one row"),
        ({"instances": [ROW, 7]}, 400, "instances[1]: expected an object"),
        ({"instances": [{"I1": 3, "C1": "a", "C2": "b"}]}, 400, "missing field 'I2'"),
        ({"instances": [{**ROW, "C1x": "a"}]}, 400, "unknown field 'C1x'"),
        ({"instances": [ROW, {**ROW, "I1": "abc"}]}, 400, "instances[1]: field I1: 'abc'"),
        ({"instances": [{**ROW, "C2": [1, 2]}]}, 400, "field C2: a JSON array"),
        ({"instances": [{**ROW, "I2": {"a": 1}}]}, 400, "field I2: a JSON object"),
        ({"instances": [{**ROW, "I1": 1e309}]}, 400, "field I1"),
    ],
)
def test_bad_requests_get_a_4xx_naming_what_was_wrong(
    model: ServingModel, body: Any, status: int, names: str
) -> None:
    got, reply = post(model, body)
    assert got == status
    assert names in reply["error"]


def test_a_body_over_the_limit_gets_413(model: ServingModel) -> None:
    status, reply = post(model, {"instances": [ROW] * 50}, max_body_bytes=1000)
    assert status == 413
    assert "body" in reply["error"]


def test_too_many_rows_get_413(model: ServingModel) -> None:
    model.pipeline.max_rows, limit = 10, model.pipeline.max_rows
    try:
        status, reply = post(model, {"instances": [ROW] * 11})
    finally:
        model.pipeline.max_rows = limit
    assert status == 413
    assert "11 rows" in reply["error"]


def test_concurrent_requests_share_forward_passes(tiny_run: TinyRun, model: ServingModel) -> None:
    app = create_app(model, max_wait_s=0.01)
    rows = tiny_run.rows[:40]
    singles = request_all(app, [predict_call([row]) for row in rows], concurrent=True)
    assert app.state.batcher.batches < len(rows)  # several requests per decode and forward
    assert app.state.batcher.rows == len(rows)
    (whole,) = request_all(create_app(model), [predict_call(rows)])
    got = [r.json()["predictions"][0] for r in singles]
    assert got == pytest.approx(whole.json()["predictions"], abs=1e-6)  # each got its own row


def test_a_bad_request_does_not_fail_the_others_of_its_batch(
    tiny_run: TinyRun, model: ServingModel
) -> None:
    app = create_app(model, max_wait_s=0.05)
    good = [predict_call(tiny_run.rows[i : i + 2]) for i in range(0, 8, 2)]
    bad = ("POST", "/predict", json.dumps({"instances": [ROW, {**ROW, "I2": "x"}]}).encode())
    replies = request_all(app, [*good[:2], bad, *good[2:]], concurrent=True)
    assert app.state.batcher.batches < len(replies)
    assert [r.status_code for r in replies] == [200, 200, 400, 200, 200]
    assert replies[2].json()["error"] == "instances[1]: field I2: 'x' is not a number"
    (whole,) = request_all(create_app(model), [predict_call(tiny_run.rows[:8])])
    got = [p for r in replies if r.status_code == 200 for p in r.json()["predictions"]]
    assert got == pytest.approx(whole.json()["predictions"], abs=1e-6)


def test_metrics_parse_as_prometheus_text_and_count_requests(model: ServingModel) -> None:
    app = create_app(model)
    calls = [
        ("POST", "/predict", json.dumps({"instances": instances([ROW] * 3)}).encode()),
        ("POST", "/predict", b"{"),
        ("GET", "/metrics", None),
    ]
    *_, scrape = request_all(app, calls)
    assert scrape.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape.text)
        for s in family.samples
    }
    assert samples[("estuary_serve_requests_total", (("code", "200"),))] == 1
    assert samples[("estuary_serve_requests_total", (("code", "400"),))] == 1
    assert samples[("estuary_serve_rows_total", ())] == 3
    assert samples[("estuary_serve_update_age_seconds", ())] >= 0
    assert samples[("estuary_serve_table_bytes", ())] == model.table_bytes > 0


def test_healthz_names_the_version(model: ServingModel) -> None:
    (reply,) = request_all(create_app(model), [("GET", "/healthz", None)])
    assert reply.status_code == 200
    assert reply.json()["model_version"] == model.version
