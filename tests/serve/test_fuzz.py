"""Thousands of malformed requests, in-process: every one gets a reply below 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estuary.serve.app import create_app
from estuary.serve.export import load_export
from estuary.serve.model import ServingModel

from .conftest import FIELDS, TinyRun, request_all

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
# Rows that are nearly right: the schema's fields (some dropped, some renamed)
# holding any JSON value, plus stray keys.
near_rows = st.fixed_dictionaries(
    {},
    optional={name: json_values for name in (*FIELDS, "label", "I1 ", "c1", "")},
)
bodies = st.one_of(
    st.binary(max_size=64),  # not JSON at all, or broken JSON
    json_values.map(lambda v: json.dumps(v).encode()),  # any JSON
    st.lists(near_rows | json_values, max_size=4).map(
        lambda rows: json.dumps({"instances": rows}).encode()
    ),
    st.binary(max_size=40).map(lambda b: b'{"instances": [{"I1": ' + b + b"}]}"),
)


@pytest.fixture(scope="module")
def model(tiny_run: TinyRun) -> ServingModel:
    return load_export(tiny_run.export_dir)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(batch=st.lists(bodies, min_size=50, max_size=50))
def test_malformed_requests_get_4xx_never_5xx(model: ServingModel, batch: list[bytes]) -> None:
    # 40 examples x 50 requests: 2,000 requests, sent concurrently per example.
    calls = [("POST", "/predict", body) for body in batch]
    replies = request_all(create_app(model), calls, concurrent=True)
    for body, reply in zip(batch, replies, strict=True):
        assert reply.status_code < 500, (body, reply.text)
        payload: dict[str, Any] = reply.json()
        if reply.status_code != 200:
            assert payload["error"]  # a message, naming what was wrong
        else:
            assert len(payload["predictions"]) == len(json.loads(body)["instances"])
