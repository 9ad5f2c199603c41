"""runtime.roles: resolved at load into the keys the runtimes read, one value each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from estuary.cli import nproc_overrides
from estuary.config import ConfigError, job_from_dict, load_job, to_dict
from estuary.config.roles import RolePlan

DATA = {"sources": [{"path": "x.tsv"}], "schema": {"sparse": ["C1"], "dense": ["I1"]}}


def job(runtime: dict[str, Any]) -> Any:
    return job_from_dict({"data": DATA, "runtime": runtime})


def test_roles_resolve_into_the_keys_the_runtimes_read() -> None:
    spec = job(
        {
            "backend": "ray",
            "roles": {
                "trainer": {"min": 2, "max": 4, "cpus": 2, "memory_mb": 4096},
                "ps": {"count": 3, "memory_mb": 8192},
                "embedding_worker": {"count": 2, "cpus": 0.5},
                "driver": {"cpus": 2, "memory_mb": 1024},
            },
        }
    ).runtime
    assert (spec.trainers, spec.ps_shards, spec.embedding_workers) == (2, 3, True)
    assert (spec.ray.trainer.cpus, spec.ray.trainer.memory_mb) == (2.0, 4096)
    assert spec.ray.ps.memory_mb == 8192
    assert spec.ray.embedding_worker.cpus == 0.5
    # Only what has no older key stays in roles: no second copy of a count.
    assert spec.roles.trainer.count is None and spec.roles.trainer.cpus is None
    assert spec.roles.trainer.max == 4
    plans = spec.resolved_roles()
    assert plans["trainer"] == RolePlan("trainer", 2, 2, 4, 2.0, 0.0, 4096)
    assert plans["embedding_worker"].count == 2
    assert plans["driver"] == RolePlan("driver", 1, 1, 1, 2.0, 0.0, 1024)


def test_legacy_keys_alone_still_work_and_show_in_resolved_roles() -> None:
    spec = job({"trainers": 3, "ps_shards": 2, "ray": {"ps": {"cpus": 2}}}).runtime
    plans = spec.resolved_roles()
    assert (plans["trainer"].count, plans["ps"].count, plans["ps"].cpus) == (3, 2, 2.0)
    assert plans["data_executor"].count == 0


def test_a_dumped_job_loads_back_equal() -> None:
    roles = {"trainer": {"count": 2, "min": 1, "max": 3, "gpus": 1}, "driver": {"cpus": 3}}
    spec = job({"roles": roles})
    assert job_from_dict(to_dict(spec)) == spec


def test_same_value_under_both_keys_is_accepted() -> None:
    assert job({"trainers": 2, "roles": {"trainer": {"count": 2}}}).runtime.trainers == 2


@pytest.mark.parametrize(
    ("runtime", "path", "words"),
    [
        (
            {"trainers": 3, "roles": {"trainer": {"count": 2}}},
            "runtime.roles.trainer.count",
            "runtime.trainers: 3",
        ),
        (
            {"ray": {"ps": {"cpus": 1}}, "roles": {"ps": {"cpus": 2}}},
            "runtime.roles.ps.cpus",
            "runtime.ray.ps.cpus",
        ),
        ({"roles": {"trainr": {}}}, "runtime.roles.trainr", "did you mean 'trainer'"),
        ({"roles": {"trainer": {"cpu": 1}}}, "runtime.roles.trainer.cpu", "did you mean 'cpus'"),
        (
            {"roles": {"trainer": {"count": 5, "max": 4}}},
            "runtime.roles.trainer.count",
            "above max",
        ),
        ({"roles": {"ps": {"min": 3, "max": 2}}}, "runtime.roles.ps.min", "above max"),
        (
            {"trainers": 5, "roles": {"trainer": {"max": 4}}},
            "runtime.roles.trainer.max",
            "runtime.trainers",
        ),
        ({"roles": {"trainer": {"count": 0}}}, "runtime.roles.trainer.count", ">= 1"),
        ({"roles": {"driver": {"count": 2}}}, "runtime.roles.driver", "one driver"),
        (
            {"backend": "ray", "roles": {"embedding_worker": {"count": 3}}},
            "runtime.roles.embedding_worker.count",
            "trainer count",
        ),
        (
            {"roles": {"data_executor": {"count": 2}}},
            "runtime.data_executors",
            "also set by runtime.roles.data_executor.count",
        ),
        (
            {"roles": {"data_executor": {"memory_mb": 0}}},
            "runtime.roles.data_executor.memory_mb",
            ">= 1",
        ),
    ],
)
def test_wrong_roles_name_the_field(runtime: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        job(runtime)
    assert err.value.path == path
    assert words in str(err.value)


def test_embedding_workers_follow_the_resolved_trainer_count() -> None:
    roles = {"trainer": {"min": 2, "max": 4}, "embedding_worker": {"count": 3}}
    spec = job({"backend": "ray", "trainers": 3, "roles": roles}).runtime
    assert (spec.trainers, spec.embedding_workers) == (3, True)
    plan = spec.resolved_roles()["embedding_worker"]
    assert (plan.count, plan.min, plan.max) == (3, 2, 4)  # they scale with the trainers


def test_count_defaults_to_min() -> None:
    spec = job({"backend": "ray", "roles": {"ps": {"min": 2, "max": 6}}}).runtime
    assert spec.ps_shards == 2
    assert spec.resolved_roles()["ps"] == RolePlan("ps", 2, 2, 6, 1.0, 0.0, None)


@pytest.mark.parametrize("trainers", ["trainers: 4", "roles: {trainer: {count: 4, max: 8}}"])
def test_nproc_replaces_the_count_under_either_key(tmp_path: Path, trainers: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        f"data: {{sources: [{{path: x.tsv}}], schema: {{sparse: [C1]}}}}\nruntime: {{{trainers}}}\n"
    )
    assert load_job(path, nproc_overrides(2)).runtime.trainers == 2
    assert load_job(path).runtime.trainers == 4
