"""Reading job files: YAML handling, relative paths and ``--set`` overrides."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from estuary.config import ConfigError, load_job
from estuary.config.loader import apply_overrides

JOB = """\
name: test-job
data:
  sources:
    - path: ../data/day0.tsv
  schema:
    dense: [I1, I2]
    sparse: [C1, C2]
model:
  params: {top_mlp: [64, 32]}
  embedding:
    tables:
      C1: {optimizer: {lr: 0.1}}
train:
  dense_optimizer:
    lr: 1e-3
output:
  dir: runs/test
"""


def write_job(tmp_path: Path, text: str = JOB, name: str = "job.yaml") -> Path:
    """Write a job file into ``tmp_path/jobs/`` and return its path."""
    path = tmp_path / "jobs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load_error(path: Path, overrides: tuple[str, ...] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_job(path, overrides)
    return info.value


def test_relative_paths_resolve_against_the_job_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_job(tmp_path)
    monkeypatch.chdir(tmp_path)  # load through a relative path from elsewhere
    job = load_job(Path("jobs/job.yaml"))
    assert job.base_dir == tmp_path / "jobs"
    assert job.base_dir.is_absolute()
    assert job.resolve(job.data.sources[0].path).resolve() == tmp_path / "data" / "day0.tsv"
    assert job.resolve(job.output.dir) == path.parent / "runs" / "test"


def test_exponent_without_dot_is_a_float(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path))
    assert job.train.dense_optimizer.lr == pytest.approx(1e-3)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write_job(tmp_path, "data:\n  sources: [a\nmodel:\n  type: dlrm\n", "bad.yaml")
    err = load_error(path)
    assert f"{path}:" in str(err)
    assert "invalid YAML" in str(err)
    line = int(str(err).split(f"{path}:")[1].split(":")[0])
    assert 2 <= line <= 4


def test_yaml_bad_indentation_reports_its_line(tmp_path: Path) -> None:
    path = write_job(tmp_path, "data:\n  sources: []\n    schema: {}\n", "indent.yaml")
    assert str(load_error(path)).startswith(f"{path}:3:")


def test_duplicate_key_is_an_error_with_its_line(tmp_path: Path) -> None:
    path = write_job(tmp_path, JOB + "train:\n  epochs: 2\n", "dup.yaml")
    err = load_error(path)
    assert "duplicate key 'train'" in str(err)
    assert f"{path}:{JOB.count(chr(10)) + 1}:" in str(err)


def test_yaml_never_constructs_python_objects(tmp_path: Path) -> None:
    path = write_job(tmp_path, "name: !!python/object/apply:os.getcwd []\n", "evil.yaml")
    assert "invalid YAML" in str(load_error(path))


def test_empty_file_is_a_clear_error(tmp_path: Path) -> None:
    err = load_error(write_job(tmp_path, "# nothing yet\n", "empty.yaml"))
    assert "empty" in str(err)


def test_non_mapping_top_level_is_a_clear_error(tmp_path: Path) -> None:
    err = load_error(write_job(tmp_path, "- data\n- model\n", "list.yaml"))
    assert "top level must be a mapping" in str(err)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    assert "cannot read job file" in str(load_error(tmp_path / "nope.yaml"))


def test_field_errors_from_a_file_name_the_field(tmp_path: Path) -> None:
    path = write_job(tmp_path, JOB.replace("lr: 1e-3", "lr: fast"), "typo.yaml")
    assert str(load_error(path)) == "train.dense_optimizer.lr: expected float, got str 'fast'"


def test_overrides_set_scalars_flow_lists_and_list_items(tmp_path: Path) -> None:
    job = load_job(
        write_job(tmp_path),
        [
            "train.epochs=3",
            "model.params.top_mlp=[256, 1]",
            "data.sources[0].path=x.tsv",
            "name=with = sign",
        ],
    )
    assert job.train.epochs == 3
    assert job.model.params == {"top_mlp": [256, 1]}
    assert job.data.sources[0].path == "x.tsv"
    assert job.name == "with = sign"


def test_override_creates_missing_sections_and_appends_list_items(tmp_path: Path) -> None:
    job = load_job(
        write_job(tmp_path),
        ["runtime.backend=local", "data.sources[1].path=day1.tsv", "data.sources[1].format=tsv"],
    )
    assert [s.path for s in job.data.sources] == ["../data/day0.tsv", "day1.tsv"]
    assert job.data.sources[1].format == "tsv"


def test_later_override_wins(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path), ["train.epochs=3", "train.epochs=5"])
    assert job.train.epochs == 5


def test_override_with_wrong_type_names_field_and_override(tmp_path: Path) -> None:
    err = load_error(write_job(tmp_path), ("train.epochs=abc",))
    assert err.path == "train.epochs"
    assert (
        str(err) == "train.epochs: expected int, got str 'abc' (from override 'train.epochs=abc')"
    )


def test_misspelled_override_key_suggests_the_field(tmp_path: Path) -> None:
    err = load_error(write_job(tmp_path), ("train.epoch=3",))
    assert str(err) == (
        "train.epoch: unknown key (did you mean 'epochs'?) (from override 'train.epoch=3')"
    )


def test_override_failing_validation_names_the_override(tmp_path: Path) -> None:
    err = load_error(write_job(tmp_path), ("model.embedding.default.dim=0",))
    assert err.path == "model.embedding.default.dim"
    assert "must be > 0" in err.reason
    assert "model.embedding.default.dim=0" in err.reason


@pytest.mark.parametrize(
    ("override", "path", "fragment"),
    [
        ("train.epochs", "", "expected dotted.key=value"),
        ("train..epochs=1", "", "bad key"),
        ("data.sources[5].path=x", "data.sources[5]", "index out of range"),
        ("data.sources.0.path=x", "data.sources", "key[0]"),
        ("name[0]=x", "name", "not a list"),
        ("model.params.top_mlp=[1, 2", "", "invalid YAML"),
    ],
)
def test_override_that_cannot_be_applied_is_named(
    tmp_path: Path, override: str, path: str, fragment: str
) -> None:
    err = load_error(write_job(tmp_path), (override,))
    assert err.path == path
    assert fragment in str(err)
    assert repr(override) in str(err)


def test_apply_overrides_does_not_touch_its_input() -> None:
    data = {"train": {"epochs": 1}}
    out = apply_overrides(data, ["train.epochs=2", "train.seed=7"])
    assert out == {"train": {"epochs": 2, "seed": 7}}
    assert data == {"train": {"epochs": 1}}


def test_empty_override_value_is_null(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path), ["model.embedding.default.eviction.capacity_rows="])
    assert job.model.embedding.default.eviction.capacity_rows is None
