"""Per-feature table overrides, shared tables, and ``to_dict`` round trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.config import (
    AdmissionSpec,
    ConfigError,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableSpec,
    job_from_dict,
    to_dict,
)
from estuary.config.loader import merge_table_spec

FEATURES = ["C1", "C2", "C3"]


def job_with(embedding: dict[str, Any]) -> dict[str, Any]:
    return {
        "data": {"sources": [{"path": "t.tsv"}], "schema": {"dense": ["I1"], "sparse": FEATURES}},
        "model": {"embedding": embedding},
    }


def error_of(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        job_from_dict(data)
    return info.value


DEFAULT = TableSpec(dim=8, optimizer=SparseOptimizerSpec(name="adam", lr=0.01))


def test_partial_nested_override_keeps_other_default_fields() -> None:
    merged = merge_table_spec(DEFAULT, {"optimizer": {"lr": 0.1}}, "model.embedding.tables.C1")
    assert merged.optimizer.name == "adam"  # kept from the default
    assert merged.optimizer.lr == 0.1
    assert merged.dim == 8


def test_empty_override_is_the_default() -> None:
    assert merge_table_spec(DEFAULT, {}, "x") == DEFAULT


def test_null_section_in_override_keeps_the_default_section() -> None:
    assert merge_table_spec(DEFAULT, {"optimizer": None}, "x").optimizer == DEFAULT.optimizer


def test_merge_error_names_path_inside_the_table() -> None:
    with pytest.raises(ConfigError) as info:
        merge_table_spec(DEFAULT, {"optimizer": {"lrr": 0.1}}, "model.embedding.tables.C1")
    assert (
        str(info.value)
        == "model.embedding.tables.C1.optimizer.lrr: unknown key (did you mean 'lr'?)"
    )


def test_merge_validates_ranges() -> None:
    with pytest.raises(ConfigError) as info:
        merge_table_spec(DEFAULT, {"admission": {"probability": 0}}, "model.embedding.tables.C2")
    assert str(info.value) == "model.embedding.tables.C2.admission.probability: must be in (0, 1]"


def test_section_replaced_by_scalar_is_a_type_error() -> None:
    with pytest.raises(ConfigError) as info:
        merge_table_spec(DEFAULT, {"optimizer": "sgd"}, "model.embedding.tables.C1")
    assert str(info.value) == "model.embedding.tables.C1.optimizer: expected mapping, got str 'sgd'"


def test_job_table_spec_merges_feature_override() -> None:
    job = job_from_dict(
        job_with({"default": {"dim": 4}, "tables": {"C2": {"eviction": {"capacity_rows": 100}}}})
    )
    assert job.table_spec("C2").eviction.capacity_rows == 100
    assert job.table_spec("C2").dim == 4
    assert job.table_spec("C1") == job.model.embedding.default


def test_bad_table_override_fails_at_load_time() -> None:
    err = error_of(job_with({"tables": {"C3": {"optimizer": {"name": "adamw"}}}}))
    assert err.path == "model.embedding.tables.C3.optimizer.name"
    assert err.reason.startswith("must be one of 'sgd', 'adagrad', 'adam', 'ftrl'")


def test_table_for_unknown_feature_is_rejected() -> None:
    err = error_of(job_with({"tables": {"C99": {"dim": 4}}}))
    assert str(err).startswith(
        "model.embedding.tables.C99: not a sparse feature (data.schema.sparse)"
    )


def test_table_for_dense_feature_is_rejected() -> None:
    assert error_of(job_with({"tables": {"I1": {}}})).path == "model.embedding.tables.I1"


def test_table_entry_must_be_a_mapping() -> None:
    err = error_of(job_with({"tables": {"C1": 16}}))
    assert str(err) == "model.embedding.tables.C1: expected mapping, got int 16"


def test_shared_table_members_must_be_sparse_features() -> None:
    err = error_of(job_with({"shared": {"ids": ["C1", "C9"]}}))
    assert err.path == "model.embedding.shared.ids[1]"
    assert "not a sparse feature (data.schema.sparse)" in err.reason


def test_feature_may_belong_to_one_shared_table_only() -> None:
    err = error_of(job_with({"shared": {"a": ["C1", "C2"], "b": ["C2"]}}))
    assert err.path == "model.embedding.shared.b[0]"


def test_shared_table_is_configured_by_its_name() -> None:
    job = job_from_dict(job_with({"shared": {"ids": ["C1", "C2"]}, "tables": {"ids": {"dim": 4}}}))
    assert job.table_spec("ids").dim == 4


def test_member_of_shared_table_cannot_have_its_own_table() -> None:
    err = error_of(job_with({"shared": {"ids": ["C1", "C2"]}, "tables": {"C1": {}}}))
    assert err.path == "model.embedding.tables.C1"
    assert "model.embedding.tables.ids" in err.reason


def test_to_dict_round_trips_a_full_job() -> None:
    job = job_from_dict(
        job_with({"default": {"dim": 4}, "tables": {"C1": {"optimizer": {"lr": 0.2}}}}),
        base_dir="/jobs",
    )
    data = to_dict(job)
    assert "base_dir" not in data
    assert job_from_dict(data, base_dir="/jobs") == job
    # Plain data only: it survives a YAML dump and safe load unchanged.
    assert job_from_dict(yaml.safe_load(yaml.safe_dump(data)), base_dir="/jobs") == job


def test_to_dict_can_resolve_paths_for_saving_elsewhere(tmp_path: Path) -> None:
    job = job_from_dict(job_with({}), base_dir=tmp_path)
    data = to_dict(job, resolve_paths=True)
    assert data["data"]["sources"][0]["path"] == str(tmp_path / "t.tsv")
    assert data["output"]["dir"] == str(tmp_path / "runs" / "default")
    moved = job_from_dict(data, base_dir="/elsewhere")
    assert moved.resolve(moved.data.sources[0].path) == tmp_path / "t.tsv"


def test_to_dict_rejects_non_specs() -> None:
    with pytest.raises(TypeError):
        to_dict({"a": 1})


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
_OWN = {"sgd": (), "adagrad": (), "adam": ("beta1", "beta2"), "ftrl": ("lr_power",)}
unit = st.floats(min_value=0.0, max_value=0.99, allow_nan=False)
tables = st.builds(
    TableSpec,
    dim=st.integers(1, 512),
    initializer=st.builds(
        InitializerSpec,
        name=st.sampled_from(["uniform", "normal", "truncated_normal", "zeros"]),
        scale=st.none() | st.floats(0, 10),
    ),
    optimizer=st.builds(
        lambda name, lr, clip, **own: SparseOptimizerSpec(
            # Only the optimizer's own parameters: another's is an error at load.
            name=name,
            lr=lr,
            clip=clip,
            **{k: v for k, v in own.items() if k in _OWN[name]},
        ),
        name=st.sampled_from(["sgd", "adagrad", "adam", "ftrl"]),
        lr=st.floats(1e-6, 10),
        beta1=unit,
        beta2=unit,
        lr_power=finite,
        clip=st.none() | st.floats(1e-3, 1e3),
    ),
    pooling=st.sampled_from(["sum", "mean", "none"]),
    admission=st.builds(
        AdmissionSpec, min_count=st.integers(1, 100), probability=st.floats(0.01, 1.0)
    ),
    eviction=st.builds(
        EvictionSpec,
        capacity_rows=st.none() | st.integers(1, 10**12),
        policy=st.sampled_from(["lru", "lfu"]),
        ttl_steps=st.none() | st.integers(1, 10**9),
        ttl_s=st.none() | st.floats(0.5, 1e9),
    ),
    shards=st.integers(1, 64),
)


@settings(max_examples=60, deadline=None)
@given(table=tables)
def test_full_table_dict_over_any_default_gives_that_table(table: TableSpec) -> None:
    assert merge_table_spec(DEFAULT, to_dict(table), "t") == table
    job = job_from_dict(job_with({"default": to_dict(table)}))
    assert job_from_dict(to_dict(job)) == job


def test_table_settings_are_resolved_once_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import estuary.config.spec as spec_module

    merges: list[str] = []
    real = spec_module.merge_table

    def counting(default: TableSpec, override: dict[str, Any], path: str) -> TableSpec:
        merges.append(path)
        return real(default, override, path)

    monkeypatch.setattr(spec_module, "merge_table", counting)
    embedding = {
        "default": {"dim": 4},
        "tables": {"C2": {"dim": 8}, "ids": {"dim": 2}},
        "shared": {"ids": ["C1", "C3"]},
    }
    job = job_from_dict(job_with(embedding))
    assert merges == ["model.embedding.tables.ids", "model.embedding.tables.C2"]
    assert {name: t.dim for name, t in job.tables.items()} == {"ids": 2, "C2": 8}
    for _ in range(3):  # the trainer, the parameter server and checkpoints look up
        assert job.table_spec("C2").dim == 8 and job.table_spec("ids").dim == 2
    assert job.table_spec("C1") == job.model.embedding.default  # not a table name
    assert len(merges) == 2
