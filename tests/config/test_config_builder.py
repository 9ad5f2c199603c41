"""The dict -> spec builder: every error names the field path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from estuary.config import ConfigError, JobSpec, job_from_dict


def minimal(**sections: Any) -> dict[str, Any]:
    """The smallest valid job, with extra sections merged in."""
    job: dict[str, Any] = {
        "data": {"sources": [{"path": "train.tsv"}], "schema": {"dense": ["I1"], "sparse": ["C1"]}}
    }
    job.update(sections)
    return job


def error_of(data: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        job_from_dict(data)
    return info.value


def test_minimal_job_fills_every_default() -> None:
    job = job_from_dict(minimal())
    assert job.train.batch_size == 1024
    assert job.model.embedding.default.optimizer.name == "adagrad"
    assert job.data.sources[0].format == "criteo_tsv"
    assert job.base_dir == Path(".")


def test_unknown_top_level_key_is_named_with_suggestion() -> None:
    err = error_of(minimal(trian={"epochs": 2}))
    assert str(err) == "trian: unknown key (did you mean 'train'?)"
    assert err.path == "trian"


def test_nested_unknown_key_names_full_path_and_suggests() -> None:
    err = error_of(minimal(model={"embedding": {"default": {"dimm": 8}}}))
    assert str(err) == "model.embedding.default.dimm: unknown key (did you mean 'dim'?)"


def test_unknown_key_without_close_match_has_no_suggestion() -> None:
    assert str(error_of(minimal(train={"zzz": 1}))) == "train.zzz: unknown key"


def test_wrong_type_names_field_expected_and_got() -> None:
    err = error_of(minimal(train={"batch_size": "abc"}))
    assert str(err) == "train.batch_size: expected int, got str 'abc'"


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_not_an_int(value: bool) -> None:
    err = error_of(minimal(train={"epochs": value}))
    assert str(err) == f"train.epochs: expected int, got bool {value}"


def test_float_is_not_an_int() -> None:
    assert str(error_of(minimal(train={"epochs": 2.0}))) == (
        "train.epochs: expected int, got float 2.0"
    )


def test_int_is_a_valid_float_and_is_stored_as_float() -> None:
    job = job_from_dict(minimal(train={"dense_optimizer": {"lr": 1}}))
    assert job.train.dense_optimizer.lr == 1.0
    assert isinstance(job.train.dense_optimizer.lr, float)


@pytest.mark.parametrize("value", ["0.1", True])
def test_string_and_bool_are_never_numbers(value: Any) -> None:
    err = error_of(minimal(train={"dense_optimizer": {"lr": value}}))
    assert err.path == "train.dense_optimizer.lr"
    assert err.reason.startswith("expected float, got ")


def test_non_finite_float_is_rejected() -> None:
    err = error_of(minimal(train={"dense_optimizer": {"lr": float("nan")}}))
    assert err.path == "train.dense_optimizer.lr"
    assert "finite" in err.reason


def test_optional_field_names_null_in_expected_type() -> None:
    err = error_of(minimal(model={"embedding": {"default": {"initializer": {"scale": "big"}}}}))
    assert str(err) == (
        "model.embedding.default.initializer.scale: expected float or null, got str 'big'"
    )


def test_literal_violation_lists_allowed_values() -> None:
    err = error_of(minimal(train={"mode": "synk"}))
    assert err.path == "train.mode"
    assert (
        err.reason
        == "must be one of 'sync', 'hybrid', 'async'; got str 'synk' (did you mean 'sync'?)"
    )


def test_literal_rejects_value_of_another_type() -> None:
    err = error_of(minimal(model={"embedding": {"default": {"eviction": {"policy": True}}}}))
    assert err.path == "model.embedding.default.eviction.policy"
    assert err.reason.startswith("must be one of 'lru', 'lfu'")


def test_range_violation_from_validate_names_field() -> None:
    err = error_of(minimal(model={"embedding": {"default": {"dim": 0}}}))
    assert str(err) == "model.embedding.default.dim: must be > 0"


def test_range_violation_in_nested_validate() -> None:
    err = error_of(minimal(train={"dense_optimizer": {"lr": -0.1}}))
    assert str(err) == "train.dense_optimizer.lr: must be > 0"


def test_list_items_carry_their_index_in_the_path() -> None:
    data = minimal()
    data["data"]["sources"] = [{"path": "a.tsv"}, {"path": "b.tsv", "format": "tvs"}]
    err = error_of(data)
    assert err.path == "data.sources[1].format"
    assert "(did you mean 'tsv'?)" in err.reason


def test_list_item_of_wrong_type_is_indexed() -> None:
    data = minimal()
    data["data"]["schema"]["sparse"] = ["C1", 7]
    assert str(error_of(data)) == "data.schema.sparse[1]: expected str, got int 7"


def test_list_field_given_a_scalar() -> None:
    data = minimal()
    data["data"]["schema"]["dense"] = "I1"
    assert str(error_of(data)) == "data.schema.dense: expected list of str, got str 'I1'"


def test_missing_required_field() -> None:
    assert str(error_of({"data": {"schema": {"sparse": ["C1"]}}})) == "data.sources: required"
    assert str(error_of({})) == "data: required"


def test_missing_required_field_inside_a_list_item() -> None:
    data = minimal()
    data["data"]["sources"] = [{"format": "csv"}]
    assert str(error_of(data)) == "data.sources[0].path: required"


def test_empty_source_list_fails_validation() -> None:
    data = minimal()
    data["data"]["sources"] = []
    assert error_of(data).path == "data.sources"


def test_loader_only_field_is_not_a_key() -> None:
    err = error_of(minimal(base_dir="/etc"))
    assert err.path == "base_dir"
    assert "loader" in err.reason


def test_section_of_wrong_type() -> None:
    assert str(error_of(minimal(train=[1]))) == "train: expected mapping, got list [1]"


def test_empty_section_means_defaults() -> None:
    assert job_from_dict(minimal(train=None)).train == job_from_dict(minimal()).train


def test_non_string_mapping_key_is_rejected() -> None:
    err = error_of(minimal(model={"embedding": {"tables": {1: {}}}}))
    assert err.path == "model.embedding.tables"
    assert "keys must be strings" in err.reason


def test_top_level_must_be_a_mapping() -> None:
    assert "mapping" in str(error_of([1, 2]))


def test_schema_rejects_duplicate_and_label_columns() -> None:
    data = minimal()
    data["data"]["schema"]["sparse"] = ["C1", "I1"]
    assert (
        str(error_of(data)) == "data.schema.sparse[1]: 'I1' is already listed in data.schema.dense"
    )
    data["data"]["schema"]["sparse"] = ["label"]
    assert error_of(data).path == "data.schema.sparse[0]"


def test_transform_on_unknown_column_is_rejected() -> None:
    data = minimal()
    data["data"]["schema"]["transforms"] = {"C2": "hour_of_day"}
    err = error_of(data)
    assert err.path == "data.schema.transforms.C2"
    assert re.search(r"not a column", err.reason)


def test_caller_dict_is_not_shared_with_the_spec() -> None:
    data = minimal(model={"params": {"top_mlp": [8]}})
    job = job_from_dict(data)
    data["model"]["params"]["top_mlp"].append(1)
    assert job.model.params == {"top_mlp": [8]}


def test_base_dir_comes_from_the_caller() -> None:
    job = job_from_dict(minimal(), base_dir="/data/jobs")
    assert isinstance(job, JobSpec)
    assert job.resolve("x.tsv") == Path("/data/jobs/x.tsv")
    assert job.resolve("/abs/x.tsv") == Path("/abs/x.tsv")
