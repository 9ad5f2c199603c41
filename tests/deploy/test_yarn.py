"""estuary render yarn: a Skein application spec that skein itself loads, one
service per role with its instances and resources, and shell scripts that parse."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from estuary.config import JobSpec, job_from_dict
from estuary.deploy import RenderOptions, render
from estuary.deploy.yarn import ADDRESS_KEY, DEFAULT_MEMORY_MB

skein = pytest.importorskip("skein")


def spec_of(job: JobSpec, tmp_path: Path, **options: Any) -> Any:
    path = tmp_path / "estuary.yaml"
    path.write_text(render("yarn", job, RenderOptions(**options)), encoding="utf-8")
    return skein.ApplicationSpec.from_file(str(path))


def test_skein_loads_one_service_per_role(job: JobSpec, tmp_path: Path) -> None:
    spec = spec_of(job, tmp_path, name="ctr", queue="ml")
    assert (spec.name, spec.queue) == ("ctr", "ml")
    got = {
        name: (s.instances, s.resources.vcores, s.resources.memory, s.resources.gpus)
        for name, s in spec.services.items()
    }
    assert got == {
        "driver": (1, 2, 4096, 0),
        "ps": (2, 3, 16384, 0),  # 2.5 CPUs -> 3 vcores
        "trainer": (2, 4, 8192, 1),
        "data-executor": (3, 1, 2048, 0),
        "embedding-worker": (2, 1, DEFAULT_MEMORY_MB, 0),
    }
    for name, service in spec.services.items():
        if name != "driver":
            assert service.depends == {"driver"}
            role = name.replace("-", "_")
            assert f'--resources={{"estuary_{role}":1}}' in service.script
            assert f"skein kv get current --key {ADDRESS_KEY} --wait" in service.script


def test_driver_runs_head_and_the_embedded_job(job: JobSpec, tmp_path: Path) -> None:
    script = spec_of(job, tmp_path).services["driver"].script
    embedded = re.search(r"<<'ESTUARY_JOB'\n(.*)\nESTUARY_JOB\n", script, re.DOTALL)
    assert embedded is not None
    carried = job_from_dict(yaml.safe_load(embedded.group(1))).runtime
    assert carried.resolved_roles() == job.runtime.resolved_roles()
    assert (carried.ray.address, carried.ray.role_resources) == ("auto", True)
    assert "ray start --head" in script and "--num-cpus=0" in script
    assert f"skein kv put current --key {ADDRESS_KEY}" in script
    assert "estuary train job.yaml --set runtime.backend=ray" in script
    assert "skein application shutdown current" in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to parse the scripts")
def test_scripts_are_valid_shell(job: JobSpec, tmp_path: Path) -> None:
    spec = spec_of(job, tmp_path, env_archive="env.tar.gz")
    for name, service in spec.services.items():
        assert service.files["environment"].source.endswith("env.tar.gz")
        assert service.script.splitlines()[1] == "source environment/bin/activate"
        parsed = subprocess.run(["bash", "-n"], input=service.script, text=True, check=False)
        assert parsed.returncode == 0, name


# ray, skein, estuary and hostname as shell functions that log their calls.
_STUBS = """
ray() { echo "ray $*" >> calls; }
skein() { echo "skein $*" >> calls; }
estuary() { echo "estuary $*" >> calls; return "$TRAIN_STATUS"; }
hostname() { echo node1.example; }
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to run the script")
@pytest.mark.parametrize(("status", "final"), [(0, "SUCCEEDED"), (3, "FAILED")])
def test_driver_script_starts_head_trains_and_shuts_down(
    job: JobSpec, tmp_path: Path, status: int, final: str
) -> None:
    script = spec_of(job, tmp_path).services["driver"].script
    env = {"PATH": "/usr/bin:/bin", "TRAIN_STATUS": str(status)}
    run = subprocess.run(
        ["bash", "-c", _STUBS + script], cwd=tmp_path, env=env, capture_output=True, check=False
    )
    assert run.returncode == status  # the run's exit status is the container's
    assert (tmp_path / "calls").read_text().splitlines() == [
        "ray start --head --port=6379 --num-cpus=0 --dashboard-host=0.0.0.0",
        f"skein kv put current --key {ADDRESS_KEY} --value node1.example:6379",
        "estuary train job.yaml --set runtime.backend=ray",
        "ray stop",
        f"skein application shutdown current --status {final}",
    ]
    written = job_from_dict(yaml.safe_load((tmp_path / "job.yaml").read_text()))
    assert written.runtime.resolved_roles() == job.runtime.resolved_roles()
