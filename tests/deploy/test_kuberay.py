"""estuary render k8s: a ConfigMap and a RayJob that the RayJob CRD's schema accepts
and that give back the job's roles and resources."""

from __future__ import annotations

import copy
import gzip
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from estuary.cli import main
from estuary.config import JobSpec, job_from_dict
from estuary.deploy import RenderOptions, RenderWarning, render

REPO = Path(__file__).resolve().parents[2]
CRD = REPO.parent / "shared" / "k8s" / "ray.io_rayjobs.yaml.gz"  # ../shared/k8s, not copied here


def strict(schema: Any) -> Any:
    """The CRD's OpenAPI schema as a JSON schema that fails where Kubernetes would
    silently drop a field: objects with declared properties allow no others
    (Kubernetes prunes unknown fields), and ``x-kubernetes-int-or-string`` means
    an integer or a string."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@pytest.fixture(scope="module")
def rayjob_schema() -> dict[str, Any]:
    if not CRD.exists():
        pytest.skip(f"the RayJob CRD is not at {CRD} (../shared/k8s/ next to the repository)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser: ~10x faster
    crd = yaml.load(gzip.decompress(CRD.read_bytes()), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(version["schema"]["openAPIV3Schema"])


def documents(job: JobSpec, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    config, ray_job = yaml.safe_load_all(render("k8s", job, RenderOptions(**options)))
    return config, ray_job


def test_rayjob_matches_the_crd_schema(job: JobSpec, rayjob_schema: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    # No check_schema() of the 1 MB CRD against the meta-schema: seconds, and not ours.
    validator = jsonschema.Draft7Validator(rayjob_schema)
    _, ray_job = documents(job, image="registry.example/estuary:1", namespace="ml")
    validator.validate(ray_job)
    # The check can fail: a misspelt field is refused, as Kubernetes would drop it.
    broken = copy.deepcopy(ray_job)
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def test_round_trip_gives_back_roles_and_resources(job: JobSpec) -> None:
    config, ray_job = documents(job)
    groups = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    seen = {}
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        requests = container["resources"]["requests"]
        assert container["resources"]["limits"] == requests
        params = group["rayStartParams"]
        (marker,) = json.loads(json.loads(params["resources"]))  # '"{\"estuary_ps\":1}"'
        role = marker.removeprefix("estuary_")
        assert group["groupName"] == role.replace("_", "-")
        cpu = requests["cpu"]
        seen[role] = (
            group["replicas"],
            group["minReplicas"],
            group["maxReplicas"],
            float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu),
            float(requests.get("nvidia.com/gpu", 0)),
            int(requests["memory"].removesuffix("Mi")) if "memory" in requests else None,
        )
    plans = job.runtime.resolved_roles()
    expected = {
        p.role: (p.count, p.min, p.max, p.cpus, p.gpus, p.memory_mb)
        for p in plans.values()
        if p.role != "driver"
    }
    assert seen == expected
    head = ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]
    (container,) = head["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "4096Mi"}
    assert head["rayStartParams"]["num-cpus"] == "0"  # no role process on the head
    # The job travels whole in the ConfigMap: the same roles, set to run on this cluster.
    carried = job_from_dict(yaml.safe_load(config["data"]["job.yaml"]))
    assert carried.runtime.resolved_roles() == plans
    assert carried.runtime.backend == "ray"
    assert (carried.runtime.ray.address, carried.runtime.ray.role_resources) == ("auto", True)
    assert replace(carried, runtime=job.runtime, base_dir=job.base_dir) == job
    volume = head["template"]["spec"]["volumes"][0]
    assert volume["configMap"]["name"] == config["metadata"]["name"]


def test_entrypoint_trains_the_mounted_job_on_ray(job: JobSpec) -> None:
    _, ray_job = documents(job)
    entrypoint = ray_job["spec"]["entrypoint"]
    assert entrypoint == "estuary train /etc/estuary/job.yaml --set runtime.backend=ray"
    _, custom = documents(job, entrypoint="estuary train /etc/estuary/job.yaml --resume")
    assert custom["spec"]["entrypoint"] == "estuary train /etc/estuary/job.yaml --resume"


def test_roles_without_processes_get_no_group(job: JobSpec) -> None:
    runtime = job_from_dict(
        {
            "data": {"sources": [{"path": "/data/x.tsv"}], "schema": {"sparse": ["C1"]}},
            "runtime": {"roles": {"ps": {"count": 2}}},
            "output": {"dir": "/mnt/runs"},
        }
    )
    _, ray_job = documents(runtime)
    groups = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["ps", "trainer"]  # no executors, no workers


def test_relative_paths_are_warned_about(job: JobSpec) -> None:
    sources = [replace(job.data.dataset.streams["train"].sources[0], path="data/{{HH}}.tsv")]
    streams = {"train": replace(job.data.dataset.streams["train"], sources=sources)}
    relative = replace(
        job,
        data=replace(job.data, dataset=replace(job.data.dataset, streams=streams)),
        output=replace(job.output, dir="runs/x"),
    )
    with pytest.warns(RenderWarning) as caught:
        documents(relative)
    assert [str(w.message).split(":")[0] for w in caught] == [
        "data.dataset.streams.train.sources[0].path",
        "output.dir",
    ]
    assert "'runs/x' resolves against /etc/estuary (read-only)" in str(caught[1].message)


def test_cli_writes_the_manifest(job_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "rayjob.yaml"
    argv = ["render", "k8s", str(job_file), "--output", str(out), "--image", "img:1"]
    assert main([*argv, "--set", "runtime.roles.ps.count=3", "--namespace", "ml"]) == 0
    config, ray_job = yaml.safe_load_all(out.read_text())
    assert [config["kind"], ray_job["kind"], ray_job["apiVersion"]] == [
        "ConfigMap",
        "RayJob",
        "ray.io/v1",
    ]
    assert ray_job["metadata"] == {
        "name": "criteo-dlrm",
        "labels": {"app.kubernetes.io/name": "estuary"},
        "namespace": "ml",
    }
    groups = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert groups[0]["replicas"] == 3


def test_cli_renders_a_local_job_for_ray(tmp_path: Path) -> None:
    job_file = tmp_path / "local.yaml"
    job_file.write_text(
        "data: {sources: [{path: /data/x.tsv}], schema: {sparse: [C1]}}\n"
        "output: {dir: /mnt/runs}\n"
        "runtime: {roles: {embedding_worker: {count: 1}}}\n"  # a Ray-only role
    )
    out = tmp_path / "rayjob.yaml"
    assert main(["render", "k8s", str(job_file), "--output", str(out)]) == 0
    config, _ = yaml.safe_load_all(out.read_text())
    assert yaml.safe_load(config["data"]["job.yaml"])["runtime"]["backend"] == "ray"


def test_an_option_of_another_target_is_an_error(
    job_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["render", "k8s", str(job_file), "--queue", "prod"]) == 2
    assert "--queue: not an option of render target 'k8s'" in capsys.readouterr().err
    assert main(["render", "helm", str(job_file)]) == 2
    assert "render target 'helm' is unknown (available: k8s, yarn)" in capsys.readouterr().err
