"""``data.dataset``: the three-layer definition loads, round-trips and names the
field at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from estuary.config import ConfigError, job_from_dict, load_job, to_dict
from estuary.config.dataset import DatasetFormatName, parse_time
from estuary.config.spec import FormatName

from .conftest import COLUMNS, SCHEMA, source


def job(dataset: dict[str, Any], **data: Any) -> dict[str, Any]:
    return {"data": {"schema": SCHEMA, "dataset": dataset, **data}}


def error(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        job_from_dict(data)
    return info.value


def test_a_dataset_replaces_sources_and_round_trips() -> None:
    spec = job_from_dict(job({"streams": {"s": {"sources": [source()], "priority": 2}}}))
    assert spec.data.sources == []
    assert spec.data.dataset is not None
    stream = spec.data.dataset.streams["s"]
    assert stream.priority == 2 and stream.sources[0].success_marker == "_SUCCESS"
    assert stream.sources[0].step_s == 3600
    assert job_from_dict(to_dict(spec)) == spec


def test_sources_are_required_without_a_dataset_and_refused_beside_one() -> None:
    assert str(error({"data": {"schema": SCHEMA}})) == "data.sources: required"
    both = job({"streams": {"s": {"sources": [source()]}}}, sources=[{"path": "x.tsv"}])
    assert "not both" in str(error(both))


def test_yaml_dates_and_single_brace_placeholders_load(tmp_path: Path) -> None:
    text = yaml.safe_dump(job({"streams": {"s": {"sources": [source()]}}}))
    text = text.replace("start: 2026-01-01T00", "start: 2026-01-01")  # a YAML date
    text = text.replace("{{YYYY}}{{MM}}{{DD}}", "{YYYY}{MM}{DD}")
    assert "start: 2026-01-01\n" in text
    (tmp_path / "job.yaml").write_text(text)
    spec = load_job(tmp_path / "job.yaml")
    assert spec.data.dataset is not None
    src = spec.data.dataset.streams["s"].sources[0]
    assert src.start == "2026-01-01" and src.start_s == parse_time("2026-01-01T00", "x")
    resolved = to_dict(spec, resolve_paths=True)["data"]["dataset"]["streams"]["s"]["sources"][0]
    assert resolved["path"] == str(tmp_path / "data/{YYYY}{MM}{DD}/{{HH}}/part-*.tsv")


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"path": "data/{{YYYY}}/{{HH}}.tsv"}, "sources[0].path", "missing MM, DD"),
        ({"path": "d/{{YYYY}}{{MM}}{{DD}}/{{hh}}.tsv"}, "sources[0].path", "unknown placeholder"),
        ({"start": "2026-01-01T00:30"}, "sources[0].start", "partition boundary"),
        ({"start": "soon"}, "sources[0].start", "ISO 8601"),
        ({"end": "2025-12-31T00"}, "sources[0].end", "after start"),
        ({"format": "tvs"}, "sources[0].format", "did you mean 'tsv'"),
        ({"split_rows": 10}, "sources[0].split_rows", "parquet"),
        ({"success_marker": "a/b"}, "sources[0].success_marker", "file name"),
    ],
)
def test_source_errors_name_the_field(change: dict[str, Any], path: str, words: str) -> None:
    err = error(job({"streams": {"s": {"sources": [source(**change)]}}}))
    assert err.path == f"data.dataset.streams.s.{path}"
    assert words in err.reason


def test_dataset_level_errors_name_the_field() -> None:
    two = [source("a"), source("b")]
    bad_join = {"s": {"sources": two, "join": {**JOIN, "right": "c"}}}
    assert error(job({"streams": bad_join})).path == "data.dataset.streams.s.join.right"
    dup = {"s": {"sources": [source("a")]}, "t": {"sources": [source("a")]}}
    assert "already a source" in error(job({"streams": dup})).reason
    crowded = {"streams": {"s": {"sources": [source()]}}, "shuffle": {"interleave_splits": 3}}
    assert error(job(crowded)).path == "data.dataset.shuffle.interleave_splits"
    no_eval = {"streams": {"s": {"sources": [source()]}}, "eval_stream": "t"}
    assert error(job(no_eval)).path == "data.dataset.eval_stream"
    typo = {"streams": {"s": {"sources": [source()]}}, "timer": {"pol_interval_s": 1}}
    assert "did you mean 'poll_interval_s'" in str(error(job(typo)))


JOIN = {"left": "a", "right": "b", "key": "C1", "time_column": "I1", "wait_s": 60}


def test_format_names_agree_with_data_sources() -> None:
    assert get_args(DatasetFormatName) == get_args(FormatName)
    assert COLUMNS[0] == "label"


def test_column_typos_fail_at_load_where_the_job_file_names_the_columns() -> None:
    # Derived feature inputs, schema columns and join columns are checked against
    # the sources' declared ``columns`` (or criteo_tsv's) before any data is read.
    features = [{"name": "x", "kind": "cross", "columns": ["C1", "C2x"]}]
    typo = job({"streams": {"s": {"sources": [source()]}}})
    typo["data"]["schema"] = {**SCHEMA, "features": features}
    err = error(typo)
    assert err.path == "data.schema.features[0].columns"
    assert "'C2x' is not a column" in err.reason and "did you mean 'C2'" in err.reason
    dense = job({"streams": {"s": {"sources": [source()]}}})
    dense["data"]["schema"] = {"dense": ["I1", "I3"], "sparse": ["C1"]}
    err = error(dense)
    assert err.path == "data.schema.dense[1]" and "'I3' is not a column" in err.reason
    # A stream source's columns come from its message format.
    live = {
        "name": "a",
        "type": "stream",
        "stream": {
            "kind": "memory",
            "url": "memory://",
            "key": "k",
            "format": "csv",
            "columns": COLUMNS,
        },
    }
    live_typo = job({"streams": {"s": {"sources": [live]}}})
    live_typo["data"]["schema"] = {"dense": ["I1"], "sparse": ["C1", "C9"]}
    assert error(live_typo).path == "data.schema.sparse[1]"
    # Join columns must be in both sides.
    clicks = source("b", columns=["C1", "ts"])
    bad_time = {"s": {"sources": [source("a"), clicks], "join": JOIN}}
    err = error(job({"streams": bad_time}))
    assert err.path == "data.dataset.streams.s.join.time_column"
    assert "'I1' is not a column of the right source 'b'" in err.reason


def test_columns_known_only_from_the_data_are_checked_when_read() -> None:
    # A header line, Parquet or JSON keys: the job file cannot tell, so it loads.
    headered = source(format="csv")
    del headered["columns"]
    spec = job({"streams": {"s": {"sources": [headered]}}})
    spec["data"]["schema"] = {"dense": ["I1"], "sparse": ["C1", "C9"]}
    job_from_dict(spec)
    # A join's right source is only looked up: its columns do not feed features.
    clicks = source("b", columns=["C1", "I1"])
    joined = job({"streams": {"s": {"sources": [source("a"), clicks], "join": JOIN}}})
    job_from_dict(joined)
