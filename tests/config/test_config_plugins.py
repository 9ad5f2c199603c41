"""A job file names any registered implementation: built-ins, ones registered in
Python and entry-point plugins; an unknown name is an error at load that names the
field path and lists the known names."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from estuary import plugins
from estuary.config import ConfigError, job_from_dict
from estuary.config.loader import apply_overrides
from estuary.registry import Registry


def job(**sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "data": {"sources": [{"path": "t.tsv"}], "schema": {"dense": ["I1"], "sparse": ["C1"]}}
    }
    data.update(sections)
    return data


@pytest.fixture
def registered() -> Iterator[list[tuple[Registry[Any], str]]]:
    """Names a test registers, unregistered afterwards."""
    added: list[tuple[Registry[Any], str]] = []
    yield added
    for registry, name in added:
        registry.unregister(name)


def _add(added: list[tuple[Registry[Any], str]], registry: Registry[Any], name: str) -> None:
    # An optimizer's parameters are read at load: it must be a real implementation.
    real = "estuary.embedding.optimizers:SGD" if registry is plugins.OPTIMIZERS else object()
    registry.register(name, real)
    added.append((registry, name))


@pytest.mark.parametrize(
    ("registry", "name", "path"),
    [
        (plugins.OPTIMIZERS, "lion", "model.embedding.default.optimizer.name"),
        (plugins.INITIALIZERS, "orthogonal", "model.embedding.default.initializer.name"),
        (plugins.MODELS, "two_tower", "model.type"),
        (plugins.DENSE_OPTIMIZERS, "lamb", "train.dense_optimizer.name"),
    ],
)
def test_a_name_registered_in_python_loads_and_an_unknown_one_lists_the_known(
    registered: list[tuple[Registry[Any], str]], registry: Registry[Any], name: str, path: str
) -> None:
    data = apply_overrides(job(), [f"{path}={name}"])
    with pytest.raises(ConfigError) as err:
        job_from_dict(data)
    assert err.value.path == path
    known = ", ".join(repr(n) for n in registry.names())
    assert err.value.reason.startswith("must be one of ")
    assert all(repr(n) in err.value.reason for n in registry.names()), known
    _add(registered, registry, name)
    job_from_dict(data)  # now it loads


def test_a_registered_format_is_named_by_a_source(
    registered: list[tuple[Registry[Any], str]],
) -> None:
    data = job()
    data["data"]["sources"] = [{"path": "t.orc", "format": "orc", "columns": ["label", "I1", "C1"]}]
    with pytest.raises(
        ConfigError, match=r"^data\.sources\[0\]\.format: must be one of 'criteo_tsv'"
    ):
        job_from_dict(data)
    _add(registered, plugins.FORMATS, "orc")
    assert job_from_dict(data).data.sources[0].format == "orc"


def test_a_registered_stream_kind_and_feature_kind_load(
    registered: list[tuple[Registry[Any], str]],
) -> None:
    from estuary.config.streams import stream_source_from_dict

    spec = {"kind": "kafka", "url": "kafka://h:9092", "key": "clicks", "format": "jsonl"}
    with pytest.raises(ConfigError, match=r"^s\.kind: must be one of 'nats', 'redis', 'memory'"):
        stream_source_from_dict(spec, "s")
    _add(registered, plugins.STREAM_BACKENDS, "kafka")
    assert stream_source_from_dict(spec, "s").kind == "kafka"

    data = job()
    data["data"]["schema"]["features"] = [{"name": "h", "kind": "hashed", "columns": ["C1"]}]
    with pytest.raises(ConfigError, match=r"^data\.schema\.features\[0\]\.kind: must be one of"):
        job_from_dict(data)
    _add(registered, plugins.FEATURE_KINDS, "hashed")
    assert job_from_dict(data).data.schema.features[0].kind == "hashed"


def test_an_entry_point_plugin_is_named_from_a_job_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "estuary_test_models-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: estuary_test_models\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text("[estuary.models]\nmy_tower = my_towers:Tower\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert job_from_dict(job(model={"type": "my_tower"})).model.type == "my_tower"
        assert "my_tower" in plugins.MODELS.names()
        assert "my_towers" not in sys.modules  # named and checked, not imported
    finally:
        plugins.MODELS.unregister("my_tower")


def test_a_parameter_of_another_optimizer_is_an_error_naming_its_parameters() -> None:
    optimizer = {"name": "adagrad", "lr": 0.1, "beta1": 0.8}
    data = job(model={"embedding": {"default": {"optimizer": optimizer}}})
    with pytest.raises(ConfigError) as err:
        job_from_dict(data)
    assert str(err.value) == (
        "model.embedding.default.optimizer.beta1: not a parameter of optimizer 'adagrad' "
        "(its parameters: lr, weight_decay, clip, eps, initial_accumulator)"
    )
    optimizer["name"] = "adam"  # adam reads beta1
    assert job_from_dict(data).table_spec("C1").optimizer.beta1 == 0.8


def test_a_table_switching_optimizer_keeps_only_the_default_parameters_it_reads() -> None:
    default = {"optimizer": {"name": "adagrad", "lr": 0.2, "initial_accumulator": 0.1}}
    tables = {"C1": {"optimizer": {"name": "adam", "beta2": 0.99}}}
    spec = job_from_dict(job(model={"embedding": {"default": default, "tables": tables}}))
    table = spec.table_spec("C1").optimizer
    assert (table.name, table.lr, table.beta2) == ("adam", 0.2, 0.99)
    assert table.initial_accumulator == 0.0  # adagrad's, back to its default
    tables["C1"]["optimizer"]["l1"] = 0.5  # written for this table: checked
    with pytest.raises(ConfigError, match=r"^model\.embedding\.tables\.C1\.optimizer\.l1: not a"):
        job_from_dict(job(model={"embedding": {"default": default, "tables": tables}}))


def test_an_optimizer_reads_its_typed_parameters() -> None:
    from estuary.config import SparseOptimizerSpec
    from estuary.embedding.optimizers import AdamParams, make_optimizer

    adam = make_optimizer(SparseOptimizerSpec(name="adam", lr=0.5, beta1=0.7), dim=4)
    assert adam.params == AdamParams(
        lr=0.5, weight_decay=0.0, clip=None, beta1=0.7, beta2=0.999, eps=1e-8
    )
    assert type(adam).parameters() == ("lr", "weight_decay", "clip", "beta1", "beta2", "eps")
